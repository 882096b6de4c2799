"""docs/contract.md as checks on one answer: pure functions over parsed answers.

Each check returns the problems it found, one line each, led by the contract rule it breaks; an
empty list means the answer keeps that part of the contract. These checks hold for *any* model
output (a load test cannot know what the model will emit), for example: with `min_tokens > 0` the
first k tokens' text may legitimately contain a stop string, so the stop-string checks only run
with `min_tokens == 0`. What a known outcome adds (`Expected`) is checked in `agreement.py`.
"""

from __future__ import annotations

import math
from collections import Counter

from pegaserve.testing.contract.agreement import Expected, check_expected
from pegaserve.testing.contract.answers import Answer, Choice, Framing, Params

FINISH_REASONS = ("stop", "length")
LOGPROB_SLACK = 1e-6  # float rounding in log_softmax; a log-probability is otherwise <= 0


def check_answer(answer: Answer, params: Params, expected: Expected | None = None) -> list[str]:
    """Every check that needs only the answer and the request (a stream's framing too), and, where
    the outcome is known, the exact expectations."""
    problems = check_choices(answer, params)
    for check in (check_stop_reason, check_stop_strings, check_token_counts, check_logprobs):
        problems += [p for choice in answer.choices for p in check(choice, answer, params)]
    problems += check_usage(answer, params)
    if answer.framing is not None:
        problems += check_framing(answer.framing, params)
    if expected is not None:
        problems += check_expected(answer, expected)
    return problems


def check_framing(framing: Framing, params: Params) -> list[str]:
    """Rule 17: one finishing chunk per choice, earlier chunks with null finish_reason and
    stop_reason, one usage chunk last with include_usage, then [DONE] (where the lines were seen);
    a chat choice opens with the assistant role."""
    problems = _line_problems(framing)
    problems += [f"error event in the stream: {message}" for message in framing.errors]
    if len({c.id for c in framing.chunks}) > 1:
        problems.append("the stream's chunks carry different ids")
    finishes: Counter[int] = Counter()
    for chunk in framing.chunks:
        for d in chunk.deltas:
            if d.finish_reason is not None:
                finishes[d.index] += 1
            elif finishes[d.index]:
                problems.append(f"rule 17: choice {d.index} has a chunk after its finishing chunk")
            elif d.stop_reason is not None:
                problems.append(f"rule 17: choice {d.index}: a chunk with null finish_reason has stop_reason "
                                f"{d.stop_reason!r}")
        if chunk.has_usage and sum(finishes.values()) < params.num_choices:
            problems.append("rule 17: the usage chunk comes before every choice finished")
    problems += [f"rule 17: choice {i} has {finishes[i]} finishing chunks, not 1"
                 for i in range(params.num_choices) if finishes[i] != 1]
    return problems + _usage_chunk_problems(framing, params) + _role_problems(framing, params)


def _line_problems(framing: Framing) -> list[str]:
    sse = framing.sse
    if sse is None:
        return []
    problems = []
    if not sse.ends_with_done:
        problems.append("rule 17: the stream does not end with `data: [DONE]`")
    if sse.num_done > 1:
        problems.append(f"rule 17: `data: [DONE]` sent {sse.num_done} times")
    if sse.num_not_data:
        problems.append("rule 17: a stream line is not a `data: ` event")
    return problems


def _usage_chunk_problems(framing: Framing, params: Params) -> list[str]:
    if not params.include_usage:
        return []
    usage_chunks = [c for c in framing.chunks if c.has_usage]
    if len(usage_chunks) != 1:
        return [f"rule 17: {len(usage_chunks)} usage chunks with include_usage, not 1"]
    problems = []
    if usage_chunks[0].deltas:
        problems.append("rule 17: the usage chunk carries choices")
    if framing.chunks[-1] is not usage_chunks[0]:
        problems.append("rule 17: the usage chunk is not the last before [DONE]")
    return problems


