"""What a request asked for and what it got back, reduced to what docs/contract.md talks about.

`Params` is read from the JSON body the client sent. `Answer` is read from a non-streaming
response body (`answer_from_body`), from a stream's SSE lines (`answer_from_sse`), or from the
chunks of a client that consumed the SSE itself (`answer_from_chunks`, e.g. the `model_dump()`s of
the openai client's chunks; a response's `model_dump()` is a body). Parsing is tolerant where the
checks will judge (a missing finish is a check's finding) and raises `Malformed` only when there is
nothing to judge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

DONE = "data: [DONE]"


class Malformed(Exception):
    """The response cannot be read as an OpenAI completion at all."""


@dataclass(frozen=True)
class Params:
    """The request parameters the contract checks depend on."""

    chat: bool
    stream: bool
    include_usage: bool
    num_choices: int
    max_tokens: int
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    num_top_logprobs: int | None = None  # None: logprobs were not requested
    return_token_ids: bool = False

    @classmethod
    def from_body(cls, body: dict, chat: bool) -> Params:
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
        if max_tokens is None:
            raise ValueError("a checked request must bound max_tokens")
        stop = body.get("stop") or ()
        stream_options = body.get("stream_options") or {}
        return cls(
            chat=chat,
            stream=bool(body.get("stream")),
            include_usage=bool(stream_options.get("include_usage")),
            num_choices=1 if chat or isinstance(body["prompt"], str) else _num_prompts(body["prompt"]),
            max_tokens=max_tokens,
            min_tokens=body.get("min_tokens") or 0,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            ignore_eos=bool(body.get("ignore_eos")),
            include_stop_str_in_output=bool(body.get("include_stop_str_in_output")),
            num_top_logprobs=_num_top_logprobs(body, chat),
            return_token_ids=bool(body.get("return_token_ids")),
        )


def _num_prompts(prompt: list) -> int:
    return 1 if not prompt or isinstance(prompt[0], int) else len(prompt)


def _num_top_logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        return (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    return body.get("logprobs")


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: tuple[int, ...] | None = None  # None unless return_token_ids
    logprobs: tuple[float, ...] | None = None  # the sampled tokens' logprobs; None unless requested
    top_logprobs_sizes: tuple[int, ...] | None = None  # per token, how many alternatives came back


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class Delta:
    """One choice's part of one stream chunk, as sent."""

    index: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    role: str | None = None  # chat: the delta's role


@dataclass(frozen=True)
class Chunk:
    """One stream chunk (error events aside): the facts rule 17 orders."""

    id: str | None
    deltas: tuple[Delta, ...]
    has_usage: bool


@dataclass(frozen=True)
class SseLines:
    """What only a stream's raw lines show (a client such as openai's consumes them)."""

    num_done: int  # `data: [DONE]` lines
    ends_with_done: bool
    num_not_data: int  # lines that are not `data: ` events


@dataclass(frozen=True)
class Framing:
    """How a stream delivered its answer (rules 14 and 17)."""

    chunks: tuple[Chunk, ...]
    errors: tuple[str, ...] = ()  # the messages of error events
    sse: SseLines | None = None  # None: read through a client that consumed the SSE lines


@dataclass(frozen=True)
class Answer:
    request_id: str
    choices: tuple[Choice, ...]
    usage: Usage | None  # None: a stream without include_usage
    # How it was delivered is not what was answered: equality (rule 15) ignores it.
    framing: Framing | None = field(default=None, compare=False)  # None: not a stream

    def num_tokens(self, choice: Choice) -> int | None:
        """The choice's completion_tokens, where the answer shows it."""
        if choice.token_ids is not None:
            return len(choice.token_ids)
        if choice.logprobs is not None:
            return len(choice.logprobs)
        if len(self.choices) == 1 and self.usage is not None:
            return self.usage.completion_tokens
        return None


def answer_from_body(body: dict, chat: bool) -> Answer:
    """A non-streaming response body (or the openai client's response, `model_dump()`ed)."""
    try:
        choices = tuple(
            _choice(c["index"], _text(c["message"]["content"] if chat else c["text"]), c, [c], chat)
            for c in body["choices"]
        )
        return Answer(body["id"], choices, _usage(body["usage"]))
    except (KeyError, TypeError) as exc:
        raise Malformed(f"response body lacks {exc}: {json.dumps(body, default=str)[:300]}") from exc


def sse_chunks(lines: list[str]) -> list[dict]:
    """The JSON chunks of a stream's `data:` lines, without the `[DONE]` line and anything else."""
    chunks = []
    for line in lines:
        if line.startswith("data: ") and line != DONE:
            try:
                chunks.append(json.loads(line[len("data: "):]))
            except json.JSONDecodeError as exc:
                raise Malformed(f"a stream chunk is not JSON: {line[:200]!r}") from exc
    return chunks


