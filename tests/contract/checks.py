"""The checks every deployment must pass, shared by the colocated and the P/D test modules."""

from __future__ import annotations

import dataclasses

import httpx
import openai

from pegaserve.testing.contract import (
    Answer,
    Usage,
    check_answer,
    check_expected,
    check_ledger,
    check_streaming_equals,
    ledger_keys,
)
from tests.contract.cases import CASES
from tests.contract.run import ask, case_expected, case_params


def check_case(client: openai.OpenAI, base_url: str, index: int) -> None:
    """The case streaming and not: the rules that hold for any output, framing (rules 14 and 17),
    the case's exact outcome (in every choice, with n), streaming equal to non-streaming (rule 15),
    and the ledger (rule 20)."""
    case, expected = CASES[index], case_expected(index)
    plain, _ = ask(client, index, stream=False)
    streamed, _ = ask(client, index, stream=True)
    problems = []
    for answer, stream in ((plain, False), (streamed, True)):
        params = case_params(index, stream)
        if params.num_choices == 1:
            problems += check_answer(answer, params, expected)
        else:
            problems += check_answer(answer, params)
            problems += [f"choice {i}: {p}" for i, one in enumerate(per_choice(answer, params.num_choices))
                         for p in check_expected(one, expected)]
    problems += check_streaming_equals(plain, streamed)
    for answer in (plain, streamed):
        records = [httpx.get(f"{base_url}/admin/ledger/{key}").json() for key in ledger_keys(answer)]
        problems += check_ledger(answer, records)
    assert problems == [], f"{case.name}: {problems}"


def per_choice(answer: Answer, n: int) -> list[Answer]:
    """The answer as `n` one-choice answers (choices of one prompt), each with an equal share of
    the completion tokens: with equal choices, each then matches the case's `Expected`."""
    usage = answer.usage
    if usage is not None:
        share = usage.completion_tokens // n if usage.completion_tokens % n == 0 else -1
        usage = Usage(usage.prompt_tokens, share, usage.prompt_tokens + share)
    return [dataclasses.replace(answer, choices=(c,), usage=usage, framing=None) for c in answer.choices]

