"""Run a contract case through HTTP with the official openai client, streaming or not, and reduce
the answer to what the contract talks about — so both modes (and both deployments) compare equal."""

from __future__ import annotations

from dataclasses import dataclass

import openai

from tests.contract.cases import CASES, CHAT_MESSAGES, Case

OPENAI_FIELDS = {"max_tokens", "stop", "logprobs", "top_logprobs", "seed", "temperature", "top_p",
                 "max_completion_tokens"}


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    usage: tuple[int, int]  # (prompt_tokens, completion_tokens)
    token_ids: tuple[int, ...] | None
    logprobs: tuple[float, ...] | None
    request_id: str


def request_kwargs(case: Case, index: int, model: str) -> dict:
    params = {"temperature": 0.0, **case.params}
    if "max_tokens" not in params and "max_completion_tokens" not in params:
        params["max_tokens"] = 16
    kwargs = {k: v for k, v in params.items() if k in OPENAI_FIELDS}
    extra = {k: v for k, v in params.items() if k not in OPENAI_FIELDS}
    kwargs["model"] = model
    kwargs["extra_body"] = extra
    if case.chat:
        kwargs["messages"] = CHAT_MESSAGES(index)
    else:
        kwargs["prompt"] = list(case.prompt(index))
    return kwargs


def ask(client: openai.OpenAI, index: int, stream: bool, model: str = "qwen3-tiny") -> tuple[Answer, list]:
    """The case's answer, and (streaming) the raw chunks for framing checks."""
    case = CASES[index]
    kwargs = request_kwargs(case, index, model)
    create = client.chat.completions.create if case.chat else client.completions.create
    if not stream:
        response = create(**kwargs)
        return _from_response(case, response), []
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kwargs))
    return _from_chunks(case, chunks), chunks


def _from_response(case: Case, response) -> Answer:
    (choice,) = response.choices
    extra = choice.model_extra or {}
    text = choice.message.content if case.chat else choice.text
    return Answer(
        text=text,
        finish_reason=choice.finish_reason,
        stop_reason=extra.get("stop_reason"),
        usage=(response.usage.prompt_tokens, response.usage.completion_tokens),
        token_ids=tuple(extra["token_ids"]) if "token_ids" in extra else None,
        logprobs=_logprobs(case, choice.logprobs),
        request_id=response.id,
    )


def _logprobs(case: Case, logprobs) -> tuple[float, ...] | None:
    if logprobs is None:
        return None
    if case.chat:
        return tuple(entry.logprob for entry in logprobs.content)
    return tuple(logprobs.token_logprobs)


def _from_chunks(case: Case, chunks: list) -> Answer:
    text, token_ids, logprobs = "", [], []
    finish_reason = stop_reason = None
    has_token_ids = has_logprobs = False
    for chunk in chunks:
        for choice in chunk.choices:
            extra = choice.model_extra or {}
            text += (choice.delta.content or "") if case.chat else choice.text
            if "token_ids" in extra:
                has_token_ids = True
                token_ids += extra["token_ids"]
            if choice.logprobs is not None:
                has_logprobs = True
                logprobs += _logprobs(case, choice.logprobs)
            if choice.finish_reason is not None:
                finish_reason, stop_reason = choice.finish_reason, extra.get("stop_reason")
    usage = chunks[-1].usage
    return Answer(
        text=text,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        usage=(usage.prompt_tokens, usage.completion_tokens),
        token_ids=tuple(token_ids) if has_token_ids else None,
        logprobs=tuple(logprobs) if has_logprobs else None,
        request_id=chunks[0].id,
    )


def check_framing(case: Case, chunks: list) -> None:
    """Rule 17: exactly one finishing chunk, earlier ones null, then one usage chunk.
    Rule 14: no chunk splits a character."""
    choice_chunks = [c for c in chunks if c.choices]
    finishing = [c for c in choice_chunks if c.choices[0].finish_reason is not None]
    assert len(finishing) == 1 and finishing[0] is choice_chunks[-1], "exactly one finishing chunk, last"
    for chunk in choice_chunks[:-1]:
        choice = chunk.choices[0]
        assert choice.finish_reason is None and (choice.model_extra or {}).get("stop_reason") is None
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, "the usage chunk follows"
    for chunk in choice_chunks:
        piece = (chunk.choices[0].delta.content or "") if case.chat else chunk.choices[0].text
        assert "\ufffd" not in piece
    if case.chat:
        assert choice_chunks[0].choices[0].delta.role == "assistant", "role delta first"
