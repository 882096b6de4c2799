"""docs/contract.md as code: parse an answer (`answers`), check it against the rules that hold for
any output (`checks`) and against another account of the same request — a contract case's known
outcome, the other streaming mode, the ledger (`agreement`). Used by the contract tests, the Locust
load test and the soak alike."""

from pegaserve.testing.contract.agreement import (
    Expected,
    check_expected,
    check_ledger,
    check_streaming_equals,
    ledger_keys,
)
from pegaserve.testing.contract.answers import (
    DONE,
    Answer,
    Choice,
    Chunk,
    Delta,
    Framing,
    Malformed,
    Params,
    SseLines,
    Usage,
    answer_from_body,
    answer_from_chunks,
    answer_from_sse,
    shows_output,
    sse_chunks,
)
from pegaserve.testing.contract.checks import (
    check_answer,
    check_choices,
    check_framing,
    check_logprobs,
    check_stop_reason,
    check_stop_strings,
    check_token_counts,
    check_usage,
)

__all__ = [
    "DONE", "Answer", "Choice", "Chunk", "Delta", "Expected", "Framing", "Malformed", "Params", "SseLines", "Usage",
    "answer_from_body", "answer_from_chunks", "answer_from_sse", "check_answer", "check_choices", "check_expected",
    "check_framing", "check_ledger", "check_logprobs", "check_stop_reason", "check_stop_strings",
    "check_streaming_equals", "check_token_counts", "check_usage", "ledger_keys", "shows_output", "sse_chunks",
]