def _role_problems(framing: Framing, params: Params) -> list[str]:
    if not params.chat:
        return []
    firsts: dict[int, str | None] = {}
    for chunk in framing.chunks:
        for d in chunk.deltas:
            firsts.setdefault(d.index, d.role)
    return [f"wire: chat choice {index}'s first delta has role {role!r}, not 'assistant'"
            for index, role in firsts.items() if role != "assistant"]


def check_choices(answer: Answer, params: Params) -> list[str]:
    problems = []
    indices = [c.index for c in answer.choices]
    if indices != list(range(params.num_choices)):
        problems.append(f"choices {indices} for {params.num_choices} prompt(s)")
    for c in answer.choices:
        if c.finish_reason not in FINISH_REASONS:
            problems.append(f"rule 17: choice {c.index} finished with finish_reason {c.finish_reason!r}")
        if params.return_token_ids and c.token_ids is None:
            problems.append(f"choice {c.index} has no token_ids although return_token_ids is true")
    return problems


def check_stop_reason(choice: Choice, answer: Answer, params: Params) -> list[str]:
    """The typed-causes table: null for length and EOS, the id for a stop_token_ids match, the
    string for a stop string; EOS is impossible under ignore_eos (rule 3)."""
    reason, where = choice.stop_reason, f"choice {choice.index}"
    if choice.finish_reason == "length":
        return [] if reason is None else [f"causes: {where} finished by length with stop_reason {reason!r}"]
    if choice.finish_reason != "stop":
        return []
    if reason is None:
        return [f"rule 3: {where} stopped on EOS (null stop_reason) under ignore_eos"] if params.ignore_eos else []
    if isinstance(reason, bool) or not isinstance(reason, int | str):
        return [f"causes: {where} has stop_reason {reason!r} of type {type(reason).__name__}"]
    if isinstance(reason, int) and reason not in params.stop_token_ids:
        return [f"causes: {where} has stop_reason {reason}, not one of stop_token_ids {list(params.stop_token_ids)}"]
    if isinstance(reason, str) and reason not in params.stop:
        return [f"causes: {where} has stop_reason {reason!r}, not one of the stop strings {list(params.stop)}"]
    return []


def check_stop_strings(choice: Choice, answer: Answer, params: Params) -> list[str]:
    """Rules 9-10 (with `min_tokens == 0`): an excluded stop string never shows in the text; an
    included one ends it, and no stop string ends earlier or, ending there too, comes first in the
    list (it would have won). With an included EOS/stop-id trigger nothing is checked: its text is
    shown (rule 12) and may hold a stop string that token-level decision pre-empted."""
    if not params.stop:
        return []
    where, text, reason = f"choice {choice.index}", choice.text, choice.stop_reason
    include = params.include_stop_str_in_output
    if include and isinstance(reason, str) and not text.endswith(reason):
        return [f"rule 10: {where}'s text does not end with its included stop string {reason!r}"]
    if params.min_tokens:
        return []  # rule 8: the first k tokens' text may hold a stop string; their end is not on the wire
    if not include:
        return [f"rule 10: {where}'s text contains the excluded stop string {s!r}" for s in params.stop if s in text]
    if choice.finish_reason == "length":
        return [f"rule 8: {where} ran to length past the stop string {s!r}" for s in params.stop if s in text]
    if not isinstance(reason, str):
        return []
    winner = params.stop.index(reason) if reason in params.stop else len(params.stop)
    problems = []
    for rank, s in enumerate(params.stop):
        end = _first_end(text, s)
        if end is not None and (end < len(text) or (end == len(text) and rank < winner)):
            problems.append(f"rule 9: {where}'s stop string {s!r} ends at {end}, and should have won over "
                            f"{reason!r} (text of {len(text)} chars)")
    return problems


def _first_end(text: str, s: str) -> int | None:
    """Where the first-ending occurrence of `s` in `text` ends (the first occurrence ends first)."""
    start = text.find(s)
    return None if start < 0 else start + len(s)


