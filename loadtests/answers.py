"""What a load-test request asked for and what it got back, reduced to what docs/CONTRACT.md talks about.

`Params` is read from the JSON body the client sent; `Answer` from the response body or the SSE
lines of a stream. Parsing is tolerant where the contract checks will judge (a missing finish is a
check's finding) and raises `Malformed` only when there is nothing to judge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

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
            raise ValueError("a load-test request must bound max_tokens")
        stop = body.get("stop") or ()
        stream_options = body.get("stream_options") or {}
        return cls(
            chat=chat,
            stream=bool(body.get("stream")),
            include_usage=bool(stream_options.get("include_usage")),
            num_choices=1 if chat or isinstance(body["prompt"], str) else _num_prompts(body["prompt"]),
            max_tokens=max_tokens,
            min_tokens=body.get("min_tokens", 0),
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
class Answer:
    request_id: str
    choices: tuple[Choice, ...]
    usage: Usage | None  # None: a stream without include_usage

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
    """A non-streaming response body."""
    try:
        choices = tuple(
            _choice(c["index"], c["message"]["content"] if chat else c["text"], c, [c], chat)
            for c in body["choices"]
        )
        return Answer(body["id"], choices, _usage(body["usage"]))
    except (KeyError, TypeError) as exc:
        raise Malformed(f"response body lacks {exc}: {json.dumps(body)[:300]}") from exc


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


def answer_from_stream(lines: list[str], chat: bool) -> Answer:
    """A stream's SSE lines, folded into the answer it amounts to (rule 15)."""
    chunks = [c for c in sse_chunks(lines) if "error" not in c]
    if not chunks:
        raise Malformed("the stream has no chunks")
    by_index: dict[int, list[dict]] = {}
    usage = None
    try:
        for chunk in chunks:
            if chunk.get("usage"):
                usage = _usage(chunk["usage"])
            for c in chunk["choices"]:
                by_index.setdefault(c["index"], []).append(c)
        choices = tuple(_streamed_choice(index, parts, chat) for index, parts in sorted(by_index.items()))
    except (KeyError, TypeError) as exc:
        raise Malformed(f"a stream chunk lacks {exc}") from exc
    return Answer(chunks[0]["id"], choices, usage)


def _streamed_choice(index: int, parts: list[dict], chat: bool) -> Choice:
    text = "".join((p["delta"].get("content") or "") if chat else p["text"] for p in parts)
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
