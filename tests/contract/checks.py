"""The checks every deployment must pass, shared by the colocated and the P/D test modules."""

from __future__ import annotations

import dataclasses

import httpx
import openai

from tests.contract.cases import CASES
from tests.contract.run import ask, check_framing


def check_case(client: openai.OpenAI, base_url: str, index: int) -> None:
    case = CASES[index]
    plain, _ = ask(client, index, stream=False)
    streamed, chunks = ask(client, index, stream=True)
    check_framing(case, chunks)
    for answer in (plain, streamed):
        assert answer.text == case.text, case.name
        assert answer.finish_reason == case.finish_reason, case.name
        assert answer.stop_reason == case.stop_reason, case.name
        assert answer.usage[1] == case.completion_tokens, case.name
    # rule 15: streaming equals non-streaming, to the token and the logprob
    assert dataclasses.replace(plain, request_id="") == dataclasses.replace(streamed, request_id=""), case.name
    if plain.token_ids is not None:
        assert len(plain.token_ids) == case.completion_tokens
        assert plain.token_ids[-1] == case.generated[case.completion_tokens - 1] or case.params.get("min_tokens")
    if plain.logprobs is not None:
        assert len(plain.logprobs) == case.completion_tokens and all(lp < 0 for lp in plain.logprobs)
    for answer in (plain, streamed):  # rule 20: the ledger agrees with the usage the client got
        record = httpx.get(f"{base_url}/admin/ledger/{answer.request_id}").json()
        assert record["completion_tokens"] == answer.usage[1] and record["prompt_tokens"] == answer.usage[0]
        assert record["finish_reason"] == answer.finish_reason and record["stop_reason"] == answer.stop_reason
        assert record["violations"] == []