def shows_output(line: str) -> bool:
    """Whether an SSE line carries generated text or tokens (the first one marks TTFT)."""
    if not line.startswith("data: {"):
        return False
    try:
        chunk = json.loads(line[len("data: "):])
    except json.JSONDecodeError:
        return False
    return any(c.get("text") or (c.get("delta") or {}).get("content") or c.get("token_ids")
               for c in chunk.get("choices") or ())


def answer_from_sse(lines: list[str], chat: bool) -> Answer:
    """A stream's non-empty SSE lines, folded into the answer it amounts to (rule 15)."""
    sse = SseLines(num_done=lines.count(DONE), ends_with_done=bool(lines) and lines[-1] == DONE,
                   num_not_data=sum(not line.startswith("data: ") for line in lines))
    return _fold(sse_chunks(lines), chat, sse)


def answer_from_chunks(chunks: list[dict], chat: bool) -> Answer:
    """A stream's chunks as dicts (the openai client's chunks, `model_dump()`ed), folded likewise."""
    return _fold(chunks, chat, None)


def _fold(chunks: list[dict], chat: bool, sse: SseLines | None) -> Answer:
    errors = tuple(_error_message(c["error"]) for c in chunks if "error" in c)
    chunks = [c for c in chunks if "error" not in c]
    if not chunks:
        raise Malformed("the stream has no chunks" + (f"; error events: {list(errors)}" if errors else ""))
    by_index: dict[int, list[dict]] = {}
    usage = None
    try:
        for chunk in chunks:
            if chunk.get("usage"):
                usage = _usage(chunk["usage"])
            for c in chunk["choices"]:
                by_index.setdefault(c["index"], []).append(c)
        choices = tuple(_streamed_choice(index, parts, chat) for index, parts in sorted(by_index.items()))
        framing = Framing(tuple(_chunk(c, chat) for c in chunks), errors, sse)
    except (KeyError, TypeError) as exc:
        raise Malformed(f"a stream chunk lacks {exc}") from exc
    return Answer(chunks[0]["id"], choices, usage, framing)


def _error_message(error: object) -> str:
    return str(error.get("message") if isinstance(error, dict) else error)


def _chunk(chunk: dict, chat: bool) -> Chunk:
    deltas = tuple(
        Delta(c["index"], _piece(c, chat), c.get("finish_reason"), c.get("stop_reason"),
              (c.get("delta") or {}).get("role") if chat else None)
        for c in chunk["choices"]
    )
    return Chunk(chunk.get("id"), deltas, bool(chunk.get("usage")))


def _piece(choice: dict, chat: bool) -> str:
    """The text one chunk adds to one choice."""
    return _text((choice["delta"].get("content") or "") if chat else choice["text"])


def _text(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text {text!r} is not a string")
    return text


def _streamed_choice(index: int, parts: list[dict], chat: bool) -> Choice:
    text = "".join(_piece(p, chat) for p in parts)
    finishing = [p for p in parts if p.get("finish_reason") is not None] or parts[-1:]
    return _choice(index, text, finishing[0], parts, chat)


def _choice(index: int, text: str, finishing: dict, parts: list[dict], chat: bool) -> Choice:
    """`finishing` carries the finish fields; `parts` (one body choice, or a stream's chunks of this
    choice in order) carry the token ids and logprobs."""
    has_ids = any("token_ids" in p for p in parts)
    logprobs = [p["logprobs"] for p in parts if p.get("logprobs") is not None]
    sampled, sizes = _logprobs(logprobs, chat) if logprobs else (None, None)
    return Choice(
        index=index,
        text=text,
        finish_reason=finishing.get("finish_reason"),
        # every finishing choice carries stop_reason, even when it is null: KeyError means Malformed
        stop_reason=finishing["stop_reason"] if finishing.get("finish_reason") is not None else None,
        token_ids=tuple(i for p in parts for i in p.get("token_ids") or ()) if has_ids else None,
        logprobs=sampled,
        top_logprobs_sizes=sizes,
    )


def _logprobs(parts: list[dict], chat: bool) -> tuple[tuple[float, ...], tuple[int, ...]]:
    if chat:
        entries = [e for p in parts for e in p["content"]]
        return tuple(e["logprob"] for e in entries), tuple(len(e.get("top_logprobs") or ()) for e in entries)
    sampled = tuple(lp for p in parts for lp in p["token_logprobs"])
    tops = [t for p in parts for t in (p.get("top_logprobs") or [None] * len(p["token_logprobs"]))]
    return sampled, tuple(len(t or {}) for t in tops)


def _usage(usage: dict) -> Usage:
    return Usage(usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])
