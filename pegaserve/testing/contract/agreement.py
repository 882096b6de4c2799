"""An answer against another account of the same request: the outcome a contract case scripts
(`Expected`), the same request in the other streaming mode (rule 15), and the ledger (rule 20).

Like `checks.py`, each function returns one line per problem, led by the rule it breaks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pegaserve.testing.contract.answers import Answer, Choice

REPLACEMENT_CHAR = "\ufffd"  # what a chunk shows when it splits a UTF-8 character


@dataclass(frozen=True)
class Expected:
    """What the client must see for a request whose model output is known (a contract case)."""

    text: str
    finish_reason: str
    stop_reason: int | str | None
    completion_tokens: int
    last_token_id: int | None = None  # the last kept token, where the script makes it certain
    rules: tuple[int, ...] = ()  # the rules the case stands for: they lead a mismatch's line


def check_expected(answer: Answer, expected: Expected) -> list[str]:
    """The exact outcome of a one-choice request; on a stream, also that no chunk splits a
    character (rule 14) when the expected text has no replacement character of its own."""
    lead = _lead(expected.rules)
    if len(answer.choices) != 1:
        return [f"{lead}: {len(answer.choices)} choices, expected 1"]
    (choice,) = answer.choices
    problems = [f"{lead}: {name} {getattr(choice, name)!r}, expected {getattr(expected, name)!r}"
                for name in ("text", "finish_reason", "stop_reason")
                if getattr(choice, name) != getattr(expected, name)]
    if answer.usage is None or answer.usage.completion_tokens != expected.completion_tokens:
        got = None if answer.usage is None else answer.usage.completion_tokens
        problems.append(f"rule 19: usage completion_tokens {got}, expected {expected.completion_tokens}")
    problems += _token_problems(choice, expected, lead)
    if answer.framing is not None and REPLACEMENT_CHAR not in expected.text:
        problems += [f"rule 14: chunk {j} splits a character: {d.text!r}"
                     for j, chunk in enumerate(answer.framing.chunks) for d in chunk.deltas
                     if REPLACEMENT_CHAR in d.text]
    return problems


def _lead(rules: tuple[int, ...]) -> str:
    if not rules:
        return "expected"
    return f"{'rules' if len(rules) > 1 else 'rule'} {', '.join(map(str, rules))}"


def _token_problems(choice: Choice, expected: Expected, lead: str) -> list[str]:
    problems = []
    ids, logprobs = choice.token_ids, choice.logprobs
    if ids is not None and len(ids) != expected.completion_tokens:
        problems.append(f"rule 19: {len(ids)} token ids, expected {expected.completion_tokens}")
    if ids and expected.last_token_id is not None and ids[-1] != expected.last_token_id:
        problems.append(f"{lead}: last token id {ids[-1]}, expected {expected.last_token_id}")
    if logprobs is not None and len(logprobs) != expected.completion_tokens:
        problems.append(f"rule 7: {len(logprobs)} logprobs, expected {expected.completion_tokens}")
    if logprobs is not None and not all(lp < 0 for lp in logprobs):
        problems.append(f"rule 7: logprobs {list(logprobs)} are not all < 0")
    return problems


def check_streaming_equals(plain: Answer, streamed: Answer) -> list[str]:
    """Rule 15: the stream amounts to the non-streaming answer, to the token and the logprob, with
    the same usage (the request ids differ: two requests)."""
    if len(plain.choices) != len(streamed.choices):
        return [f"rule 15: {len(streamed.choices)} streamed choices, {len(plain.choices)} not streamed"]
    problems = [f"rule 15: choice {a.index}'s {f.name} streamed {getattr(b, f.name)!r}, "
                f"not streamed {getattr(a, f.name)!r}"
                for a, b in zip(plain.choices, streamed.choices, strict=True) for f in fields(Choice)
                if getattr(a, f.name) != getattr(b, f.name)]
    if plain.usage != streamed.usage:
        problems.append(f"rule 15: usage streamed {streamed.usage}, not streamed {plain.usage}")
    return problems


def ledger_keys(answer: Answer) -> list[str]:
    """The ledger ids of an answer's choices: the response id, suffixed `-i` when a completions
    request carried several prompts (one engine request per prompt)."""
    if len(answer.choices) == 1:
        return [answer.request_id]
    return [f"{answer.request_id}-{c.index}" for c in answer.choices]


def check_ledger(answer: Answer, records: list[dict | None]) -> list[str]:
    """Rule 20: the ledger (one record per choice, in `ledger_keys` order; None where missing)
    agrees with what the client got and found no invariant violated."""
    problems = []
    for choice, record in zip(answer.choices, records, strict=True):
        if record is None:
            problems.append(f"rule 20: no ledger record for choice {choice.index}")
            continue
        problems += _record_problems(choice, record, answer.num_tokens(choice))
    found = [r for r in records if r is not None]
    if answer.usage is not None and len(found) == len(records):
        completion = sum(r.get("completion_tokens") or 0 for r in found)
        prompt = sum(r.get("prompt_tokens") or 0 for r in found)
        if completion != answer.usage.completion_tokens:
            problems.append(f"rule 20: ledger completion_tokens {completion} != usage "
                            f"{answer.usage.completion_tokens}")
        if prompt != answer.usage.prompt_tokens:
            problems.append(f"rule 20: ledger prompt_tokens {prompt} != usage {answer.usage.prompt_tokens}")
    return problems


def _record_problems(choice: Choice, record: dict, num_tokens: int | None) -> list[str]:
    where = f"choice {choice.index}"
    problems = []
    if record.get("status") != "finished":
        problems.append(f"rule 20: ledger status {record.get('status')!r} for finished {where}")
    violations = record.get("violations")
    if violations != []:
        problems.append(f"rule 20: ledger invariant violations for {where}: {violations!r}")
    for name in ("finish_reason", "stop_reason"):
        if record.get(name) != getattr(choice, name):
            problems.append(f"rule 20: ledger {name} {record.get(name)!r} != {getattr(choice, name)!r} for {where}")
    if num_tokens is not None and record.get("completion_tokens") != num_tokens:
        problems.append(f"rule 20: ledger completion_tokens {record.get('completion_tokens')} != {num_tokens} "
                        f"tokens in {where}")
    cause = record.get("stop_cause") or {}
    if cause.get("kind") != _expected_kind(choice):
        problems.append(f"causes: ledger stop cause {cause.get('kind')!r} for {where} finished "
                        f"{choice.finish_reason!r} with stop_reason {choice.stop_reason!r}")
    return problems


def _expected_kind(choice: Choice) -> str | None:
    if choice.finish_reason == "length":
        return "length"
    if choice.finish_reason != "stop":
        return None
    if choice.stop_reason is None:
        return "eos"
    return "token" if isinstance(choice.stop_reason, int) else "string"
