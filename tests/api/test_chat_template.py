"""The chat template's inputs: every field a message sets, chat_template_kwargs (never replacing
the template or passing a field the request has its own check for), documents and reasoning_effort
(only to a template that reads them), and a request's own template (only where the server trusts
them), the chat endpoint and /tokenize alike."""

from __future__ import annotations

import httpx

from pegaserve.api.app import build_app
from pegaserve.config import Limits
from tests.api.helpers import scripted_frontend
from tests.contract.server import ThreadedServer

TEMPLATE = ("{% for m in messages %}{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}"
            "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{% if m.tool_calls %}{{ m.tool_calls | tojson }}"
            "{% endif %}: {{ m.content }}\n{% endfor %}{% if greeting %}{{ greeting }}{% endif %}")


def test_messages_and_template_kwargs_reach_the_chat_template(tiny_model_dir):
    frontend = scripted_frontend(tiny_model_dir, {})
    frontend.tokenizer.hf.chat_template = TEMPLATE
    messages = [{"role": "user", "content": "hi", "name": "bob"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    with ThreadedServer(build_app(frontend)) as running:
        tokens = httpx.post(f"{running.base_url}/tokenize", json={"messages": messages,
                                                                  "chat_template_kwargs": {"greeting": "hello!"}})
        text = httpx.post(f"{running.base_url}/detokenize", json={"tokens": tokens.json()["tokens"]}).json()["prompt"]
        chat = httpx.post(f"{running.base_url}/v1/chat/completions",
                          json={"messages": messages, "max_tokens": 1, "chat_template_kwargs": {"greeting": "hello!"}})
    assert text == 'user(bob): hi\nassistant[{"id": "c1"}]: \ntool[c1]: 42\nhello!'
    assert chat.json()["usage"]["prompt_tokens"] == tokens.json()["count"]


def test_template_kwargs_cannot_replace_the_template_or_pass_refused_fields(tiny_model_dir):
    frontend = scripted_frontend(tiny_model_dir, {})
    messages = [{"role": "user", "content": "hi"}]
    smuggled = {"chat_template": "{{ messages[0].content }}!", "documents": [{"text": "d"}]}
    with ThreadedServer(build_app(frontend)) as running:
        for name, value in smuggled.items():
            for path in ("/tokenize", "/v1/chat/completions"):
                asked = {"max_tokens": 1} if path != "/tokenize" else {}  # (/tokenize knows no max_tokens)
                response = httpx.post(f"{running.base_url}{path}", json={
                    "messages": messages, **asked, "chat_template_kwargs": {name: value}})
                error = response.json()["error"]
                assert response.status_code == 400 and error["param"] == "chat_template_kwargs", response.text
                assert name in error["message"]


RAG_TEMPLATE = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if reasoning_effort %}effort={{ reasoning_effort }}{% endif %}")


def rendered(running, **body) -> httpx.Response | str:
    """The prompt /tokenize renders for `body` (its text), after checking the chat endpoint counts
    the same tokens; the error response where either refuses."""
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    tokens = httpx.post(f"{running.base_url}/tokenize", json=body)
    chat = httpx.post(f"{running.base_url}/v1/chat/completions", json={**body, "max_tokens": 1})
    if tokens.status_code != 200 or chat.status_code != 200:
        assert tokens.status_code == chat.status_code == 400 and tokens.json() == {
            "error": {**chat.json()["error"], "message": tokens.json()["error"]["message"]}}
        return chat
    assert chat.json()["usage"]["prompt_tokens"] == tokens.json()["count"]
    return httpx.post(f"{running.base_url}/detokenize", json={"tokens": tokens.json()["tokens"]}).json()["prompt"]


def test_documents_and_reasoning_effort_reach_a_template_that_reads_them(tiny_model_dir):
    documents = [{"title": "t1", "text": "alpha"}, {"title": "t2", "text": "beta"}]
    with ThreadedServer(build_app(scripted_frontend(tiny_model_dir, {}))) as plain:
        for field, value in (("documents", documents), ("reasoning_effort", "low")):
            refused = rendered(plain, **{field: value})  # the default model's template reads neither
            assert refused.json()["error"]["param"] == field and "does not read" in refused.json()["error"]["message"]
    frontend = scripted_frontend(tiny_model_dir, {})
    frontend.tokenizer.hf.chat_template = RAG_TEMPLATE
    with ThreadedServer(build_app(frontend)) as rag:
        assert rendered(rag, documents=documents, reasoning_effort="high") == \
            "[t1: alpha][t2: beta]user: hi\neffort=high"
        assert rendered(rag, documents=None) == "user: hi\n"
        both = rendered(rag, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
        assert both.json()["error"]["param"] == "chat_template_kwargs"
        assert rendered(rag, reasoning_effort="extreme").json()["error"]["param"] == "reasoning_effort"


def test_a_requests_own_chat_template_only_where_the_server_trusts_it(tiny_model_dir):
    own = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}{% for d in documents %}({{ d.text }}){% endfor %}"
    with ThreadedServer(build_app(scripted_frontend(tiny_model_dir, {}))) as plain:
        refused = rendered(plain, chat_template=own)
        assert refused.json()["error"]["param"] == "chat_template"
        assert "trust_request_chat_template" in refused.json()["error"]["message"]
    trusting = scripted_frontend(tiny_model_dir, {}, limits=Limits(trust_request_chat_template=True))
    with ThreadedServer(build_app(trusting)) as running:
        assert rendered(running, chat_template=own, documents=[{"text": "d"}]) == "<<hi>>(d)"
        assert rendered(running, chat_template="{% for m in messages %}").json()["error"]["param"] == "chat_template"
        raising = rendered(running, chat_template="{{ raise_exception('no') }}")
        assert raising.json()["error"]["param"] == "chat_template"
        escape = rendered(running, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
        assert escape.json()["error"]["param"] == "chat_template"  # transformers' sandbox holds
