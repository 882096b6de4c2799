"""Faults on the running Serve app: a decode replica killed mid-stream, a prefill replica killed
during the handoff, a client that disconnects, the ledger actor killed."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import ray
from ray import serve

from pegaserve.deployments.ledger import LEDGER_NAME, LEDGER_NAMESPACE, NAMESPACE
from pegaserve.deployments.response_store import RESPONSE_STORE_NAME
from tests.helpers import PROMPTS
from tests.serve.helpers import deploy, start_ray, wait_for_idle_pools, wait_healthy

pytestmark = pytest.mark.ray
LONG = {"prompt": PROMPTS[1], "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def url():
    start_ray()
    yield deploy("faults", {"transport": "gloo", "engine": {"num_blocks": 512}})
    serve.delete("faults")


def replica_actor(app: str, deployment: str):
    """The one live replica of `deployment` (Serve names replica actors SERVE_REPLICA::app#name#id)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")]
    for name in names:
        try:
            actor = ray.get_actor(name, namespace="serve")
        except ValueError:
            continue  # a replica that is already gone
        return actor
    raise AssertionError(f"no live {app}/{deployment} replica among {names}")


def stream_lines(url: str, body: dict, on_chunk=None, max_chunks: int | None = None) -> list[str]:
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line:
                continue
            lines.append(line)
            if on_chunk is not None:
                on_chunk(len(lines))
            if max_chunks is not None and len(lines) >= max_chunks:
                break  # leaving the `with` closes the connection mid-stream
    return lines


def request_id_of(lines: list[str]) -> str:
    return json.loads(lines[0][6:])["id"]


def quick_request_succeeds(url: str) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            if response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError("the app did not recover")


def test_client_disconnect_aborts_everywhere_and_frees_blocks(url):
    lines = stream_lines(url, LONG, max_chunks=5)
    record = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and record.get("status") != "abort":
        record = httpx.get(f"{url}/admin/ledger/{request_id_of(lines)}").json()
        time.sleep(0.5)
    assert record["status"] == "abort" and record["violations"] == []
    wait_for_idle_pools(url, replicas=2)


def kill_at_chunk(app: str, deployment: str, at: int):
    killed = threading.Event()

    def on_chunk(num_chunks: int) -> None:
        if num_chunks == at and not killed.is_set():
            ray.kill(replica_actor(app, deployment), no_restart=True)
            killed.set()

    return killed, on_chunk


def test_decode_killed_mid_stream_resumes_the_stream(url):
    """The stream goes on from the next token on a fresh replica: one finishing chunk, every token
    once (tests/serve/test_migration.py checks the tokens against an undisturbed run)."""
    killed, on_chunk = kill_at_chunk("faults", "Decode", 5)
    lines = stream_lines(url, {**LONG, "max_tokens": 120, "return_token_ids": True}, on_chunk=on_chunk)
    assert killed.is_set()
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert not any("error" in c for c in chunks)
    finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishing) == 1 and finishing[0]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) == 120
    record = httpx.get(f"{url}/admin/ledger/{request_id_of(lines)}").json()
    assert record["status"] == "finished" and record["violations"] == [] and record["migrations"]
    quick_request_succeeds(url)  # and Serve replaced the replica
    wait_healthy(url)


def test_decode_killed_with_no_resume_left_ends_with_an_error_event(url):
    nomigrate = deploy("nomigrate", {"transport": "gloo", "engine": {"num_blocks": 256}, "max_migrations": 0})
    killed, on_chunk = kill_at_chunk("nomigrate", "Decode", 5)
    lines = stream_lines(nomigrate, LONG, on_chunk=on_chunk)
    assert killed.is_set()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])
    assert error["error"]["type"] == "internal_server_error"
    assert "Decode" not in error["error"]["message"] and "pid" not in error["error"]["message"]  # no internals
    assert not any(json.loads(line[6:]).get("choices", [{}])[0].get("finish_reason") for line in lines[:-2])
    record = httpx.get(f"{nomigrate}/admin/ledger/{request_id_of(lines)}").json()
    assert record["status"] == "error" and record["violations"] == []
    quick_request_succeeds(nomigrate)
    serve.delete("nomigrate")


