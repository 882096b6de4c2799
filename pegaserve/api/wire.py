"""The OpenAI wire format: completion and chat bodies, stream chunks, logprobs, usage."""

from __future__ import annotations

from dataclasses import dataclass, field

from pegaserve.api.choice import ChoiceDelta
from pegaserve.engine.request import SampledToken
from pegaserve.stop import StopCause, finish_reason, stop_reason


@dataclass
class ChoiceResult:
    """A whole choice, the sum of its deltas (so streaming and not share one code path)."""

    index: int
    prompt_token_ids: tuple[int, ...]
    text: str = ""
    tokens: list[SampledToken] = field(default_factory=list)
    finish: StopCause | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.tokens += delta.tokens
        self.finish = delta.finish or self.finish


def usage(choices: list[ChoiceResult]) -> dict:
    prompt = sum(len(c.prompt_token_ids) for c in choices)
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Wire:
    """Formats choices for one endpoint. `decode_token` renders a single id for logprobs."""

    def __init__(self, chat: bool, request_id: str, model: str, created: int, decode_token, num_top_logprobs: int,
                 logprobs: bool, return_token_ids: bool) -> None:
        self.chat = chat
        self.request_id = request_id
        self.model = model
        self.created = created
        self.decode_token = decode_token
        self.num_top_logprobs = num_top_logprobs
        self.logprobs = logprobs
        self.return_token_ids = return_token_ids
        self._text_offsets: dict[int, int] = {}

    def _envelope(self, chunk: bool) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, index: int, text: str, tokens: list[SampledToken] | tuple, finish: StopCause | None,
                chunk: bool) -> dict:
        body: dict = {"index": index}
        if self.chat:
            body["delta" if chunk else "message"] = {"content": text} if chunk else {"role": "assistant", "content": text}
        else:
            body["text"] = text
        body["logprobs"] = self._logprobs(index, tokens) if self.logprobs else None
        body["finish_reason"] = finish_reason(finish) if finish else None
        body["stop_reason"] = stop_reason(finish) if finish else None
        if self.return_token_ids:
            body["token_ids"] = [t.token_id for t in tokens]
        return body

    def _logprobs(self, index: int, tokens) -> dict:
        if self.chat:
            return {"content": [self._chat_logprob(t) for t in tokens]}
        strings = [self.decode_token(t.token_id) for t in tokens]
        offsets = []
        offset = self._text_offsets.get(index, 0)
        for s in strings:
            offsets.append(offset)
            offset += len(s)
        self._text_offsets[index] = offset
        return {
            "tokens": strings,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [
                {self.decode_token(i): lp for i, lp in t.top_logprobs} for t in tokens
            ] if self.num_top_logprobs else None,
            "text_offset": offsets,
        }

    def _chat_logprob(self, token: SampledToken) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.decode_token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            **entry(token.token_id, token.logprob),
            "top_logprobs": [entry(i, lp) for i, lp in token.top_logprobs[: self.num_top_logprobs]],
        }

    def response(self, choices: list[ChoiceResult]) -> dict:
        body = self._envelope(chunk=False)
        body["choices"] = [self._choice(c.index, c.text, c.tokens, c.finish, chunk=False) for c in choices]
        body["usage"] = usage(choices)
        if self.return_token_ids:
            self._add_prompt_ids(body, choices)
        return body

    def _add_prompt_ids(self, body: dict, choices: list[ChoiceResult]) -> None:
        body["prompt_token_ids"] = list(choices[0].prompt_token_ids) if len(choices) == 1 else None
        if not self.chat:
            for out, c in zip(body["choices"], choices):
                out["prompt_token_ids"] = list(c.prompt_token_ids)

    def role_chunk(self, index: int) -> dict:
        body = self._envelope(chunk=True)
        body["choices"] = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None, "stop_reason": None}]
        return body

    def chunk(self, index: int, delta: ChoiceDelta, prompt_token_ids: tuple[int, ...] | None = None) -> dict:
        body = self._envelope(chunk=True)
        body["choices"] = [self._choice(index, delta.text, delta.tokens, delta.finish, chunk=True)]
        if prompt_token_ids is not None:
            body["prompt_token_ids"] = list(prompt_token_ids)
        return body

    def usage_chunk(self, choices: list[ChoiceResult]) -> dict:
        body = self._envelope(chunk=True)
        body["choices"] = []
        body["usage"] = usage(choices)
        return body
