"""The checks every deployment must pass, shared by the colocated and the P/D test modules."""

from __future__ import annotations

import httpx
import openai

from pegaserve.testing.contract import check_answer, check_ledger, check_streaming_equals, ledger_keys
from tests.contract.cases import CASES
from tests.contract.run import ask, case_expected, case_params


def check_case(client: openai.OpenAI, base_url: str, index: int) -> None:
    """The case streaming and not: the rules that hold for any output, framing (rules 14 and 17),
    the case's exact outcome, streaming equal to non-streaming (rule 15), and the ledger (rule 20)."""
    case, expected = CASES[index], case_expected(index)
    plain, _ = ask(client, index, stream=False)
    streamed, _ = ask(client, index, stream=True)
    problems = check_answer(plain, case_params(index, stream=False), expected)
    problems += check_answer(streamed, case_params(index, stream=True), expected)
    problems += check_streaming_equals(plain, streamed)
    for answer in (plain, streamed):
        records = [httpx.get(f"{base_url}/admin/ledger/{key}").json() for key in ledger_keys(answer)]
        problems += check_ledger(answer, records)
    assert problems == [], f"{case.name}: {problems}"
