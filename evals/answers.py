"""What the server answered, as the recorder saw it, and the checks on each answer.

`Traffic` indexes every recorded completions request by the token ids of each of its prompts
(a request may batch several; choice p answers prompt p), so each prompt lm_eval sent can be
claimed once by the sample it belongs to: a prompt sent twice (a retry) stays unclaimed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from prompts import Generated, Scored

# A log-softmax value is <= 0 up to float rounding.
LOGPROB_SLACK = 1e-6

Fail = Callable[[str], None]


@dataclass(frozen=True)
class Answer:
    """One prompt of one recorded request and the choice that answered it."""

    request: dict
    choice: dict
    usage: dict
    num_prompts: int  # prompts in its HTTP request: usage counts them all


class Traffic:
    def __init__(self, records: list[dict], fail: Fail) -> None:
        self.num_requests = {"loglikelihood": 0, "generate": 0}
        self.num_prompts = {"loglikelihood": 0, "generate": 0}
        self._unclaimed: dict[tuple[str, tuple[int, ...]], list[Answer]] = defaultdict(list)
        for i, record in enumerate(records):
            self._add(i, record, fail)

    def claim(self, kind: str, token_ids: tuple[int, ...]) -> Answer | None:
        answers = self._unclaimed.get((kind, token_ids))
        return answers.pop(0) if answers else None

    def num_unclaimed(self) -> int:
        return sum(len(a) for a in self._unclaimed.values())

    def _add(self, i: int, record: dict, fail: Fail) -> None:
        where = f"recorded request {i} ({record.get('method')} {record.get('path')})"
        if record.get("method") != "POST" or record.get("path") != "/v1/completions":
            fail(f"{where}: lm_eval's completions client should send only POST /v1/completions")
            return
        if record.get("status") != 200:
            fail(f"{where}: HTTP {record.get('status')}: {record.get('error') or record.get('response')}")
            return
        request, response = record.get("request"), record.get("response")
        prompts = request.get("prompt") if isinstance(request, dict) else None
        if not (isinstance(prompts, list) and prompts and all(_is_token_ids(p) for p in prompts)):
            fail(f"{where}: expected a batch of token-id prompts (tokenized_requests), got {prompts!r:.200}")
            return
        choices = response.get("choices") if isinstance(response, dict) else None
        by_index = {c.get("index"): c for c in choices} if isinstance(choices, list) else {}
        if sorted(by_index) != list(range(len(prompts))) or len(choices) != len(prompts):
            fail(f"{where}: {len(prompts)} prompts need choices indexed 0..{len(prompts) - 1}, got {response!r:.300}")
            return
        kind = "loglikelihood" if request.get("echo") is True and request.get("max_tokens") == 1 else "generate"
        self.num_requests[kind] += 1
        self.num_prompts[kind] += len(prompts)
        usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}
        for p, token_ids in enumerate(prompts):
            self._unclaimed[(kind, tuple(token_ids))].append(Answer(request, by_index[p], usage, len(prompts)))


def check_scored(answer: Answer, want: Scored, where: str, fail: Fail) -> tuple[float, bool] | None:
    """The answer to one loglikelihood request (echo, logprobs=1, max_tokens=1): every prompt token
    but the first scored, one token generated; returns lm_eval's (loglikelihood, is_greedy) from it."""
    n = len(want.token_ids)
    logprobs = answer.choice.get("logprobs") or {}
    values, tops, tokens = (logprobs.get(k) for k in ("token_logprobs", "top_logprobs", "tokens"))
    if not all(isinstance(x, list) and len(x) == n + 1 for x in (values, tops, tokens)):
        fail(f"{where}: logprobs must list {n} prompt tokens + 1 generated, got {logprobs!r:.300}")
        return None
    if values[0] is not None or tops[0] is not None:
        fail(f"{where}: the first prompt token has no logprob (null), got {values[0]!r}, {tops[0]!r}")
    bad = [i for i in range(1, n + 1) if not _is_scored(values[i], tops[i])]
    if bad:
        i = bad[0]
        fail(f"{where}: {len(bad)} tokens without a well-formed logprob, first at {i}: {values[i]!r}, top {tops[i]!r}")
        return None
    if answer.choice.get("finish_reason") not in ("length", "stop"):
        fail(f"{where}: finish_reason {answer.choice.get('finish_reason')!r}")
    if answer.num_prompts == 1 and (answer.usage.get("prompt_tokens"), answer.usage.get("completion_tokens")) != (n, 1):
        fail(f"{where}: usage {answer.usage} for {n} prompt tokens and 1 generated")
    # lm_eval's own parse_logprobs: the continuation's tokens, the generated one left out.
    start = want.num_context_tokens
    loglikelihood = sum(values[start:-1])
    is_greedy = all(v == max(top.values()) for v, top in zip(values[start:-1], tops[start:-1]))
    return loglikelihood, is_greedy


def check_generated(answer: Answer, want: Generated, stops: tuple[str, ...], where: str, fail: Fail) -> str | None:
    """The answer to one generate-until request; returns its text."""
    request, choice = answer.request, answer.choice
    if request.get("max_tokens") != want.max_tokens:
        fail(f"{where}: lm_eval sent max_tokens {request.get('max_tokens')!r}, the task says {want.max_tokens}")
    text = choice.get("text")
    if not isinstance(text, str):
        fail(f"{where}: text {text!r}")
        return None
    inside = [s for s in stops if s and s in text]
    if inside:
        fail(f"{where}: stop sequence {inside[0]!r} inside the returned text {text!r}")
    num_tokens = answer.usage.get("completion_tokens")
    limit = want.max_tokens * answer.num_prompts
    if not isinstance(num_tokens, int) or not 0 < num_tokens <= limit:
        fail(f"{where}: completion_tokens {num_tokens!r}, max_tokens {want.max_tokens} per prompt")
    finish, reason = choice.get("finish_reason"), choice.get("stop_reason")
    if finish == "length":
        if answer.num_prompts == 1 and num_tokens != want.max_tokens:
            fail(f"{where}: finish_reason length after {num_tokens!r} of {want.max_tokens} tokens")
    elif finish == "stop":
        if reason is not None and reason not in stops:
            fail(f"{where}: stop_reason {reason!r} is none of the stop sequences sent {stops}")
    else:
        fail(f"{where}: finish_reason {finish!r}")
    return text


def is_logprob(value: object) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool) and math.isfinite(value) \
        and value <= LOGPROB_SLACK


def _is_scored(value: object, top: object) -> bool:
    """A prompt token's logprob and its top-1 alternative (and the token itself when it is not the top:
    OpenAI's legacy completions): finite, <= 0, the token at most the top."""
    return is_logprob(value) and isinstance(top, dict) and 1 <= len(top) <= 2 \
        and all(is_logprob(v) for v in top.values()) and value <= max(top.values()) + LOGPROB_SLACK


def _is_token_ids(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) \
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
