"""Checks one `make eval` run directory: exits 1, naming every problem, unless every request
lm_eval sent got a well-formed answer.

Reads what evals/run.py left there: run.json (lm_eval's exit code, model_args, the ledger's counts
before and after the run), lm_eval.log, traffic.jsonl (every HTTP request and answer, from the
recorder) and lm_eval's results_*.json and samples_*.jsonl (--log_samples). It checks that:

- lm_eval exited 0 and its log shows no failed or retried request (its API client retries on
  errors; run.py also sets max_retries=1, so a failure fails the run);
- every recorded request was a POST /v1/completions answered 200, and every prompt in them is
  claimed by exactly one logged sample (nothing sent twice, nothing logged that was never sent);
- each task logged one sample per item of its data file, each with its number of requests
  (multiple choice: one per choice; rolling: one per window; generate: one);
- every loglikelihood is a finite float <= 0 and every is_greedy a bool, both equal to what the
  server's logprobs give (every prompt token after the first scored, finite, <= its top-1);
- every generation is a string equal to the server's text, with none of the task's `until` stop
  sequences inside it, at most max_gen_toks tokens (usage), and a consistent finish_reason;
- the server's ledger gained no invariant violations during the run;
- unless --no-reference: every loglikelihood matches transformers' on the served model directory
  (evals/reference.py; relative 1e-4) and every is_greedy and greedy generation (text, finish and
  stop reason) equals transformers', except where its best two logits nearly tie.

Usage: .venv-eval/bin/python evals/check.py [RUN_DIR] [--no-reference]   (default tmp/eval)
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path

from answers import Traffic, check_generated, check_scored, is_logprob
from prompts import Generated, Prompts, Scored
from reference import Reference

RETRY_MARKERS = ("Retry attempt", "Retrying", "API request failed", "Exception:")
MAX_PROBLEMS_SHOWN = 30


class Check:
    def __init__(self, run_dir: Path, use_reference: bool) -> None:
        self.run_dir = run_dir
        self.use_reference = use_reference
        self.reference: Reference | None = None  # loaded by run
        self.problems: list[str] = []
        self.figures: dict[str, object] = {}
        self.compared = Counter()  # answers compared with the reference, by kind

    def fail(self, message: str) -> None:
        self.problems.append(message)

    def run(self) -> None:
        run = json.loads((self.run_dir / "run.json").read_text())
        self._check_lm_eval(run)
        results = _one(self.run_dir.glob("lm_eval/**/results_*.json"))
        if results is None:
            self.fail("lm_eval wrote no results_*.json")
            return
        results = json.loads(results.read_text())
        traffic = Traffic(_read_jsonl(self.run_dir / "traffic.jsonl"), self.fail)
        prompts = Prompts(run["model_args"])
        if self.use_reference:
            self.reference = Reference(prompts.client.tokenizer.name_or_path)
        for task, config in sorted(results["configs"].items()):
            samples_path = _one(self.run_dir.glob(f"lm_eval/**/samples_{task}_*.jsonl"))
            if samples_path is None:
                self.fail(f"{task}: no samples_{task}_*.jsonl (--log_samples)")
                continue
            self._check_task(task, config, _read_jsonl(samples_path), traffic, prompts)
        if traffic.num_unclaimed():
            self.fail(f"{traffic.num_unclaimed()} recorded prompts belong to no logged sample (sent twice?)")
        self.figures["http_requests"] = traffic.num_requests
        self.figures["prompts"] = traffic.num_prompts
        if self.reference is not None:
            self.figures["compared_with_transformers"] = dict(self.compared)
        self.figures["metrics"] = {t: {k: v for k, v in r.items() if k != "alias"} for t, r in results["results"].items()}
        self._check_ledger(run.get("ledger_before"), run.get("ledger_after"))

    def _check_lm_eval(self, run: dict) -> None:
        if run.get("lm_eval_rc") != 0:
            self.fail(f"lm_eval exited {run.get('lm_eval_rc')} (see {self.run_dir / 'lm_eval.log'})")
        log = (self.run_dir / "lm_eval.log").read_text(errors="replace").splitlines()
        retried = [line for line in log if any(m in line for m in RETRY_MARKERS)]
        if retried:
            self.fail(f"lm_eval's log shows {len(retried)} failed or retried requests, first: {retried[0][:300]}")

    def _check_ledger(self, before: object, after: object) -> None:
        """The server's ledger (GET /admin/ledger, before and after the run) gained no invariant violations."""
        counts = [x.get("invariant_violations") if isinstance(x, dict) else None for x in (before, after)]
        if not all(isinstance(c, int) for c in counts):
            self.fail(f"no ledger counts around the run (GET /admin/ledger): {before!r:.200}, {after!r:.200}")
        elif counts[1] > counts[0]:
            self.fail(f"the server's ledger gained {counts[1] - counts[0]} invariant violations during the run")
        self.figures["ledger_invariant_violations"] = counts[1]

    def _check_task(self, task: str, config: dict, samples: list[dict], traffic: Traffic, prompts: Prompts) -> None:
        output_type = config["output_type"]
        data_files = config["dataset_kwargs"]["data_files"]
        num_items = sum(len(_read_jsonl(Path(f))) for f in data_files.values())
        doc_ids = sorted(s.get("doc_id") for s in samples)
        if doc_ids != list(range(num_items)):
            self.fail(f"{task}: {len(samples)} samples for {num_items} items (doc ids {doc_ids[:5]}...)")
        stats = Counter()
        for sample in samples:
            where = f"{task} doc {sample.get('doc_id')}"
            arguments = [list(a.values()) for a in sample["arguments"].values()]
            answers = [_first(r) for r in sample["resps"]]
            if output_type == "multiple_choice":
                if len(arguments) != len(sample["doc"]["choices"]) or len(answers) != len(arguments):
                    self.fail(f"{where}: {len(arguments)} requests, {len(answers)} answers for "
                              f"{len(sample['doc']['choices'])} choices")
                for i, ((context, continuation), logged) in enumerate(zip(arguments, answers)):
                    stats["loglikelihood"] += 1
                    want = prompts.scored(context, continuation)
                    self._check_loglikelihood(f"{where} choice {i}", logged, [want], traffic, with_greedy=True)
            elif output_type == "loglikelihood_rolling":
                windows = prompts.rolling(arguments[0][0])
                stats["loglikelihood"] += len(windows)
                stats["passages"] += 1
                self._check_loglikelihood(where, answers[0], windows, traffic, with_greedy=False)
            elif output_type == "generate_until":
                (context, gen_kwargs), logged = arguments[0], answers[0]
                want = prompts.generated(context, gen_kwargs)
                stats["generate"] += 1
                stats[self._check_generation(where, logged, want, traffic)] += 1
            else:
                self.fail(f"{task}: output_type {output_type} is not checked")
        self.figures[task] = {"items": num_items, **stats}

    def _check_loglikelihood(self, where: str, logged: object, windows: list[Scored], traffic: Traffic,
                             with_greedy: bool) -> None:
        """`logged` is lm_eval's answer as its samples log it (strings): [ll, is_greedy] or [ll]."""
        fields = logged if isinstance(logged, list) else [logged]
        if len(fields) != (2 if with_greedy else 1):
            self.fail(f"{where}: logged answer {logged!r}")
            return
        loglikelihood, is_greedy = _float(fields[0]), (fields[1] if with_greedy else None)
        if loglikelihood is None or not is_logprob(loglikelihood):
            self.fail(f"{where}: loglikelihood {fields[0]!r} is not a finite float <= 0")
        if with_greedy and is_greedy not in ("True", "False"):
            self.fail(f"{where}: is_greedy {is_greedy!r} is not a bool")
        total, greedy = 0.0, True
        for w, want in enumerate(windows):
            answer = traffic.claim("loglikelihood", want.token_ids)
            if answer is None:
                self.fail(f"{where} window {w}: no recorded request sent these {len(want.token_ids)} token ids")
                return
            scored = check_scored(answer, want, f"{where} window {w}", self.fail)
            if scored is None:
                return
            total, greedy = total + scored[0], greedy and scored[1]
            self._compare_scored(f"{where} window {w}", scored, want)
        if loglikelihood is not None and not math.isclose(loglikelihood, total, rel_tol=1e-9, abs_tol=1e-9):
            self.fail(f"{where}: lm_eval logged loglikelihood {loglikelihood}, the server's logprobs sum to {total}")
        if with_greedy and is_greedy != str(greedy):
            self.fail(f"{where}: lm_eval logged is_greedy {is_greedy}, the server's logprobs say {greedy}")

    def _check_generation(self, where: str, logged: object, want: Generated, traffic: Traffic) -> str:
        if not isinstance(logged, str):
            self.fail(f"{where}: logged generation {logged!r} is not a string")
            return "malformed"
        answer = traffic.claim("generate", want.token_ids)
        if answer is None:
            self.fail(f"{where}: no recorded request sent these {len(want.token_ids)} token ids")
            return "unanswered"
        sent = answer.request.get("stop") or []
        # The task's stop sequences; lm_eval adds the EOS string only when it sends requests one at a
        # time (num_concurrent=1), and the server stops at EOS ids anyway.
        missing = [s for s in want.until if s not in sent]
        if missing:
            self.fail(f"{where}: lm_eval did not send stop sequences {missing} (sent {sent})")
        stops = tuple(dict.fromkeys((*want.until, *sent)))
        text = check_generated(answer, want, stops, where, self.fail)
        if text is not None and text != logged:
            self.fail(f"{where}: lm_eval logged {logged!r}, the server answered {text!r}")
        if text is not None and self.reference is not None:
            self._compare_generated(where, answer.choice, want, tuple(sent))
        reason = answer.choice.get("stop_reason")
        return f"finish {answer.choice.get('finish_reason')}" + (f" {reason!r}" if reason is not None else "")


    def _compare_scored(self, where: str, scored: tuple[float, bool], want) -> None:
        if self.reference is None:
            return
        ref = self.reference.score(want)
        self.compared["loglikelihood"] += 1
        if not math.isclose(scored[0], ref.loglikelihood, rel_tol=1e-4, abs_tol=1e-3):
            self.fail(f"{where}: loglikelihood {scored[0]}, transformers {ref.loglikelihood}")
        if ref.near_tie:
            self.compared["is_greedy near tie, not compared"] += 1
        elif scored[1] != ref.is_greedy:
            self.fail(f"{where}: is_greedy {scored[1]}, transformers {ref.is_greedy}")

    def _compare_generated(self, where: str, choice: dict, want: Generated, stops: tuple[str, ...]) -> None:
        ref = self.reference.generate(want, stops)
        if ref.near_tie:
            self.compared["generation near tie, not compared"] += 1
            return
        self.compared["generate"] += 1
        got = (choice.get("text"), choice.get("finish_reason"), choice.get("stop_reason"))
        if got != (ref.text, ref.finish_reason, ref.stop_reason):
            self.fail(f"{where}: the server answered (text, finish, stop) {got!r}, transformers' greedy "
                      f"{(ref.text, ref.finish_reason, ref.stop_reason)!r}")


def _first(value: object) -> object:
    """A request's first (only) response, as `resps` nests it."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _float(text: object) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _one(paths) -> Path | None:
    found = sorted(paths)
    return found[-1] if found else None


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str]) -> int:
    use_reference = "--no-reference" not in argv
    paths = [a for a in argv if a != "--no-reference"]
    run_dir = Path(paths[0] if paths else "tmp/eval")
    check = Check(run_dir, use_reference)
    check.run()
    print(json.dumps(check.figures, indent=1))
    if check.problems:
        for problem in check.problems[:MAX_PROBLEMS_SHOWN]:
            print(f"FAIL {problem}", file=sys.stderr)
        more = len(check.problems) - MAX_PROBLEMS_SHOWN
        print(f"eval check: {len(check.problems)} problems" + (f" ({more} not shown)" if more > 0 else "")
              + f"; run directory {run_dir}", file=sys.stderr)
        return 1
    print(f"eval check: every request answered and well formed ({run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
