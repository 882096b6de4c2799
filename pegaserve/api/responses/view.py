"""The Responses API's output side: a chat completion (its body, or its chunks) as the response
object (or its typed events, each with its `sequence_number`), and what a stored response keeps
(pegaserve/api/responses/endpoint.py builds the chat job; this reads what it gives back)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pegaserve.api.errors import ApiError
from pegaserve.api.protocol import ResponsesRequest
from pegaserve.api.responses.store import ResponseStore


def input_items(body: ResponsesRequest) -> list[dict]:
    """`input` as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": body.input}]}]
    return body.input



def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _logprobs(choice: dict) -> list[dict]:
    """A chat choice's (or delta's) token logprobs: the Responses API's have the same shape."""
    return (choice.get("logprobs") or {}).get("content") or []


def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


@dataclass
class _Items:
    """A response's output as it grows: the message (one `output_text`) and the function calls."""

    message: dict | None = None
    calls: dict[int, dict] = field(default_factory=dict)  # by chat's tool-call index
    output: list[dict] = field(default_factory=list)

    def open_message(self) -> tuple[dict, bool]:
        is_new = self.message is None
        if is_new:
            self.message = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
            self.output.append(self.message)
        return self.message, is_new

    def open_call(self, index: int, call_id: str, name: str) -> tuple[dict, bool]:
        is_new = index not in self.calls
        if is_new:
            self.calls[index] = {"id": _id("fc"), "type": "function_call", "status": "in_progress",
                                 "call_id": call_id, "name": name, "arguments": ""}
            self.output.append(self.calls[index])
        return self.calls[index], is_new


