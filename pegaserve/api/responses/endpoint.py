"""OpenAI's Responses API (`POST /v1/responses`), run as a chat completion: one path for the
prompt, the stop contract, tools, structured output, the ledger and P/D, whichever API asked.

- In: `instructions` become a system message; `input` (a string, or items: messages with text
  parts, `function_call`s, `function_call_output`s) the messages; function `tools` and
  `tool_choice` chat's; `text.format` the response format; `reasoning.effort` the template's
  reasoning effort; `max_output_tokens` the length limit. A 400 names the Responses parameter.
- Out: a `response` whose `output` is the assistant's message (one `output_text`) and its function
  calls; `incomplete` with reason `max_output_tokens` when the length limit cut it. Streamed, the
  typed events OpenAI sends, each with its `sequence_number`, from `response.created` to
  `response.completed` (or `.incomplete`, or `error` then `response.failed`): `ResponseView`
  (pegaserve/api/responses/view.py).
- `include: ["message.output_text.logprobs"]` (with `top_logprobs`): chat's logprobs, in the same
  shape, on the `output_text` and its deltas.
- `store` (on by default): the response is kept (pegaserve/api/responses/store.py) before its last
  event, for `previous_response_id` to continue (its input and output items come before the new
  input; its instructions do not carry over) and for `GET`/`DELETE /v1/responses/{id}`.
- `background` (with `store`): the response comes back `queued` at once and is generated in the
  background (pegaserve/api/responses/background.py); GET reads it, `POST .../cancel` stops it. With
  `stream` too, the POST streams its events, and `GET /v1/responses/{id}?stream=true` (from
  `starting_after`) replays and follows them, through any ingress replica.
  Server-side conversations and prompts are refused (REFUSED_RESPONSES).
- `truncation: "auto"`: the fewest items from the conversation's start are left out for it to fit.
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import ValidationError

from pegaserve.api import validation as v
from pegaserve.api.body import complaint
from pegaserve.api.errors import ApiError, invalid
from pegaserve.api.frontend import Job, new_response_id
from pegaserve.api.jobs import chat_job, chat_prompt_ids
from pegaserve.api.protocol import REFUSED_RESPONSES, ChatCompletionRequest, ResponsesRequest, SamplingKnobs
from pegaserve.api.responses.background import PREFIX, BackgroundResponses
from pegaserve.api.responses.store import ACTIVE
from pegaserve.api.responses.view import ResponseView, input_items
from pegaserve.api.stored_chats import check_metadata
from pegaserve.api.tools import chat_tools

# chat's names for what the Responses API calls otherwise, for the 400s
_RESPONSES_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "response_format": "text.format", "reasoning_effort": "reasoning.effort"}
_ROLES = ("user", "system", "developer", "assistant")
LOGPROBS = "message.output_text.logprobs"


async def continued(responses: BackgroundResponses, body: ResponsesRequest, owner: str | None) -> dict | None:
    """The stored response that `body` continues (`previous_response_id`), if it names one, as
    `responses` (background.BackgroundResponses) reads it."""
    if body.previous_response_id is None:
        return None
    stored = await responses.get(body.previous_response_id, owner)
    if stored is None:
        raise invalid("previous_response_id", f"no stored response {body.previous_response_id[:80]!r} (it was "
                                              "not stored, was deleted, or is past the store's most recent)")
    if stored["response"]["status"] in ACTIVE:
        raise invalid("previous_response_id", f"{body.previous_response_id[:80]!r} is still "
                                              f"{stored['response']['status']} (in the background)")
    return stored


def responses_job(frontend, body: ResponsesRequest, header_id: str | None,
                  previous: dict | None = None, owner: str | None = None) -> tuple[Job, ResponseView]:
    """The chat job that runs `body` (continuing `previous`, a stored response), under a `resp_`
    id (the ledger's key too), and its view."""
    v.check_refused(body, REFUSED_RESPONSES, "is not supported here")
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise invalid("stream_options.include_obfuscation", "is not supported (only false)")
    reasoning = body.reasoning
    for name in ("summary", "generate_summary"):
        if reasoning is not None and getattr(reasoning, name) is not None:
            raise invalid(f"reasoning.{name}", "is not supported: no reasoning is summarized here (only null)")
    if body.top_logprobs and LOGPROBS not in (body.include or ()):
        raise invalid("top_logprobs", f'needs include: ["{LOGPROBS}"]')
    if body.max_tool_calls is not None and body.max_tool_calls < 0:
        raise invalid("max_tool_calls", f"must be at least 0, got {body.max_tool_calls}")
    check_metadata(body.metadata)
    if body.background and not body.store:
        raise invalid("background", "needs store: true (a background response is read back from the store)")
    history = previous["items"] if previous is not None else []
    drop = _dropped(frontend, body, history) if body.truncation == "auto" else 0
    try:
        chat = ChatCompletionRequest.model_validate(chat_body(body, history, drop))
    except ValidationError as exc:
        raise _renamed(complaint(exc)) from None
    try:
        job = chat_job(frontend, chat, header_id)
    except ApiError as exc:
        raise _renamed(exc) from None
    response_id = new_response_id(PREFIX.rstrip("_")).replace("-", "_")
    job = replace(job, response_id=response_id, include_usage=True, continuous_usage=False)
    store = frontend.responses if body.store and not body.background else None  # (background: its runner stores it)
    return job, ResponseView(body, response_id, job.wire.model, store, history, owner)


def _dropped(frontend, body: ResponsesRequest, history: list[dict]) -> int:
    """`truncation: auto`: how many items, from the conversation's start, to leave out so that the
    prompt and `max_output_tokens` fit the context — the fewest (0: all fit). Never the last item,
    and never so as to open on a tool's output without its call. A body with other faults drops
    nothing: its 400 comes from the usual path."""
    model, limits = frontend.model, frontend.limits

    def fits(drop: int) -> bool | None:  # None: the body fails otherwise (a template may refuse what is left)
        try:
            chat = ChatCompletionRequest.model_validate(chat_body(body, history, drop))
            n = len(chat_prompt_ids(frontend, chat, chat_tools(chat)[0]))
        except (ApiError, ValidationError):
            return None
        return n + (body.max_output_tokens or 1) <= model.max_model_len and \
            (limits.max_prompt_tokens is None or n <= limits.max_prompt_tokens)

    if fits(0) is not False:
        return 0
    items = [*history, *input_items(body)]
    starts = [k for k in range(1, len(items)) if items[k].get("type") != "function_call_output"]
    lo, hi = 0, len(starts) - 1  # the fewest dropped that fit: fitting only grows with what is dropped
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(starts[mid]) else (mid + 1, hi)
    return starts[lo] if starts else 0


def chat_body(body: ResponsesRequest, history: list[dict] = (), drop: int = 0) -> dict:
    """The chat request that `body` is (after the conversation `history`, items, less the first
    `drop` of them): its messages, tools, format and limits in chat's words."""
    chat = body.model_dump(include=set(SamplingKnobs.model_fields), exclude_unset=True)
    chat.update(messages=_messages(body, history, drop), stream=body.stream, max_completion_tokens=body.max_output_tokens,
                parallel_tool_calls=body.parallel_tool_calls, chat_template_kwargs=body.chat_template_kwargs)
    if body.tools is not None:
        chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type != "text":
        schema = {"name": text_format.name or "response", "schema": text_format.json_schema,
                  "strict": text_format.strict, "description": text_format.description}
        chat["response_format"] = {"type": text_format.type} if text_format.type == "json_object" else \
            {"type": "json_schema", "json_schema": {k: x for k, x in schema.items() if x is not None}}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    if LOGPROBS in (body.include or ()):
        chat.update(logprobs=True, top_logprobs=body.top_logprobs)
    return {k: x for k, x in chat.items() if x is not None}


def _messages(body: ResponsesRequest, history: list[dict], drop: int) -> list[dict]:
    messages = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    items = list(enumerate([*history, *input_items(body)], start=-len(history)))  # history's: checked before
    for i, item in items[drop:]:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(i, item))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", i), "type": "function",
                    "function": {"name": _text(item, "name", i), "arguments": _text(item, "arguments", i)}}
            if not (messages and messages[-1]["role"] == "assistant"):  # parallel calls: one message
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", i),
                             "content": output if isinstance(output, str) else _parts(i, output, "output")})
        else:
            raise invalid(f"input[{i}].type", f"{str(kind)[:40]!r} is not supported: only message, function_call "
                                              "and function_call_output items")
    if not messages:
        raise invalid("input", "must hold at least one item")
    return messages


