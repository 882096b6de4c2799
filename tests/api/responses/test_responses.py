"""The Responses API (pegaserve/api/responses/endpoint.py) with the official openai client: a response is the
chat completion of its messages, token for token; its streamed events add up to it in OpenAI's
order; function tools, tool outputs and text formats travel as chat's; what is not served is a 400
naming the Responses parameter."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from pegaserve.api.protocol import REFUSED_RESPONSES, ResponsesRequest
from pegaserve.api.responses.endpoint import chat_body
from pegaserve.api.responses.store import MemoryResponseStore
from tests.api.field_kinds import NO_EFFECT, REFUSED_VALUES
from tests.api.test_tools import TIME, WEATHER, tools_app
from tests.contract.server import ThreadedServer

TOOLS = [{"type": "function", **WEATHER["function"]}, {"type": "function", **TIME["function"]}]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture
def real(real_server):
    return real_server


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    """The model writes test_tools' CALLS after its MESSAGES rendered with both tools."""
    with ThreadedServer(tools_app(tiny_model_dir)) as running:
        yield running


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_a_response_is_the_chat_completion_of_its_messages(real):
    chat = httpx.post(f"{real.base_url}/v1/chat/completions", timeout=60, json={
        "messages": CONVERSATION, "max_completion_tokens": 6, "temperature": 0, "ignore_eos": True}).json()
    response = client(real).responses.create(model="qwen3-tiny", instructions="Be brief.", input="Name a colour.",
                                             max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat["choices"][0]["message"]["content"] and response.output_text
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    # cut by the length limit: incomplete, as OpenAI says it
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat["usage"]["prompt_tokens"], 6)
    assert response.usage.total_tokens == response.usage.input_tokens + 6
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    # the same prompt again: the prefix cache holds its full blocks, and says so (chat too)
    again = client(real).responses.create(model="qwen3-tiny", instructions="Be brief.", input="Name a colour.",
                                          max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    cached = again.usage.input_tokens_details.cached_tokens
    assert again.output_text == response.output_text and 0 < cached < again.usage.input_tokens
    assert cached % 16 == 0  # whole blocks
    chat_again = httpx.post(f"{real.base_url}/v1/chat/completions", timeout=60, json={
        "messages": CONVERSATION, "max_completion_tokens": 6, "temperature": 0, "ignore_eos": True}).json()
    assert chat_again["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    record = httpx.get(f"{real.base_url}/admin/ledger/{response.id}").json()  # the ledger's key
    assert record["status"] == "finished" and record["completion_tokens"] == 6 and record["violations"] == []


def test_an_eos_completes_the_response(real):
    response = client(real).responses.create(model="qwen3-tiny", input="Hi", max_output_tokens=40, temperature=0,
                                             extra_body={"stop_token_ids": [], "stop": ["e"]})
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output[0].status == "completed" and "e" not in response.output_text


def test_streamed_events_add_up_to_the_response_in_openais_order(real):
    body = {"model": "qwen3-tiny", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
            "max_output_tokens": 5, "temperature": 0}
    whole = client(real).responses.create(**body)
    events = list(client(real).responses.create(stream=True, **body))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and 1 <= len(deltas) <= 5  # at most one per token
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 5
    raw = httpx.post(f"{real.base_url}/v1/responses", json={**body, "stream": True}, timeout=60).text
    assert raw.startswith("event: response.created\ndata: {") and "[DONE]" not in raw  # OpenAI's framing


def test_function_calls_come_back_as_function_call_items_streamed_and_not(scripted):
    response = client(scripted).responses.create(model="qwen3-tiny", input="Weather in Paris?", tools=TOOLS, temperature=0,
                                                 max_output_tokens=80)
    message, *calls = response.output
    assert response.status == "completed" and message.content[0].text == "Let me look."
    assert [(c.type, c.name, json.loads(c.arguments)) for c in calls] == [
        ("function_call", "get_weather", {"city": "Paris", "unit": "c"}), ("function_call", "get_time", {})]
    assert all(c.call_id.startswith("chatcmpl-tool-") and c.id.startswith("fc_") for c in calls)
    events = list(client(scripted).responses.create(model="qwen3-tiny", input="Weather in Paris?", tools=TOOLS,
                                                    temperature=0, max_output_tokens=80, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["message", "function_call", "function_call"]
    done = {e.item_id: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(c.name, c.arguments) for c in final.output[1:]] == [(c.name, c.arguments) for c in calls]
    assert list(done.values()) == [c.arguments for c in calls]
    one = client(scripted).responses.create(model="qwen3-tiny", input="Weather in Paris?", tools=TOOLS, temperature=0,
                                            max_output_tokens=80, parallel_tool_calls=False)
    assert [o.type for o in one.output] == ["message", "function_call"]


def test_input_items_become_chats_messages():
    body = ResponsesRequest.model_validate({"instructions": "Be brief.", "tools": TOOLS, "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"unit": "c"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "20"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "20 at noon"}]},
    ], "tool_choice": {"type": "function", "name": "get_time"}, "max_output_tokens": 9,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "low"}, "top_k": 5, "seed": 3})
    chat = chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "20"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "noon"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "20 at noon"}]},
    ]
    assert chat["tools"] == [WEATHER, TIME] and chat["tool_choice"] == {"type": "function",
                                                                        "function": {"name": "get_time"}}
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True}}
    assert (chat["max_completion_tokens"], chat["reasoning_effort"], chat["top_k"], chat["seed"]) == (9, "low", 5, 3)


