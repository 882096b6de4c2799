"""Tool calling on the chat endpoint: `tools` go to the chat template, and a choice's text comes back
as `tool_calls`, as vLLM's `hermes` parser reads the models that write them (Qwen's among them).

- `tool_choice: "auto"` (the default with tools): the model calls a tool by writing
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; each such block is a call, the text
  before the first one the message's content (null if empty), and the finish `tool_calls`. A block
  that is not a call's JSON leaves the whole text as content, as vLLM does.
- `"required"`: the output is a JSON array of calls `[{"name", "parameters"}]`, held to the tools'
  schemas by a grammar (pegaserve/sample/grammar.py), vLLM's form; `parallel_tool_calls: false`
  allows one.
- a named function: the output is that function's arguments, held to its schema; the finish `stop`.
- `"none"` (the default without tools): the tools are not shown to the model, nothing is parsed.
- OpenAI's legacy `functions` and `function_call` are tools and a tool choice of one call at most,
  which comes back as `message.function_call` with the finish `function_call` (`chat_tools`).

Streaming, a call goes out in one `tool_calls` delta when its block (auto) or the output (required)
is whole, and a named function's arguments as they come; text that may open a block is held back
until it does or cannot, and a block that is not a call goes out as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace

from pegaserve.api.errors import invalid
from pegaserve.sample.grammar import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def body(self, index: int) -> dict:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(name, arguments, f"chatcmpl-tool-{uuid.uuid4().hex}")


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's choices turn into tool calls: `mode` "auto", "required" or "named"."""

    mode: str
    name: str | None = None  # the named function
    parallel: bool = True
    legacy: bool = False  # asked for as `functions`: the call comes back as `function_call`


def plan_tools(tools: list | None, tool_choice, parallel: bool) -> tuple[list | None, ToolPlan | None, GrammarSpec | None]:
    """The tools for the chat template, how to read the output, and the grammar that holds it."""
    functions = [_function(i, tool) for i, tool in enumerate(tools or [])]
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none" or (tool_choice == "auto" and not functions):
        return None, None, None
    if not functions:
        raise invalid("tool_choice", f"{json.dumps(tool_choice)[:60]} needs tools")
    if tool_choice == "auto":
        return tools, ToolPlan("auto", parallel=parallel), None
    if tool_choice == "required":
        items = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                            "parameters": _parameters(f)},
                            "required": ["name", "parameters"]} for f in functions]}
        schema = {"type": "array", "minItems": 1, "items": items, **({} if parallel else {"maxItems": 1})}
        return tools, ToolPlan("required", parallel=parallel), GrammarSpec("json_schema", json.dumps(schema))
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise invalid("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                                     "{\"name\": ...}}")
    chosen = next((f for f in functions if f["name"] == name), None)
    if chosen is None:
        raise invalid("tool_choice", f"names {name!r}, which is not one of the tools")
    return tools, ToolPlan("named", name=name), GrammarSpec("json_schema", json.dumps(_parameters(chosen)))


def chat_tools(body) -> tuple[list | None, ToolPlan | None, GrammarSpec | None]:
    """`plan_tools` for a chat request: its `tools`, `tool_choice` and `parallel_tool_calls`, or
    OpenAI's legacy `functions` and `function_call` (one call at most, answered as `function_call`)."""
    functions, function_call = body.functions, body.function_call
    if functions is None:
        if function_call is not None:
            raise invalid("function_call", "needs functions")
        return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    if body.tools:
        raise invalid("functions", "give tools or functions (OpenAI's legacy form), not both")
    if body.tool_choice is not None:
        raise invalid("tool_choice", "not with functions: their choice is function_call")
    for i, function in enumerate(functions):
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid("functions", f"function {i} must be an object with a name")
    if function_call is None or function_call in ("none", "auto"):
        choice = function_call
    elif isinstance(function_call, dict) and isinstance(function_call.get("name"), str):
        choice = {"type": "function", "function": {"name": function_call["name"]}}
    else:
        raise invalid("function_call", "must be 'none', 'auto' or {\"name\": ...}")
    tools, plan, grammar = plan_tools([{"type": "function", "function": f} for f in functions], choice, False)
    return tools, None if plan is None else replace(plan, legacy=True), grammar


def _function(index: int, tool) -> dict:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str) or not function["name"]:
        raise invalid("tools", f"tool {index} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    if "parameters" in function and not isinstance(function["parameters"], dict | None):
        raise invalid("tools", f"tool {index}'s parameters must be a JSON schema object")
    return function


def _parameters(function: dict) -> dict:
    """A function's arguments' schema (any object where it gives none)."""
    return function.get("parameters") or {"type": "object"}


def parse(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole choice's text: its content and its calls."""
    if plan.mode == "named":
        return None, [new_call(plan.name, text)]
    if plan.mode == "required":
        try:
            calls = [new_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):  # cut short (max_tokens, a stop string)
            return text, []
        return None, calls
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in text[start:].split(OPEN)[1:]:
        call = _call(block.split(CLOSE)[0])
        if call is None:
            return text, []
        calls.append(call)
    return text[:start] or None, calls[: None if plan.parallel else 1]


def _call(block: str) -> ToolCall | None:
    try:
        value = json.loads(block)
        name, arguments = value["name"], value.get("arguments", {})
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if not isinstance(name, str):
        return None
    return new_call(name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


class ToolStream:
    """One streamed choice's text in, its content and calls out (`feed` per delta, `end` once)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""  # text not yet given out: all of it (required), or what may open or is in a block
        self.num_calls = 0
        self.named: ToolCall | None = None

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.plan.mode == "named":
            if not text:
                return "", []
            if self.named is None:
                self.named = new_call(self.plan.name, text)
                return "", [self.named.body(0)]
            return "", [{"index": 0, "function": {"arguments": text}}]
        self.held += text
        if self.plan.mode == "required":
            return "", []
        content, calls = "", []
        while True:
            start = self.held.find(OPEN)
            if start < 0:
                keep = _open_prefix(self.held)
                if self.num_calls == 0:  # content only before the first call, as when not streaming
                    content += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                return content, calls
            if self.num_calls == 0:
                content += self.held[:start]
            end = self.held.find(CLOSE, start)
            if end < 0:
                self.held = self.held[start:]
                return content, calls
            call, raw = _call(self.held[start + len(OPEN) : end]), self.held[start : end + len(CLOSE)]
            self.held = self.held[end + len(CLOSE) :]
            if call is not None:
                calls += self._numbered(call)
            elif self.num_calls == 0:  # not a call: it goes out as it came
                content += raw

    def end(self) -> tuple[str, list[dict]]:
        """What is left when the choice finishes."""
        held, self.held = self.held, ""
        if self.plan.mode == "named":
            return "", []
        if self.plan.mode == "required":
            content, calls = parse(self.plan, held)
            return content or "", [c for call in calls for c in self._numbered(call)]
        if held.startswith(OPEN):
            call = _call(held[len(OPEN) :])
            if call is not None:
                return "", self._numbered(call)
        return (held if self.num_calls == 0 else ""), []

    def _numbered(self, call: ToolCall) -> list[dict]:
        if self.num_calls and not self.plan.parallel:
            return []
        self.num_calls += 1
        return [call.body(self.num_calls - 1)]


def _open_prefix(text: str) -> int:
    """The length of the longest end of `text` that could begin `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
