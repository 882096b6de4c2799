"""The OpenAI wire format: completion and chat bodies, stream chunks, logprobs, usage."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pegaserve.api.choice import ChoiceDelta
from pegaserve.api.tools import ToolPlan, ToolStream, parse
from pegaserve.messages import SampledToken, TokenScore, add_counts
from pegaserve.stop import Length, StopCause, finish_reason, stop_reason

NO_LOGPROB = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass
class ChoiceResult:
    """A whole choice, the sum of its deltas (so streaming and not share one code path)."""

    index: int
    prompt_token_ids: tuple[int, ...]
    echo_text: str = ""
    text: str = ""
    tokens: list[SampledToken] = field(default_factory=list)
    finish: StopCause | None = None
    prompt_logprobs: tuple[TokenScore | None, ...] | None = None
    num_cached_tokens: int | None = None  # of the prompt's, found in the prefix cache (where the engine said)
    prediction_tokens: tuple[int, int] = (0, 0)  # predicted-output drafts accepted, rejected
    num_deltas: int = 0

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.tokens += delta.tokens
        self.finish = delta.finish or self.finish
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens
        self.prediction_tokens = add_counts(self.prediction_tokens, delta.prediction_tokens)
        self.num_deltas += 1


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # prompt tokens the prefix cache held, where the engine said
    prediction_tokens: tuple[int, int] | None = None  # a predicted output's drafts accepted, rejected

    def body(self) -> dict:
        body = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.cached_tokens is not None:
            body["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}  # as OpenAI's
        if self.prediction_tokens is not None:
            accepted, rejected = self.prediction_tokens
            body["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                 "rejected_prediction_tokens": rejected}
        return body


def logprob(value: float) -> float:
    return value if math.isfinite(value) else NO_LOGPROB


class Wire:
    """Formats one request's choices for its endpoint.

    `num_top_logprobs` is None without logprobs; `num_prompt_logprobs` None without the
    `prompt_logprobs` field; `decode_token` renders one id (logprobs, echo, prompt logprobs).
    """

    def __init__(self, *, endpoint: Endpoint, response_id: str, model: str, created: int,
                 decode_token: Callable[[int], str], num_top_logprobs: int | None = None,
                 num_prompt_logprobs: int | None = None, return_token_ids: bool = False,
                 tokens_as_ids: bool = False, echo: bool = False, role: str = "assistant",
                 tools: ToolPlan | None = None) -> None:
        self.endpoint = endpoint
        self.response_id = response_id
        self.model = model
        self.created = created
        self._decode_token = decode_token
        self.num_top_logprobs = num_top_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.return_token_ids = return_token_ids
        self.tokens_as_ids = tokens_as_ids
        self.echo = echo  # completions: the prompt's tokens lead the first logprobs
        self.role = role
        self.tools = tools  # chat: how the choices' text turns into tool calls (pegaserve/api/tools.py)
        self._tool_streams: dict[int, ToolStream] = {}
        self._text_offsets: dict[int, int] = {}

    @property
    def chat(self) -> bool:
        return self.endpoint is Endpoint.CHAT

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else self._decode_token(token_id)

    # --- bodies ----------------------------------------------------------------------------------

    def response(self, choices: list[ChoiceResult], usage: Usage) -> dict:
        body = self._envelope(chunk=False)
        body["choices"] = [self._choice(c, c.echo_text + c.text, c.tokens, c.finish, first=True, chunk=False)
                           for c in choices]
        body["usage"] = usage.body()
        if self.return_token_ids:  # the request's prompt; null when its choices answer several
            one_prompt = len({c.prompt_token_ids for c in choices}) == 1
            body["prompt_token_ids"] = list(choices[0].prompt_token_ids) if one_prompt else None
        if self.chat and self.num_prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(choices[0])
        return body

    def role_chunk(self, index: int, usage: Usage | None = None) -> dict:
        body = self._envelope(chunk=True)
        body["choices"] = [{"index": index, "delta": {"role": self.role, "content": ""}, "logprobs": None,
                            "finish_reason": None, "stop_reason": None}]
        if usage is not None:
            body["usage"] = usage.body()
        return body

    def chunk(self, result: ChoiceResult, delta: ChoiceDelta, usage: Usage | None = None) -> dict:
        """`result` already holds `delta`: its first delta shows the echo and the prompt ids."""
        first = result.num_deltas == 1
        text = (result.echo_text if first else "") + delta.text
        body = self._envelope(chunk=True)
        body["choices"] = [self._choice(result, text, delta.tokens, delta.finish, first, chunk=True)]
        if self.tools is not None:
            self._stream_tool_calls(result, text, delta.finish, body["choices"][0])
        if first and self.return_token_ids:
            body["prompt_token_ids"] = list(result.prompt_token_ids)
        if usage is not None:
            body["usage"] = usage.body()
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._envelope(chunk=True)
        body["choices"] = []
        body["usage"] = usage.body()
        return body

    def _envelope(self, chunk: bool) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, result: ChoiceResult, text: str, tokens: Sequence[SampledToken], finish: StopCause | None,
                first: bool, chunk: bool) -> dict:
        body: dict = {"index": result.index}
        if self.chat and not chunk and self.tools is not None:
            content, calls = parse(self.tools, text)
            body["message"] = {"role": self.role, "content": content}
            if self.tools.legacy:
                if calls:
                    body["message"]["function_call"] = calls[0].body(0)["function"]
            else:
                body["message"]["tool_calls"] = [call.body(i) for i, call in enumerate(calls)]
                for call in body["message"]["tool_calls"]:
                    del call["index"]  # (a streamed delta's)
        elif self.chat:
            body["delta" if chunk else "message"] = {"content": text} if chunk else {"role": self.role, "content": text}
        else:
            body["text"] = text
        body["logprobs"] = None if self.num_top_logprobs is None else self._logprobs(result, tokens, first)
        body["finish_reason"] = finish_reason(finish) if finish else None
        body["stop_reason"] = stop_reason(finish) if finish else None
        if not chunk and self.chat and self._ends_in_calls(finish, bool(body["message"].get("tool_calls")
                                                                         or body["message"].get("function_call"))):
            body["finish_reason"] = self._calls_finish
        if self.return_token_ids:
            body["token_ids"] = [t.token_id for t in tokens]
            if not self.chat and first:
                body["prompt_token_ids"] = list(result.prompt_token_ids)
        if not self.chat and not chunk and self.num_prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(result)
        return body

    def _ends_in_calls(self, finish: StopCause | None, called: bool) -> bool:
        """Whether a finished choice ends as `tool_calls`: it called a tool of its own accord (auto,
        required) and was not cut short."""
        return called and finish is not None and not isinstance(finish, Length) and self.tools.mode != "named"

    @property
    def _calls_finish(self) -> str:
        return "function_call" if self.tools.legacy else "tool_calls"

    def _stream_tool_calls(self, result: ChoiceResult, text: str, finish: StopCause | None, choice: dict) -> None:
        stream = self._tool_streams.setdefault(result.index, ToolStream(self.tools))
        content, calls = stream.feed(text)
        if finish is not None:
            more_content, more_calls = stream.end()
            content, calls = content + more_content, calls + more_calls
            if self._ends_in_calls(finish, stream.num_calls > 0):
                choice["finish_reason"] = self._calls_finish
        choice["delta"] = {"content": content} if content or not calls else {}
        if calls and self.tools.legacy:  # one call at most: its name, then its arguments as they come
            choice["delta"]["function_call"] = dict(calls[0]["function"])
        elif calls:
            choice["delta"]["tool_calls"] = calls

    # --- logprobs --------------------------------------------------------------------------------

    def _logprobs(self, result: ChoiceResult, tokens: Sequence[SampledToken], first: bool) -> dict:
        if self.chat:
            return {"content": [self._chat_logprob(t) for t in tokens]}
        strings, logprobs, tops = [], [], []
        if first and self.echo and result.prompt_logprobs is not None:  # echo: the prompt's tokens first
            for token_id, score in zip(result.prompt_token_ids, result.prompt_logprobs):
                strings.append(self.token_text(token_id))
                logprobs.append(None if score is None else logprob(score.logprob))
                tops.append(None if score is None else self._top(score.top_logprobs, token_id, score.logprob))
        for t in tokens:
            strings.append(self.token_text(t.token_id))
            logprobs.append(logprob(t.logprob))
            tops.append(self._top(t.top_logprobs, t.token_id, t.logprob))
        offsets, offset = [], self._text_offsets.get(result.index, 0)
        for s in strings:
            offsets.append(offset)
            offset += len(s)
        self._text_offsets[result.index] = offset
        return {"tokens": strings, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _top(self, top: tuple[tuple[int, float], ...], chosen: int, chosen_logprob: float) -> dict[str, float]:
        """The N most likely tokens and the chosen one: N + 1 entries when it is not among them
        (OpenAI's legacy completions, vLLM's; `logprobs: 0` gives the chosen token alone)."""
        entries = {self.token_text(i): logprob(lp) for i, lp in top[: self.num_top_logprobs]}
        entries.setdefault(self.token_text(chosen), logprob(chosen_logprob))
        return entries

    def _chat_logprob(self, token: SampledToken) -> dict:
        def entry(token_id: int, value: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob(value), "bytes": list(text.encode())}

        return {
            **entry(token.token_id, token.logprob),
            "top_logprobs": [entry(i, lp) for i, lp in token.top_logprobs[: self.num_top_logprobs]],
        }

    def _prompt_logprobs(self, result: ChoiceResult) -> list[dict | None] | None:
        """vLLM's shape: null for the first token, then per token {id: {logprob, rank,
        decoded_token}} for the token itself and the top `prompt_logprobs` alternatives."""
        if result.prompt_logprobs is None:
            return None
        return [None if score is None else self._scored(score) for score in result.prompt_logprobs]

    def _scored(self, score: TokenScore) -> dict:
        entries = {str(score.token_id): {"logprob": logprob(score.logprob), "rank": score.rank,
                                         "decoded_token": self._decode_token(score.token_id)}}
        for rank, (token_id, value) in enumerate(score.top_logprobs[: self.num_prompt_logprobs], start=1):
            entries.setdefault(str(token_id), {"logprob": logprob(value), "rank": rank,
                                               "decoded_token": self._decode_token(token_id)})
        return entries