def test_a_json_schema_text_format_holds_the_output(scripted):
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    response = client(scripted).responses.create(model="qwen3-tiny", input="Pick", max_output_tokens=40, temperature=0,
                                             text={"format": {"type": "json_schema", "name": "pick", "schema": schema,
                                                              "strict": True}})
    assert response.status == "completed" and json.loads(response.output_text)["a"] in (1, 2)
    assert response.text.format.type == "json_schema"


BAD = [
    ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # the default model's template reads none
    ({"truncation": "middle"}, "truncation"),
    ({"include": ["message.output_audio"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without its include
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"text": {"verbosity": "low"}}, "text"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"max_tool_calls": -1}, "max_tool_calls"),
    ({"input": "hello " * 5000}, "input"),  # past the context
]


@pytest.mark.parametrize("name", REFUSED_RESPONSES)
def test_what_is_not_served_is_a_400_naming_it(real, name):
    response = httpx.post(f"{real.base_url}/v1/responses", json={"input": "hi", name: REFUSED_VALUES[name]}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == name, response.text
    ok = httpx.post(f"{real.base_url}/v1/responses", json={"input": "hi", "max_output_tokens": 2, name: None})
    assert ok.status_code == 200


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_responses_bodies_are_a_400_naming_the_parameter(real, body, param):
    response = httpx.post(f"{real.base_url}/v1/responses", json={"input": "hi", **body}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


NO_EFFECT_HERE = {**NO_EFFECT, "include": ["reasoning.encrypted_content", "code_interpreter_call.outputs"],
                  "metadata": {"team": "search"}}  # (a label on the output: the same output)


@pytest.mark.parametrize("name", ["user", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
                                  "include", "max_tool_calls"])
def test_labels_and_hints_change_nothing(real, name):
    body = {"input": "hi", "max_output_tokens": 4, "temperature": 0}
    plain = httpx.post(f"{real.base_url}/v1/responses", json=body, timeout=60).json()
    other = httpx.post(f"{real.base_url}/v1/responses", json={**body, name: NO_EFFECT_HERE[name]}, timeout=60).json()
    assert other["output"][0]["content"] == plain["output"][0]["content"] and other["usage"] == plain["usage"]


def test_included_logprobs_are_chats(real):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: chat's logprobs, in its shape."""
    chat = httpx.post(f"{real.base_url}/v1/chat/completions", timeout=60, json={
        "messages": CONVERSATION[1:], "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 3}).json()
    expected = chat["choices"][0]["logprobs"]["content"]
    body = {"model": "qwen3-tiny", "input": CONVERSATION[1]["content"], "max_output_tokens": 4, "temperature": 0,
            "include": ["message.output_text.logprobs"], "top_logprobs": 3}
    response = client(real).responses.create(**body)
    logprobs = [lp.model_dump() for lp in response.output[0].content[0].logprobs]
    assert [(lp["token"], lp["bytes"], len(lp["top_logprobs"])) for lp in logprobs] == [
        (lp["token"], lp["bytes"], 3) for lp in expected]
    assert [lp["logprob"] for lp in logprobs] == pytest.approx([lp["logprob"] for lp in expected], abs=1e-5)
    assert response.top_logprobs == 3
    events = list(client(real).responses.create(stream=True, **body))
    streamed = [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp["token"] for lp in streamed] == [lp["token"] for lp in logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [lp["token"] for lp in logprobs]
    plain = client(real).responses.create(**{**body, "include": None, "top_logprobs": None})
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == response.output_text


def test_previous_response_id_continues_its_conversation(real):
    """The stored response's input and output come before the new input; its instructions do not
    carry over (OpenAI's rule). Streamed, a response is stored before its last event."""
    first = client(real).responses.create(model="qwen3-tiny", instructions="Be brief.", input="Name a colour.",
                                          max_output_tokens=6, temperature=0)
    assert first.store is True and first.previous_response_id is None
    messages = [CONVERSATION[1], {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Another?"}]
    chat = httpx.post(f"{real.base_url}/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_completion_tokens": 6, "temperature": 0}).json()
    second = client(real).responses.create(model="qwen3-tiny", previous_response_id=first.id, input="Another?",
                                           max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id and second.output_text == chat["choices"][0]["message"]["content"]
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
    events = list(client(real).responses.create(model="qwen3-tiny", previous_response_id=first.id, input="Another?",
                                                max_output_tokens=6, temperature=0, stream=True))
    third = client(real).responses.create(model="qwen3-tiny", previous_response_id=events[-1].response.id,
                                          input="And?", max_output_tokens=2, temperature=0)
    chat = httpx.post(f"{real.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [*messages, {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "And?"}],
        "max_completion_tokens": 2, "temperature": 0}).json()
    assert third.output_text == chat["choices"][0]["message"]["content"]
    assert third.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_stored_responses_are_read_listed_and_deleted(real):
    items = [{"role": "user", "content": "One."}, {"role": "assistant", "content": "Two."},
             {"type": "message", "id": "msg_mine", "role": "user", "content": [{"type": "input_text", "text": "3"}]}]
    created = httpx.post(f"{real.base_url}/v1/responses", timeout=60,
                         json={"input": items, "max_output_tokens": 3, "metadata": {"k": "v"}}).json()
    url = f"{real.base_url}/v1/responses/{created['id']}"
    assert httpx.get(url).json() == created
    assert client(real).responses.retrieve(created["id"]).output_text == created["output"][0]["content"][0]["text"]
    listed = client(real).responses.input_items.list(created["id"], order="asc")
    assert [i.role for i in listed.data] == ["user", "assistant", "user"] and listed.data[-1].id == "msg_mine"
    newest = httpx.get(f"{url}/input_items", params={"limit": 1}).json()  # newest first, as OpenAI's default
    assert [i["id"] for i in newest["data"]] == ["msg_mine"] and newest["has_more"]
    rest = httpx.get(f"{url}/input_items", params={"after": "msg_mine"}).json()
    assert [i["role"] for i in rest["data"]] == ["assistant", "user"] and not rest["has_more"]
    for params, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after"),
                          ({"stream": "true"}, "stream")):
        path = url if param == "stream" else f"{url}/input_items"
        bad = httpx.get(path, params=params)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    client(real).responses.delete(created["id"])
    for gone in (httpx.get(url), httpx.delete(url), httpx.get(f"{url}/input_items")):
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
    refused = httpx.post(f"{real.base_url}/v1/responses", json={"input": "hi", "previous_response_id": created["id"]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
    unstored = httpx.post(f"{real.base_url}/v1/responses", timeout=60,
                          json={"input": "hi", "max_output_tokens": 2, "store": False}).json()
    assert unstored["store"] is False and httpx.get(f"{real.base_url}/v1/responses/{unstored['id']}").status_code == 404


def test_the_store_keeps_the_most_recent():
    store = MemoryResponseStore(max_responses=2)

    async def run() -> list:
        for key in ("a", "b"):
            await store.put(key, {"response": key})
        await store.get("a")  # read: kept over b
        await store.put("c", {"response": "c"})
        return [await store.get(key) for key in ("a", "b", "c")] + [await store.delete("c"), await store.delete("c")]

    assert asyncio.run(run()) == [{"response": "a"}, None, {"response": "c"}, True, False]


def test_truncation_auto_leaves_out_the_conversations_start_until_it_fits(real):
    """The fewest items from the start (never the instructions) so that the prompt and
    max_output_tokens fit the context; disabled (the default), the same body is a 400."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 400} for i in range(24)]
    body = {"instructions": "Be brief.", "input": turns, "max_output_tokens": 50, "temperature": 0}
    refused = httpx.post(f"{real.base_url}/v1/responses", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
    response = client(real).responses.create(model="qwen3-tiny", truncation="auto", **body)
    assert response.truncation == "auto" and response.status == "incomplete"

    def tokens(kept: list[dict], system: bool = True) -> int:
        messages = [{"role": "system", "content": "Be brief."}] * system + kept
        return httpx.post(f"{real.base_url}/tokenize", json={"messages": messages, "add_generation_prompt": True},
                          timeout=60).json()["count"]

    kept = next(k for k in range(1, len(turns)) if tokens(turns[k:]) + 50 <= 4096)
    assert response.usage.input_tokens == tokens(turns[kept:]) and tokens(turns[kept - 1:]) + 50 > 4096
    chat = httpx.post(f"{real.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "system", "content": "Be brief."}, *turns[kept:]], "max_tokens": 50,
        "temperature": 0}).json()
    assert response.output_text == chat["choices"][0]["message"]["content"]
    # past the call (too long to keep), the conversation would open on its output: that goes too
    tool_turns = [{"role": "user", "content": "Call f."},
                  {"type": "function_call", "call_id": "c", "name": "f", "arguments": "word " * 5000},
                  {"type": "function_call_output", "call_id": "c", "output": "done"},
                  {"role": "user", "content": "Go on."}]
    short = client(real).responses.create(model="qwen3-tiny", input=tool_turns, truncation="auto",
                                          max_output_tokens=4, temperature=0)
    assert short.usage.input_tokens == tokens([tool_turns[-1]], system=False)


def test_the_store_is_bounded_in_bytes_and_never_drops_a_running_background_response():
    store = MemoryResponseStore(max_responses=100, max_bytes=3000)
    running = {"response": {"status": "in_progress"}, "pad": "r" * 1000}

    async def run() -> list:
        await store.put("resp_running", running)
        for key in ("a", "b", "c"):
            await store.put(key, {"response": {"status": "completed"}, "pad": key * 1000})
        kept = [key for key in ("resp_running", "a", "b", "c") if await store.get(key) is not None]
        await store.keep_alive("resp_running", 1.0, [{"type": "e", "pad": "x" * 1500}])  # its events grow it
        await store.put("d", {"response": {"status": "completed"}, "pad": "d"})
        after = [key for key in ("resp_running", "a", "b", "c", "d") if await store.get(key) is not None]
        await store.delete("d")
        return [kept, after, store.num_bytes <= 3000]

    kept, after, within = asyncio.run(run())
    assert kept == ["resp_running", "c"]  # the oldest done ones went; the running one, older, stayed
    assert after[0] == "resp_running" and "d" in after and within