def test_prefill_killed_during_handoff_decode_recomputes(ray_url_with_slow_send):
    url = ray_url_with_slow_send
    body = {"prompt": PROMPTS[3], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    reference = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
    result = {}

    def request() -> None:
        result["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(1.0)  # prefill has answered; its send is held back by the delay_kv_send_s double
    ray.kill(replica_actor("slowsend", "Prefill"), no_restart=True)
    thread.join(timeout=120)
    response = result["response"]
    assert response["choices"][0]["token_ids"] == reference
    record = httpx.get(f"{url}/admin/ledger/{response['id']}").json()
    assert record["handoff"]["fallback"].startswith("transfer failed") and record["violations"] == []
    quick_request_succeeds(url)


@pytest.fixture
def ray_url_with_slow_send(url):
    slow = deploy("slowsend", {"transport": "gloo", "engine": {"num_blocks": 256}}, doubles={"delay_kv_send_s": 4.0})
    yield slow
    serve.delete("slowsend")


def test_ledger_killed_restarts_from_its_journal_and_requests_complete(url):
    done = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 3}, timeout=60).json()
    killed = threading.Event()

    def kill_ledger(num_chunks: int) -> None:
        if num_chunks == 3 and not killed.is_set():
            ray.kill(ray.get_actor(LEDGER_NAME, namespace=LEDGER_NAMESPACE), no_restart=False)
            killed.set()

    lines = stream_lines(url, {**LONG, "max_tokens": 200}, on_chunk=kill_ledger)
    assert killed.is_set()
    finishing = json.loads(lines[-2][6:])["choices"][0]
    assert finishing["finish_reason"] == "length"
    before = httpx.get(f"{url}/admin/ledger/{done['id']}", timeout=60).json()
    assert before["status"] == "finished" and before["completion_tokens"] == 3
    during = httpx.get(f"{url}/admin/ledger/{request_id_of(lines)}", timeout=60).json()
    assert during["status"] == "finished" and during["completion_tokens"] == 200
    assert httpx.get(f"{url}/admin/ledger", timeout=60).json()["invariant_violations"] == 0


def test_a_killed_response_store_restarts_empty_and_stores_again(url):
    """Memory only: what it held is gone (continuing it is a 400 naming the parameter, never a 500),
    and the next response is stored and continued as before."""
    body = {"input": "Hi", "max_output_tokens": 3, "temperature": 0}
    lost = httpx.post(f"{url}/v1/responses", json=body, timeout=60).json()
    ray.kill(ray.get_actor(RESPONSE_STORE_NAME, namespace=NAMESPACE), no_restart=False)
    refused = httpx.post(f"{url}/v1/responses", json={**body, "previous_response_id": lost["id"]}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
    kept = httpx.post(f"{url}/v1/responses", json=body, timeout=60).json()
    assert httpx.get(f"{url}/v1/responses/{kept['id']}", timeout=60).json() == kept
    continued = httpx.post(f"{url}/v1/responses", json={**body, "previous_response_id": kept["id"]}, timeout=60)
    assert continued.status_code == 200 and continued.json()["previous_response_id"] == kept["id"]


def test_an_ingress_that_dies_leaves_no_record_open(url):
    """...nor a background response it was generating in progress for good: it reads as failed."""
    orphan = deploy("orphan", {"transport": "gloo", "engine": {"num_blocks": 256}, "ledger_orphan_timeout_s": 3})
    background = httpx.post(f"{orphan}/v1/responses", timeout=60, json={
        "input": "Hi", "background": True, "max_output_tokens": 3000, "temperature": 0, "ignore_eos": True}).json()
    assert background["status"] == "queued"
    killed, on_chunk = kill_at_chunk("orphan", "Ingress", 3)
    try:
        lines = stream_lines(orphan, LONG, on_chunk=on_chunk)
    except httpx.HTTPError:
        lines = None  # the connection died with the ingress
    assert killed.is_set()
    wait_healthy(orphan)  # Serve started another ingress
    request_id = request_id_of(lines) if lines else None
    deadline = time.monotonic() + 60
    summary = {}
    while time.monotonic() < deadline:
        summary = httpx.get(f"{orphan}/admin/ledger", timeout=30).json()
        if summary["by_status"]["in_flight"] == 0:
            break
        time.sleep(1)
    assert summary["by_status"]["in_flight"] == 0 and summary["invariant_violations"] == 0
    if request_id is not None:
        assert httpx.get(f"{orphan}/admin/ledger/{request_id}").json()["status"] == "error"
    while (response := httpx.get(f"{orphan}/v1/responses/{background['id']}", timeout=30).json())["status"] in (
            "queued", "in_progress"):
        assert time.monotonic() < deadline, response
        time.sleep(0.5)
    assert response["status"] == "failed" and response["error"]["code"] == "server_error", response
    wait_for_idle_pools(orphan, replicas=2, timeout_s=60)  # its decode stopped when its ingress vanished
    serve.delete("orphan")
