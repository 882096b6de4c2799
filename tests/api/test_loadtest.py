"""The load test: the contract checks of `pegaserve.testing.contract` on hand-made answers (each
check shown to catch a bad one), its request mix, and short real Locust runs against an in-process
colocated server — one clean, one against a server that breaks the contract on purpose."""

from __future__ import annotations

import csv
import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loadtests.workload import MAX_TOKENS, GreedyMemory, plan_request
from pegaserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pegaserve.testing import contract as cc
from pegaserve.testing.contract import Malformed, Params, answer_from_body, answer_from_sse

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- hand-made answers

PARAMS = Params(chat=False, stream=False, include_usage=False, num_choices=1, max_tokens=4, return_token_ids=True)


def body(text=" a b", finish="length", stop_reason=None, token_ids=(5, 6, 7, 8), usage=(3, 4), logprobs=None,
         request_id="cmpl-1") -> dict:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    prompt, completion = usage
    return {"id": request_id, "object": "text_completion", "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def chat_stream_lines(deltas=(" a", " b"), finish="stop", stop_reason="x", usage=(3, 3)) -> list[str]:
    """A chat stream: role chunk, one chunk per delta, the finishing chunk, the usage chunk, [DONE]."""
    def chunk(choices, **extra) -> str:
        return "data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": choices,
                                      **extra})

    def choice(content, finish_reason=None, reason=None) -> dict:
        return {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": reason}

    prompt, completion = usage
    return [chunk([{**choice(""), "delta": {"role": "assistant", "content": ""}}]),
            *(chunk([choice(d)]) for d in deltas),
            chunk([choice("", finish, stop_reason)]),
            chunk([], usage={"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}),
            "data: [DONE]"]


CHAT_STREAM = Params(chat=True, stream=True, include_usage=True, num_choices=1, max_tokens=4, stop=("x",))


def framing_problems(lines: list[str], params: Params = CHAT_STREAM) -> list[str]:
    return cc.check_framing(answer_from_sse(lines, chat=params.chat).framing, params)


def problems_of(params: Params, **body_fields) -> list[str]:
    return cc.check_answer(answer_from_body(body(**body_fields), params.chat), params)


def record(request_id="cmpl-1", completion=4, prompt=3, finish="length", stop_reason=None, kind="length",
           status="finished", violations=()) -> dict:
    return {"request_id": request_id, "status": status, "prompt_tokens": prompt, "completion_tokens": completion,
            "finish_reason": finish, "stop_reason": stop_reason, "violations": list(violations),
            "stop_cause": {"kind": kind, "token_id": None, "text": None}}


def test_good_answers_pass_every_check():
    assert problems_of(PARAMS) == []
    lines = chat_stream_lines()
    assert framing_problems(lines) == []
    answer = answer_from_sse(lines, chat=True)
    assert answer.choices[0].text == " a b" and answer.choices[0].stop_reason == "x"
    assert cc.check_answer(answer, CHAT_STREAM) == []
    assert cc.check_ledger(answer_from_body(body(), False), [record()]) == []
    assert cc.check_ledger(answer, [record("chatcmpl-1", 3, 3, "stop", "x", "string")]) == []


def test_stream_and_body_fold_to_the_same_answer():
    def chunk(text, token_id, finish, reason, logprob) -> str:
        choice = {"index": 0, "text": text, "token_ids": [token_id], "finish_reason": finish, "stop_reason": reason,
                  "logprobs": {"tokens": [text], "token_logprobs": [logprob], "top_logprobs": [{text: logprob}]}}
        return "data: " + json.dumps({"id": "c", "choices": [choice]})

    stream = [
        chunk(" a", 5, None, None, -0.5),
        chunk(" b", 9, "stop", 9, -1.0),
        "data: [DONE]",
    ]
    plain = body(" a b", "stop", 9, (5, 9), (3, 2), {"tokens": [" a", " b"], "token_logprobs": [-0.5, -1.0],
                                                    "top_logprobs": [{" a": -0.5}, {" b": -1.0}]}, "c")
    streamed = answer_from_sse(stream, chat=False)
    assert dataclasses.replace(answer_from_body(plain, False), usage=None) == streamed
    assert streamed.choices[0].logprobs == (-0.5, -1.0) and streamed.choices[0].top_logprobs_sizes == (1, 1)


def test_a_finish_without_stop_reason_is_malformed():
    bad = body()
    del bad["choices"][0]["stop_reason"]
    with pytest.raises(Malformed, match="stop_reason"):
        answer_from_body(bad, chat=False)


def test_a_null_text_is_malformed():
    chat = {"id": "c", "choices": [{"index": 0, "message": {"role": "assistant", "content": None},
                                    "finish_reason": "stop", "stop_reason": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    with pytest.raises(Malformed, match="not a string"):
        answer_from_body(chat, chat=True)


def test_the_openai_clients_dumps_read_like_the_wire():
    """The openai types' `model_dump()` of a response and of a stream's chunks give the answer the
    raw JSON gives; the chunks' framing is checked without the lines the client consumed."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletionChunk

    raw = body(logprobs=_logprobs([-1.0] * 4))
    dumped = Completion.model_validate({**raw, "created": 0, "model": "m"}).model_dump()
    assert answer_from_body(dumped, False) == answer_from_body(raw, False)
    chunks = [ChatCompletionChunk.model_validate({**json.loads(line[6:]), "created": 0, "model": "m"}).model_dump()
              for line in GOOD[:-1]]
    from_client = cc.answer_from_chunks(chunks, chat=True)
    assert from_client == answer_from_sse(GOOD, chat=True) and from_client.framing.sse is None
    assert cc.check_answer(from_client, CHAT_STREAM) == []
    twice = cc.answer_from_chunks([*chunks[:-1], chunks[-2], chunks[-1]], chat=True)
    assert any("2 finishing chunks" in p for p in cc.check_answer(twice, CHAT_STREAM))


def _edit(lines: list[str], index: int, edit) -> list[str]:
    chunk = json.loads(lines[index][len("data: "):])
    edit(chunk)
    return [*lines[:index], "data: " + json.dumps(chunk), *lines[index + 1:]]


GOOD = chat_stream_lines()
FRAMING_BREAKS = {
    "no [DONE]": (GOOD[:-1], "does not end with"),
    "[DONE] twice": (GOOD + ["data: [DONE]"], "sent 2 times"),
    "two finishing chunks": ([*GOOD[:-3], GOOD[-3], *GOOD[-3:]], "2 finishing chunks"),
    "no finishing chunk": (_edit(GOOD, -3, lambda c: c["choices"][0].update(finish_reason=None, stop_reason=None)),
                           "0 finishing chunks"),
    "early stop_reason": (_edit(GOOD, 1, lambda c: c["choices"][0].update(stop_reason="x")), "null finish_reason"),
    "chunk after the finish": ([*GOOD[:-2], GOOD[1], *GOOD[-2:]], "after its finishing chunk"),
    "no usage chunk": ([*GOOD[:-2], GOOD[-1]], "0 usage chunks"),
    "usage chunk first": ([GOOD[-2], *GOOD[:-2], GOOD[-1]], "before every choice finished"),
    "usage chunk with choices": (_edit(GOOD, -2, lambda c: c.update(choices=json.loads(GOOD[1][6:])["choices"])),
                                 "carries choices"),
    "error event": ([*GOOD[:2], 'data: {"error": {"message": "boom"}}', *GOOD[2:]], "error event"),
    "ids differ": (_edit(GOOD, 1, lambda c: c.update(id="other")), "different ids"),
    "not an SSE line": (["event: x", *GOOD], "not a `data: ` event"),
    "no role first": (_edit(GOOD, 0, lambda c: c["choices"][0]["delta"].update(role=None)), "not 'assistant'"),
}


@pytest.mark.parametrize("name", FRAMING_BREAKS)
def test_framing_check_catches(name):
    lines, expected = FRAMING_BREAKS[name]
    problems = framing_problems(lines)
    assert any(expected in p for p in problems), problems


ONE_STOP = dataclasses.replace(PARAMS, stop=("b",), stop_token_ids=(8,))
INCLUDED = dataclasses.replace(PARAMS, stop=("b", " a"), include_stop_str_in_output=True)
WITH_LOGPROBS = dataclasses.replace(PARAMS, num_top_logprobs=1)


def _logprobs(values, tops=1) -> dict:
    return {"tokens": ["t"] * len(values), "token_logprobs": list(values),
            "top_logprobs": [{f"t{i}": -1.0 for i in range(tops)} for _ in values]}


# (params, body fields, what the problem says)
ANSWER_BREAKS = {
    "finish_reason null": (PARAMS, {"finish": None}, "finish_reason None"),
    "finish_reason unknown": (PARAMS, {"finish": "eos"}, "finish_reason 'eos'"),
    "no token_ids": (PARAMS, {"token_ids": None}, "no token_ids"),
    "length with stop_reason": (ONE_STOP, {"stop_reason": 8}, "finished by length with stop_reason"),
    "stop id not asked for": (ONE_STOP, {"finish": "stop", "stop_reason": 9, "token_ids": (5, 9)},
                              "not one of stop_token_ids"),
    "stop string not asked for": (ONE_STOP, {"finish": "stop", "stop_reason": "zz", "text": " a"},
                                  "not one of the stop strings"),
    "stop_reason bool": (ONE_STOP, {"finish": "stop", "stop_reason": True}, "of type bool"),
    "EOS under ignore_eos": (dataclasses.replace(PARAMS, ignore_eos=True), {"finish": "stop"}, "under ignore_eos"),
    "excluded stop string shown": (ONE_STOP, {"finish": "stop", "stop_reason": "b", "text": " a b"},
                                   "contains the excluded stop string 'b'"),
    "included stop string missing": (INCLUDED, {"finish": "stop", "stop_reason": "b", "text": " a"},
                                     "does not end with its included"),
    "included stop string ends early": (INCLUDED, {"finish": "stop", "stop_reason": "b", "text": " a b"},
                                        "stop string ' a' ends at 2"),
    "included tie lost to list order": (dataclasses.replace(INCLUDED, stop=("b", "ab")),
                                        {"finish": "stop", "stop_reason": "ab", "text": "ab"}, "should have won"),
    "length past a stop string": (INCLUDED, {"text": " x b"}, "ran to length past"),
    "more than max_tokens": (PARAMS, {"token_ids": (1, 2, 3, 4, 5), "usage": (3, 5)}, "outside 1..max_tokens=4"),
    "length before max_tokens": (PARAMS, {"token_ids": (1, 2, 3), "usage": (3, 3)}, "finished by length after 3"),
    "stop within min_tokens": (dataclasses.replace(ONE_STOP, min_tokens=2),
                               {"finish": "stop", "stop_reason": 8, "token_ids": (5, 8), "usage": (3, 2)}, "rule 6"),
    "fewer than min_tokens": (dataclasses.replace(PARAMS, min_tokens=3, return_token_ids=False),
                              {"finish": "stop", "token_ids": None, "usage": (3, 2)}, "fewer than min_tokens"),
    "trigger not last": (ONE_STOP, {"finish": "stop", "stop_reason": 8, "token_ids": (8, 5), "usage": (3, 2)},
                         "is not its trigger"),
    "ids and logprobs disagree": (WITH_LOGPROBS, {"logprobs": _logprobs([-1.0] * 3)}, "4 token ids but 3 logprobs"),
    "logprobs missing": (WITH_LOGPROBS, {}, "no logprobs"),
    "positive logprob": (WITH_LOGPROBS, {"logprobs": _logprobs([-1.0, 0.5, -1.0, -1.0])}, "has logprob 0.5"),
    # completions: the top-N and the sampled token, at most N + 1
    "too many top logprobs": (WITH_LOGPROBS, {"logprobs": _logprobs([-1.0] * 4, tops=3)}, "3 top logprobs"),
    "usage over max_tokens": (dataclasses.replace(PARAMS, return_token_ids=False),
                              {"token_ids": None, "usage": (3, 5)}, "outside 1..4"),
    "no prompt tokens": (PARAMS, {"usage": (0, 4)}, "prompt_tokens 0"),
}


@pytest.mark.parametrize("name", ANSWER_BREAKS)
def test_answer_check_catches(name):
    params, fields, expected = ANSWER_BREAKS[name]
    problems = problems_of(params, **fields)
    assert any(expected in p for p in problems), problems


def test_usage_checks_catch_bad_sums():
    bad = body()
    bad["usage"]["total_tokens"] = 99
    assert any("total_tokens 99" in p for p in cc.check_answer(answer_from_body(bad, False), PARAMS))
    two = {"id": "c", "choices": [body()["choices"][0], {**body()["choices"][0], "index": 1}],
           "usage": {"prompt_tokens": 6, "completion_tokens": 7, "total_tokens": 13}}
    params = dataclasses.replace(PARAMS, num_choices=2)
    assert any("!= 8 tokens in the choices" in p for p in cc.check_answer(answer_from_body(two, False), params))
    streamed = dataclasses.replace(CHAT_STREAM, include_usage=True)
    no_usage = answer_from_sse([*GOOD[:-2], GOOD[-1]], chat=True)
    assert any("no usage" in p for p in cc.check_usage(no_usage, streamed))
    assert cc.check_usage(no_usage, dataclasses.replace(streamed, include_usage=False)) == []


def test_what_the_contract_allows_passes():
    # rule 8: with min_tokens the first k tokens may hold a stop string
    assert problems_of(dataclasses.replace(ONE_STOP, min_tokens=2), text=" a b") == []
    # rule 5: a token stop on the max_tokens-th token is a stop
    assert problems_of(ONE_STOP, finish="stop", stop_reason=8, text=" a") == []
    # rule 12: an included stop-id trigger's text may complete a stop string
    assert problems_of(dataclasses.replace(INCLUDED, stop_token_ids=(8,)), finish="stop", stop_reason=8,
                       text=" a bc") == []
    # equal ends: the earlier list entry wins
    assert problems_of(dataclasses.replace(INCLUDED, stop=("ab", "b")), finish="stop", stop_reason="ab",
                       text="ab") == []


LEDGER_BREAKS = {
    "no record": ([None], "no ledger record"),
    "completion differs": ([record(completion=5)], "ledger completion_tokens 5 != usage 4"),
    "prompt differs": ([record(prompt=2)], "ledger prompt_tokens 2 != usage 3"),
    "finish differs": ([record(finish="stop", kind="eos")], "ledger finish_reason 'stop'"),
    "stop_reason differs": ([record(stop_reason=3)], "ledger stop_reason 3"),
    "cause kind differs": ([record(kind="eos")], "ledger stop cause 'eos'"),
    "violations": ([record(violations=["trigger 5 is not the last committed token"])], "invariant violations"),
    "still in flight": ([record(status="in_flight")], "ledger status 'in_flight'"),
    "no violations list": ([{k: v for k, v in record().items() if k != "violations"}], "invariant violations"),
}


@pytest.mark.parametrize("name", LEDGER_BREAKS)
def test_ledger_check_catches(name):
    records, expected = LEDGER_BREAKS[name]
    problems = cc.check_ledger(answer_from_body(body(), False), records)
    assert any(expected in p for p in problems), problems


def test_ledger_keys_follow_the_engine_request_ids():
    one = answer_from_body(body(), False)
    two = answer_from_body({**body(), "choices": [body()["choices"][0], {**body()["choices"][0], "index": 1}]}, False)
    assert cc.ledger_keys(one) == ["cmpl-1"] and cc.ledger_keys(two) == ["cmpl-1-0", "cmpl-1-1"]


# ---------------------------------------------------------------- a known outcome, and rule 15

EXPECTED = cc.Expected(" a b", "length", None, 4, last_token_id=8, rules=(2, 19))


def test_the_expected_outcome_passes():
    assert cc.check_answer(answer_from_body(body(), False), PARAMS, EXPECTED) == []
    assert cc.check_answer(answer_from_body(body(logprobs=_logprobs([-1.0] * 4)), False), WITH_LOGPROBS,
                           EXPECTED) == []
    streamed = answer_from_sse(chat_stream_lines(usage=(3, 4)), chat=True)
    assert cc.check_expected(streamed, cc.Expected(" a b", "stop", "x", 4)) == []


# body fields -> what the problem says
EXPECTED_BREAKS = {
    "text": ({"text": " a"}, "rules 2, 19: text ' a', expected ' a b'"),
    "finish_reason": ({"finish": "stop"}, "finish_reason 'stop', expected 'length'"),
    "stop_reason": ({"stop_reason": 8}, "stop_reason 8, expected None"),
    "completion_tokens": ({"usage": (3, 3)}, "rule 19: usage completion_tokens 3, expected 4"),
    "token id count": ({"token_ids": (5, 6, 8)}, "rule 19: 3 token ids, expected 4"),
    "last token id": ({"token_ids": (5, 6, 7, 9)}, "last token id 9, expected 8"),
    "logprob count": ({"logprobs": _logprobs([-1.0] * 3)}, "rule 7: 3 logprobs, expected 4"),
    "logprob not negative": ({"logprobs": _logprobs([-1.0, 0.0, -1.0, -1.0])}, "are not all < 0"),
}


@pytest.mark.parametrize("name", EXPECTED_BREAKS)
def test_expected_check_catches(name):
    fields, expected = EXPECTED_BREAKS[name]
    answer = answer_from_body(body(**fields), False)
    for problems in (cc.check_expected(answer, EXPECTED), cc.check_answer(answer, PARAMS, EXPECTED)):
        assert any(expected in p for p in problems), problems


def test_expected_check_catches_split_characters_and_extra_choices():
    split = answer_from_sse(chat_stream_lines(deltas=(" a", " \ufffd")), chat=True)
    assert any("rule 14: chunk 2 splits a character" in p
               for p in cc.check_expected(split, cc.Expected(" a b", "stop", "x", 3)))
    shown = cc.check_expected(split, cc.Expected(" a \ufffd", "stop", "x", 3))  # the text really holds one
    assert shown == []
    two = answer_from_body({**body(), "choices": [body()["choices"][0], {**body()["choices"][0], "index": 1}]}, False)
    assert cc.check_expected(two, EXPECTED) == ["rules 2, 19: 2 choices, expected 1"]


# body fields of the streamed answer -> what the problem says
STREAMING_BREAKS = {
    "text": ({"text": " a c"}, "rule 15: choice 0's text streamed ' a c', not streamed ' a b'"),
    "finish": ({"finish": "stop", "stop_reason": 8}, "choice 0's stop_reason streamed 8"),
    "token ids": ({"token_ids": (5, 6, 7, 9)}, "choice 0's token_ids streamed (5, 6, 7, 9)"),
    "logprobs": ({"logprobs": _logprobs([-1.0] * 4)}, "choice 0's logprobs streamed"),
    "usage": ({"usage": (4, 4)}, "rule 15: usage streamed"),
}


@pytest.mark.parametrize("name", STREAMING_BREAKS)
def test_streaming_equality_check_catches(name):
    fields, expected = STREAMING_BREAKS[name]
    plain = answer_from_body(body(), False)
    assert cc.check_streaming_equals(plain, answer_from_body(body(request_id="other"), False)) == []
    problems = cc.check_streaming_equals(plain, answer_from_body(body(**fields), False))
    assert any(expected in p for p in problems), problems


# ---------------------------------------------------------------- the request mix


def test_planned_requests_are_valid_and_small():
    rng, memory = random.Random(0), GreedyMemory()
    memory.outputs[(False, "Hello there")] = ((11, 12, 13), " x y z")
    memory.outputs[(True, "Hello there")] = ((11, 12, 13), " x y z")
    for _ in range(500):
        chat, stream = rng.random() < 0.5, rng.random() < 0.5
        planned = plan_request(rng, memory, chat, stream, batch=not chat and rng.random() < 0.2)
        (ChatCompletionRequest if chat else CompletionRequest).model_validate(planned.body)
        params = planned.params()
        assert 1 <= params.max_tokens <= MAX_TOKENS and 0 <= params.min_tokens <= params.max_tokens
        assert all(params.stop) and len(params.stop) <= 16
        assert params.stream == stream and params.num_choices == (2 if planned.batch else 1)


def test_greedy_memory_learns_only_the_greedy_path():
    memory = GreedyMemory()
    answer = answer_from_body(body(), False)
    memory.learn(False, "p", {"temperature": 1.0}, answer)
    memory.learn(False, "p", {"temperature": 0, "min_tokens": 2}, answer)
    assert memory.get(False, "p") is None
    memory.learn(False, "p", {"temperature": 0}, answer)
    assert memory.get(False, "p") == ((5, 6, 7, 8), " a b")


# ---------------------------------------------------------------- real Locust runs


@pytest.fixture
def local_server(tiny_model_dir):
    """One frontend per run: its engine serves the event loop of one server."""
    from pegaserve.standalone import build_local_frontend

    return build_local_frontend()


def run_locust(base_url: str, out: Path, users: int, seconds: int) -> tuple[subprocess.CompletedProcess, dict]:
    command = [sys.executable, "-m", "locust", "-f", "loadtests/locustfile.py", "--headless", "--host", base_url,
               "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--stop-timeout", "30",
               "--csv", str(out / "run"), "--only-summary"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=seconds + 90)
    with open(out / "run_stats.csv") as f:
        rows = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    return done, rows


def count(rows: dict, column: str, kind: str | None = None) -> int:
    """A column summed over the rows of one request type (None: the Aggregated row)."""
    if kind is None:
        return int(rows[("", "Aggregated")][column])
    return sum(int(row[column]) for (k, _), row in rows.items() if k == kind)


def test_short_locust_run_is_clean(local_server, tmp_path):
    from pegaserve.api.app import build_app
    from tests.contract.server import ThreadedServer

    with ThreadedServer(build_app(local_server)) as server:
        done, rows = run_locust(server.base_url, tmp_path, users=4, seconds=12)
        summary = httpx.get(f"{server.base_url}/admin/ledger").json()
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert count(rows, "Failure Count") == 0, log[-4000:]
    assert count(rows, "Request Count", "POST") > 0 and count(rows, "Request Count", "GET") > 0
    assert summary["invariant_violations"] == 0 and "stop causes seen" in log


def test_a_broken_server_fails_the_run(local_server, tmp_path):
    """A prompt token too many in non-streaming usage (consistent, so only the ledger can tell) and
    every finishing chunk sent twice when streaming."""
    from pegaserve.api.app import build_app
    from pegaserve.api.frontend import Frontend
    from tests.contract.server import ThreadedServer

    class BrokenFrontend(Frontend):
        async def complete(self, job):
            answer = await super().complete(job)
            answer["usage"]["prompt_tokens"] += 1
            answer["usage"]["total_tokens"] += 1
            return answer

        async def stream(self, job):
            async for chunk in super().stream(job):
                yield chunk
                if any(c.get("finish_reason") for c in chunk["choices"]):
                    yield chunk

    s = local_server
    broken = BrokenFrontend(s.engine, s.tokenizer, s.model, s.ledger, s.limits)
    with ThreadedServer(build_app(broken)) as server:
        done, rows = run_locust(server.base_url, tmp_path, users=2, seconds=5)
    assert done.returncode == 1, (done.stdout + done.stderr)[-4000:]
    assert count(rows, "Failure Count") > 0
    failures = (tmp_path / "run_failures.csv").read_text()
    assert "rule 17: choice 0 has 2 finishing chunks" in failures
    assert "rule 20: ledger prompt_tokens" in failures


def test_only_local_hosts_are_loaded():
    done = subprocess.run([sys.executable, "-m", "locust", "-f", "loadtests/locustfile.py", "--headless",
                           "--host", "http://example.com:8000", "-u", "1", "-t", "1s"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "only 127.0.0.1 / localhost" in done.stderr
