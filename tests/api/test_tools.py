"""Tool calling (pegaserve/api/tools.py): the tools reach the chat template, calls come back as
`tool_calls` (auto: the model's <tool_call> blocks; required and a named function: held to the tools'
schemas by a grammar), streamed and not alike; bad tools and tool choices are 400s naming them."""

from __future__ import annotations

import json

import httpx
import pytest

from pegaserve.api.app import build_app
from pegaserve.api.jobs import render_chat
from pegaserve.api.tools import ToolPlan, ToolStream, parse
from pegaserve.tokenizer import Tokenizer
from tests.api.helpers import scripted_frontend, sse_chunks
from tests.contract.server import ThreadedServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALLS = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
EOS = 151645


def tools_app(tiny_model_dir):
    """An app whose model writes CALLS (then EOS) after MESSAGES rendered with both tools."""
    tokenizer = Tokenizer(tiny_model_dir)
    prompt = tokenizer.backend.encode(render_chat(tokenizer, [_message(m) for m in MESSAGES], True, False, None,
                                                  [WEATHER, TIME]), add_special_tokens=False).ids
    script = {tuple(prompt): (*tokenizer.backend.encode(CALLS, add_special_tokens=False).ids, EOS)}
    return build_app(scripted_frontend(tiny_model_dir, script))


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ThreadedServer(tools_app(tiny_model_dir)) as running:
        yield running


def _message(m: dict):
    from pegaserve.api.protocol import ChatMessage  # noqa: PLC0415

    return ChatMessage(**m)


def chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "max_tokens": 80, "temperature": 0, "tools": [WEATHER, TIME], **body})


def streamed(server, **body) -> tuple[str, list[dict], str]:
    """A stream's content, its tool calls assembled as a client does, and its finish reason."""
    chunks = [c for c in sse_chunks(chat(server, stream=True, **body).text) if c["choices"]]
    content, calls = "", {}
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], {"id": call.get("id"), "name": "", "arguments": ""})
            entry["name"] += call.get("function", {}).get("name") or ""
            entry["arguments"] += call.get("function", {}).get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)], chunks[-1]["choices"][0]["finish_reason"]


def test_auto_tool_calls_come_back_as_tool_calls_streamed_and_not(server):
    choice = chat(server).json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] == "Let me look."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in message["tool_calls"])
    content, stream_calls, finish = streamed(server)
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in stream_calls] == calls
    one = chat(server, parallel_tool_calls=False).json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in one] == ["get_weather"]
    assert [c["name"] for c in streamed(server, parallel_tool_calls=False)[1]] == ["get_weather"]


def test_tool_choice_none_shows_no_tools_and_parses_nothing(server):
    choice = chat(server, tool_choice="none", max_tokens=4).json()["choices"][0]
    assert choice["message"]["content"] == "aaaa" and "tool_calls" not in choice["message"]  # another prompt: no script


def test_a_named_function_s_arguments_keep_to_its_schema(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(server, tool_choice=named).json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["unit"] in ("c", "f")
    content, calls, finish = streamed(server, tool_choice=named)
    assert (content, finish) == ("", "stop") and [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call["function"]["arguments"])]


def test_required_tool_calls_keep_to_the_tools_schemas(server):
    # one call at most, so the script's model (the lowest id wins its ties: "," before "]") must close it
    choice = chat(server, tool_choice="required", parallel_tool_calls=False).json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["unit"] in ("c", "f")
    content, calls, finish = streamed(server, tool_choice="required", parallel_tool_calls=False)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(call["function"]["name"], call["function"]["arguments"])]
    # calls without end: cut short by max_tokens, the text comes back as it is
    choice = chat(server, tool_choice="required").json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] == []
    assert choice["message"]["content"].startswith('[{"name": "get_weather"')


def legacy(server, stream=False, **body) -> httpx.Response:
    functions = [WEATHER["function"], TIME["function"]]
    return chat(server, tools=None, functions=functions, stream=stream, **body)


def test_legacy_functions_come_back_as_one_function_call_streamed_and_not(server):
    choice = legacy(server).json()["choices"][0]
    assert choice["finish_reason"] == "function_call" and choice["message"]["content"] == "Let me look."
    assert "tool_calls" not in choice["message"]
    call = choice["message"]["function_call"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris", "unit": "c"}
    deltas = [c["choices"][0] for c in sse_chunks(legacy(server, stream=True).text) if c["choices"]]
    streamed_call = [d["delta"]["function_call"] for d in deltas if d["delta"].get("function_call")]
    assert streamed_call == [call] and deltas[-1]["finish_reason"] == "function_call"
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Let me look."
    assert not any("tool_calls" in d["delta"] for d in deltas)


def test_a_forced_legacy_function_call_keeps_to_its_schema(server):
    choice = legacy(server, function_call={"name": "get_weather"}).json()["choices"][0]
    call = choice["message"]["function_call"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["unit"] in ("c", "f")
    deltas = [c["choices"][0] for c in sse_chunks(legacy(server, stream=True, function_call={"name": "get_weather"})
                                                  .text) if c["choices"]]
    pieces = [d["delta"]["function_call"] for d in deltas if d["delta"].get("function_call")]
    assert pieces[0]["name"] == "get_weather" and "".join(p["arguments"] for p in pieces) == call["arguments"]
    assert legacy(server, function_call="none", max_tokens=4).json()["choices"][0]["message"] == {
        "role": "assistant", "content": "aaaa"}


def test_a_legacy_conversation_reaches_the_template_as_tool_calls_and_answers(tiny_model_dir):
    tokenizer = Tokenizer(tiny_model_dir)
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    old = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "function_call": call},
           {"role": "function", "name": "get_weather", "content": "sunny"}]
    new = [{"role": "user", "content": "hi"},
           {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": call}]},
           {"role": "tool", "name": "get_weather", "content": "sunny"}]
    as_text = [render_chat(tokenizer, [_message(m) for m in ms], True, False, None, [WEATHER]) for ms in (old, new)]
    assert as_text[0] == as_text[1] and "<tool_response>\nsunny" in as_text[0] and '"city": "Paris"' in as_text[0]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": None, "functions": [{"name": "f"}], "function_call": "sometimes"}, "function_call"),
    ({"tools": None, "function_call": "auto"}, "function_call"),
    ({"tools": None, "functions": [{"description": "no name"}]}, "functions"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": None, "functions": [{"name": "f"}], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
], ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else v)
def test_bad_tools_and_tool_choices_are_a_400_naming_them(server, body, param):
    response = chat(server, **body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


# --- the parser alone ------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 11])
def test_a_stream_cut_anywhere_reads_as_the_whole_text(cut):
    for text in (CALLS, "plain text", "a <tool_ca and no call", CALLS[:60], '<tool_call>{"nam</tool_call> x'):
        for parallel in (True, False):
            plan = ToolPlan("auto", parallel=parallel)
            stream, content, calls = ToolStream(plan), "", []
            for start in range(0, len(text), cut):
                more, new = stream.feed(text[start : start + cut])
                content, calls = content + more, calls + new
            more, new = stream.end()
            content, calls = content + more, calls + new
            whole_content, whole_calls = parse(plan, text)
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
                (c.name, c.arguments) for c in whole_calls], text
            assert content == (whole_content or ""), text
