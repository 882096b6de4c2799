"""Stored chat completions (`store: true`): kept whole, streamed or not, with their metadata and
messages; listed, read, updated and deleted as OpenAI's (pegaserve/api/stored_chats.py)."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

ASKED = {"model": "qwen3-tiny", "max_tokens": 5, "temperature": 0}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour ✓"}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_a_stored_completion_is_read_back_whole_with_its_messages_streamed_or_not(real_server):
    openai_client, run = client(real_server), uuid.uuid4().hex
    whole = openai_client.chat.completions.create(messages=MESSAGES, store=True, metadata={"run": run}, n=2,
                                                  logprobs=True, **ASKED)
    stored = openai_client.chat.completions.retrieve(whole.id)
    assert stored.model_dump(exclude={"metadata"}) == whole.model_dump(exclude={"metadata"})
    assert stored.metadata == {"run": run}
    messages = openai_client.chat.completions.messages.list(whole.id)
    assert [(m.role, m.content) for m in messages.data] == [(m["role"], m["content"]) for m in MESSAGES]
    assert [m.id for m in messages.data] == [f"{whole.id}-0", f"{whole.id}-1"] and not messages.has_more
    streamed = list(openai_client.chat.completions.create(messages=MESSAGES, store=True, stream=True, **ASKED))
    kept = openai_client.chat.completions.retrieve(streamed[0].id)  # stored before the stream's end
    assert kept.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert kept.choices[0].message.content == whole.choices[0].message.content and kept.usage.completion_tokens == 5
    unstored = openai_client.chat.completions.create(messages=MESSAGES, **ASKED)
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.retrieve(unstored.id)


def test_stored_completions_are_listed_filtered_paged_updated_and_deleted(real_server):
    openai_client, run = client(real_server), uuid.uuid4().hex
    ids = [openai_client.chat.completions.create(messages=MESSAGES, store=True, metadata={"run": run, "i": str(i)},
                                                 **ASKED).id for i in range(3)]
    listed = openai_client.chat.completions.list(metadata={"run": run}, limit=2)
    assert [c.id for c in listed.data] == ids[:2] and listed.has_more  # oldest first
    rest = openai_client.chat.completions.list(metadata={"run": run}, limit=2, after=ids[1])
    assert [c.id for c in rest.data] == ids[2:] and not rest.has_more
    newest = openai_client.chat.completions.list(metadata={"run": run, "i": "2"}, order="desc", model="qwen3-tiny")
    assert [c.id for c in newest.data] == ids[2:]
    assert openai_client.chat.completions.list(metadata={"run": run}, model="other").data == []
    updated = openai_client.chat.completions.update(ids[0], metadata={"run": run, "tag": "kept"})
    assert updated.metadata == {"run": run, "tag": "kept"}
    assert openai_client.chat.completions.retrieve(ids[0]).metadata == {"run": run, "tag": "kept"}
    deleted = openai_client.chat.completions.delete(ids[1])
    assert deleted.deleted and deleted.id == ids[1] and deleted.object == "chat.completion.deleted"
    assert [c.id for c in openai_client.chat.completions.list(metadata={"run": run}).data] == [ids[0], ids[2]]
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.retrieve(ids[1])


def test_bad_stored_completion_requests_are_a_400_naming_the_parameter(real_server):
    url = f"{real_server.base_url}/v1/chat/completions"
    chat = {"messages": MESSAGES, **ASKED}
    for metadata in ({str(i): "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        response = httpx.post(url, json={**chat, "store": True, "metadata": metadata})
        assert response.status_code == 400 and response.json()["error"]["param"] == "metadata", response.text
    kept = httpx.post(url, json={**chat, "store": True}, timeout=60).json()
    for method, path, body, param in (("GET", "?limit=0", None, "limit"), ("GET", "?after=chatcmpl-x", None, "after"),
                                      ("GET", "?order=up", None, "order"),
                                      ("POST", f"/{kept['id']}", {"metadata": {"k": "v"}, "model": "x"}, "model"),
                                      ("POST", f"/{kept['id']}", {"metadata": {"k": 1}}, "metadata"),
                                      ("GET", f"/{kept['id']}/messages?limit=101", None, "limit")):
        response = httpx.request(method, url + path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (path, response.text)
    for method in ("GET", "DELETE"):
        response = httpx.request(method, f"{url}/chatcmpl-unknown")
        assert response.status_code == 404 and response.json()["error"]["param"] == "completion_id", response.text
    assert httpx.get(f"{url}/resp_unknown/messages").status_code == 404
    assert httpx.post(f"{url}/{kept['id']}", json={"metadata": None}).json()["metadata"] == {}  # null: none


def test_a_stored_chats_id_is_no_responses_id_on_any_route(real_server):
    """The Responses routes read only `resp_` ids: a stored chat's id is a 404 there (a 400 as a
    `previous_response_id`), never a 500, and a DELETE there leaves the chat stored."""
    base = f"{real_server.base_url}/v1"
    kept = httpx.post(f"{base}/chat/completions", json={"messages": MESSAGES, **ASKED, "store": True}, timeout=60).json()
    chat_id = kept["id"]
    for method, path in (("GET", f"/responses/{chat_id}"), ("GET", f"/responses/{chat_id}/input_items"),
                         ("POST", f"/responses/{chat_id}/cancel"), ("DELETE", f"/responses/{chat_id}")):
        response = httpx.request(method, base + path)
        assert response.status_code == 404 and response.json()["error"]["param"] == "response_id", (path, response.text)
    continued = httpx.post(f"{base}/responses", json={"input": "hi", "previous_response_id": chat_id,
                                                      "max_output_tokens": 2}, timeout=60)
    assert continued.status_code == 400 and continued.json()["error"]["param"] == "previous_response_id"
    assert httpx.get(f"{base}/chat/completions/{chat_id}").json()["id"] == chat_id  # still stored