def check_token_counts(choice: Choice, answer: Answer, params: Params) -> list[str]:
    """Rules 2, 5, 6, 7 on one choice's token count (where the answer shows it)."""
    n, where = answer.num_tokens(choice), f"choice {choice.index}"
    problems = []
    if choice.token_ids is not None and choice.logprobs is not None and len(choice.token_ids) != len(choice.logprobs):
        problems.append(f"rule 7: {where} has {len(choice.token_ids)} token ids but {len(choice.logprobs)} logprobs")
    if isinstance(choice.stop_reason, int) and choice.token_ids and choice.token_ids[-1] != choice.stop_reason:
        problems.append(f"rule 7: {where}'s last token id {choice.token_ids[-1]} is not its trigger "
                        f"{choice.stop_reason}")
    if n is None:
        return problems
    if not 1 <= n <= params.max_tokens:
        problems.append(f"{where} has {n} completion tokens, outside 1..max_tokens={params.max_tokens}")
    if choice.finish_reason == "length" and n != params.max_tokens:
        problems.append(f"rule 2: {where} finished by length after {n} tokens, max_tokens={params.max_tokens}")
    if choice.finish_reason == "stop" and n <= params.min_tokens:
        problems.append(f"rule 6: {where} stopped at token {n}; min_tokens={params.min_tokens} allows the first "
                        f"stop at token {params.min_tokens + 1}")
    if n < params.min_tokens:
        problems.append(f"rule 6: {where} has {n} tokens, fewer than min_tokens={params.min_tokens}")
    return problems


def check_logprobs(choice: Choice, answer: Answer, params: Params) -> list[str]:
    """Rule 7: every kept token, the trigger too, has its real logprob; top lists are top-N (completions:
    and the sampled token, when it is not among them)."""
    if params.num_top_logprobs is None:
        return []
    where = f"choice {choice.index}"
    if choice.logprobs is None:
        return [f"rule 7: {where} has no logprobs although they were requested"]
    problems = [f"rule 7: {where}'s token {j} has logprob {lp!r}" for j, lp in enumerate(choice.logprobs)
                if not (isinstance(lp, float | int) and math.isfinite(lp) and lp <= LOGPROB_SLACK)]
    most = params.num_top_logprobs + (not params.chat)
    problems += [f"{where}'s token {j} has {size} top logprobs, asked for {params.num_top_logprobs}"
                 for j, size in enumerate(choice.top_logprobs_sizes or ()) if size > most]
    return problems


def check_usage(answer: Answer, params: Params) -> list[str]:
    """Rule 19: usage adds up, and agrees with the tokens the choices show."""
    usage = answer.usage
    if usage is None:
        wanted = not params.stream or params.include_usage
        return ["rule 17: no usage although include_usage is set" if params.stream else "no usage"] if wanted else []
    problems = []
    if usage.total_tokens != usage.prompt_tokens + usage.completion_tokens:
        problems.append(f"rule 19: usage total_tokens {usage.total_tokens} != prompt {usage.prompt_tokens} "
                        f"+ completion {usage.completion_tokens}")
    if usage.prompt_tokens < params.num_choices:
        problems.append(f"rule 19: usage prompt_tokens {usage.prompt_tokens} for {params.num_choices} prompt(s)")
    if not params.num_choices <= usage.completion_tokens <= params.num_choices * params.max_tokens:
        problems.append(f"rule 19: usage completion_tokens {usage.completion_tokens} outside "
                        f"{params.num_choices}..{params.num_choices * params.max_tokens} (max_tokens per choice)")
    counts = [answer.num_tokens(c) for c in answer.choices]
    if len(answer.choices) > 1 and None not in counts and sum(counts) != usage.completion_tokens:
        problems.append(f"rule 19: usage completion_tokens {usage.completion_tokens} != {sum(counts)} tokens "
                        f"in the choices")
    return problems