def _message(i: int, item: dict) -> dict:
    role = item.get("role")
    if role not in _ROLES:
        raise invalid(f"input[{i}].role", f"must be one of {', '.join(_ROLES)}")
    content = item.get("content")
    return {"role": role, "content": content if isinstance(content, str) else _parts(i, content, "content")}


def _parts(i: int, content, name: str) -> list[dict]:
    """Text parts (`input_text`, `output_text`) as chat's `text` parts; anything else is a 400."""
    if not isinstance(content, list):
        raise invalid(f"input[{i}].{name}", "must be a string or a list of text parts")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                or not isinstance(part.get("text"), str):
            raise invalid(f"input[{i}].{name}", "only input_text and output_text parts are supported")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _text(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"input[{i}].{key}", "must be a string")
    return value


def _chat_tool(i: int, tool: dict) -> dict:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise invalid(f"tools[{i}]", "only function tools are supported: {\"type\": \"function\", \"name\", ...}")
    return {"type": "function", "function": {k: x for k, x in tool.items() if k != "type"}}


def _chat_tool_choice(choice):
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")


def _renamed(error: ApiError) -> ApiError:
    """A chat-side 400 about a parameter the Responses API names otherwise, in its words."""
    param = error.param or ""
    head, _, rest = param.partition(".")
    name = _RESPONSES_NAMES.get(head)
    if name is None:
        return error
    renamed = name + ("" if name == "input" or not rest else f".{rest}")  # messages' indices are not input's
    message = error.message.replace(param, renamed, 1) if error.message.startswith(param) else error.message
    return ApiError(message, renamed, error.status, error.type)