class ResponseView:
    """A chat completion (its body, or its chunks) as the Responses API's response (or events)."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str, store: ResponseStore | None = None,
                 history: list[dict] = (), owner: str | None = None) -> None:
        self.body = body
        self.id = response_id
        self.model = model
        self.store = store  # None: not stored here (not stored, or by the background runner)
        self.history = list(history)
        self.owner = owner  # whose key asked (api/guards.py `owner_of`): only it reads the stored response
        self.given = [{"id": _id("msg"), "type": "message", **item} for item in input_items(body)]
        self.created_at = int(time.time())
        self._sequence = 0

    async def response(self, chat: dict) -> dict:
        """A whole chat completion as a whole response (stored, if it is to be, first)."""
        return await self._kept(self.finished(chat))

    def finished(self, chat: dict) -> dict:
        """A whole chat completion as a whole response."""
        choice = chat["choices"][0]
        message, items = choice["message"], _Items()
        if message.get("content") or not message.get("tool_calls"):
            part = items.open_message()[0]["content"][0]
            part["text"] = message.get("content") or ""
            part["logprobs"] = _logprobs(choice)
        for i, call in enumerate(message.get("tool_calls") or []):
            items.open_call(i, call["id"], call["function"]["name"])[0]["arguments"] = call["function"]["arguments"]
        return self._finished(items, choice["finish_reason"], chat["usage"])

    def with_status(self, status: str) -> dict:
        """The response with no output yet: `queued` or `in_progress` (in the background)."""
        return self._response(status, [])

    def failed(self, output: list[dict], message: str) -> dict:
        response = self._response("failed", output)
        response["error"] = {"code": "server_error", "message": message}
        return response

    def stored(self, response: dict) -> dict:
        """What the store keeps of `response`: it, its input items, and the conversation to continue."""
        return {"response": response, "input": self.given, "items": [*self.history, *self.given, *response["output"]],
                "owner": self.owner}

    async def _kept(self, response: dict) -> dict:
        """`response`, once stored: before the client can name it as a previous response."""
        if self.store is not None:
            await self.store.put(self.id, self.stored(response))
        return response

    def queued_events(self) -> list[dict]:
        """A streamed background response's first events, before its generation starts."""
        queued = self.with_status("queued")
        return [self._event("response.created", response=queued), self._event("response.queued", response=queued)]

    async def events(self, chunks: AsyncIterator[dict], background: bool = False) -> AsyncIterator[dict]:
        """A chat completion's chunks as the response's events. The first chunk is awaited before
        any event: a refusal at admission keeps its HTTP status (`background`: they follow
        `queued_events`)."""
        first = await anext(chunks, None)
        items, finish, usage = _Items(), None, None
        if not background:
            yield self._event("response.created", response=self._response("in_progress", []))
        yield self._event("response.in_progress", response=self._response("in_progress", []))
        async for chunk in _chain(first, chunks):
            if "error" in chunk:
                *told, failed = self.failure_events(items.output, chunk["error"])
                for event in told:
                    yield event
                await self._kept(failed["response"])
                yield failed
                return
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                logprobs = _logprobs(choice)
                if delta.get("content") or logprobs:
                    for event in self._text(items, delta.get("content") or "", logprobs):
                        yield event
                for call in delta.get("tool_calls") or []:
                    for event in self._call(items, call):
                        yield event
                finish = choice.get("finish_reason") or finish
        status, _ = self._status(finish)
        for event in self._close(items, status):
            yield event
        yield self._event(f"response.{status}", response=await self._kept(self._finished(items, finish, usage)))

    def failure_events(self, output: list[dict], error: dict) -> list[dict]:
        """The `error` event, then `response.failed` (the response failed with `output` so far)."""
        return [self._event("error", code=str(error.get("code")), message=error.get("message"), param=error.get("param")),
                self._event("response.failed", response=self.failed(output, error.get("message")))]

    # --- events -------------------------------------------------------------------------------------

    def _text(self, items: _Items, text: str, logprobs: list[dict]):
        message, is_new = items.open_message()
        index = items.output.index(message)
        if is_new:
            opened = {**message, "content": []}
            yield self._event("response.output_item.added", output_index=index, item=opened)
            yield self._event("response.content_part.added", item_id=message["id"], output_index=index,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        message["content"][0]["text"] += text
        message["content"][0]["logprobs"] += logprobs
        yield self._event("response.output_text.delta", item_id=message["id"], output_index=index, content_index=0,
                          delta=text, logprobs=logprobs)

    def _call(self, items: _Items, delta: dict):
        function = delta.get("function") or {}
        call, is_new = items.open_call(delta["index"], delta.get("id", ""), function.get("name", ""))
        index = items.output.index(call)
        if is_new:
            yield self._event("response.output_item.added", output_index=index, item=dict(call))
        if function.get("arguments"):
            call["arguments"] += function["arguments"]
            yield self._event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                              delta=function["arguments"])

    def _close(self, items: _Items, status: str):
        for index, item in enumerate(items.output):
            item["status"] = "incomplete" if status == "incomplete" else "completed"
            if item["type"] == "message":
                part = item["content"][0]
                yield self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=part["logprobs"])
                yield self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)
            else:
                yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"])
            yield self._event("response.output_item.done", output_index=index, item=item)

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    # --- the response object --------------------------------------------------------------------------

    @staticmethod
    def _status(finish: str | None) -> tuple[str, dict | None]:
        if finish == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        return "completed", None

    def _finished(self, items: _Items, finish: str | None, usage: dict | None) -> dict:
        status, incomplete = self._status(finish)
        for item in items.output:
            item["status"] = "incomplete" if incomplete else "completed"
        response = self._response(status, items.output)
        response["incomplete_details"] = incomplete
        response["usage"] = None if usage is None else _usage(usage)
        return response

    def _response(self, status: str, output: list[dict]) -> dict:
        body = self.body
        text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text is not None else {}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": body.background, "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls, "model": self.model,
            "output": list(output), "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "service_tier": body.service_tier or "default", "store": body.store, "temperature": body.temperature,
            "text": {"format": {"type": "text"}, **text}, "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": body.tools or [], "top_logprobs": body.top_logprobs, "top_p": body.top_p,
            "truncation": body.truncation,
            "usage": None, "user": body.user, "metadata": body.metadata or {},
        }


async def _chain(first: dict | None, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """`first`, then `rest`; a failure of `rest` as an error chunk, as a stream reports one in-band."""
    if first is not None:
        yield first
    try:
        async for chunk in rest:
            yield chunk
    except ApiError as exc:
        yield exc.body()
