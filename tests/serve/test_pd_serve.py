"""P/D on a real Ray Serve app (CPU): the contract cases again, greedy parity with transformers,
each CPU transport, the recompute fallback, and 2 prefill + 2 decode replicas under load."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest
import torch
from ray import serve
from transformers import Qwen3ForCausalLM

from pegaserve.tokenizer import Tokenizer
from tests.api.helpers import reference_beams
from tests.contract import cases
from tests.contract.cases import CASES
from tests.contract.checks import check_case
from tests.helpers import PROMPTS
from tests.serve.helpers import deploy, start_ray, wait_for_idle_pools

pytestmark = pytest.mark.ray
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def ray_serve():
    start_ray()
    yield
    serve.shutdown()


@pytest.fixture(scope="module")
def contract_url(ray_serve, tiny_model_dir):
    return deploy("contract", {"transport": "gloo"}, doubles={"script": cases.script(Tokenizer(tiny_model_dir))})


@pytest.fixture(scope="module")
def gloo_url(ray_serve):
    return deploy("gloo", {"transport": "gloo", "engine": {"num_blocks": 256}}, num_prefill=2, num_decode=2)


@pytest.fixture(scope="module")
def reference_tokens(tiny_model_dir) -> list[list[int]]:
    hf = Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            for _ in range(NEW_TOKENS):
                ids = torch.cat([ids, hf(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
            out.append(ids[0, len(prompt):].tolist())
    return out


def greedy_ids(url: str, prompt: list[int]) -> tuple[list[int], str]:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    return response["choices"][0]["token_ids"], response["id"]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_contract_case_through_pd(contract_url, index):
    client = openai.OpenAI(base_url=f"{contract_url}/v1", api_key="unused", max_retries=0)
    check_case(client, contract_url, index)


def test_first_token_stop_moves_no_kv(contract_url):
    for name in ("first_token_eos", "stop_string_first_token", "max_tokens_1"):
        index = next(i for i, c in enumerate(CASES) if c.name == name)
        client = openai.OpenAI(base_url=f"{contract_url}/v1", api_key="unused", max_retries=0)
        check_case(client, contract_url, index)
        from tests.contract.run import ask

        answer, _ = ask(client, index, stream=False)
        record = httpx.get(f"{contract_url}/admin/ledger/{answer.request_id}").json()
        assert record["handoff"] is None, name
        assert record["completion_tokens"] == 1 and record["first_token"]["id"] == CASES[index].generated[0]
        assert not any(e["component"].startswith("contract/Decode") for e in record["events"]), name
        names = [e["name"] for e in record["events"]]  # the ingress records prefill's token ahead of the finish
        assert names.index("prefilled") < names.index("finished") and record["violations"] == [], name
    wait_for_idle_pools(contract_url, replicas=2)


def test_pd_greedy_equals_transformers_over_gloo(gloo_url, reference_tokens):
    for prompt, expected in zip(PROMPTS, reference_tokens):
        ids, request_id = greedy_ids(gloo_url, prompt)
        assert ids == expected
        handoff = httpx.get(f"{gloo_url}/admin/ledger/{request_id}").json()["handoff"]
        assert handoff["transport"] == "gloo" and handoff["fallback"] is None and handoff["kv_bytes"] > 0


def test_beam_search_through_pd_is_transformers_beam_search_with_no_kv_moved(gloo_url, tiny_model_dir):
    """Each step's one-token requests end at prefill (rule 21), and each is closed in the ledger."""
    prompt = PROMPTS[1]
    body = {"prompt": prompt, "max_tokens": 4, "n": 2, "use_beam_search": True, "ignore_eos": True,
            "return_token_ids": True}
    response = httpx.post(f"{gloo_url}/v1/completions", json=body, timeout=60).json()
    hf = Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert [c["token_ids"] for c in response["choices"]] == [list(t) for t, _ in reference_beams(hf, prompt, 2, 4)]
    for step in ("beam1.0", "beam4.1"):
        record = httpx.get(f"{gloo_url}/admin/ledger/{response['id']}-{step}").json()
        assert record["status"] == "finished" and record["handoff"] is None and record["violations"] == []
        assert record["first_token"] is not None  # prefill's, as the step's only token
    wait_for_idle_pools(gloo_url, replicas=4)


def test_priority_reaches_prefill_and_decode_only_under_the_priority_policy(ray_serve, gloo_url):
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    refused = httpx.post(f"{gloo_url}/v1/completions", json={**body, "priority": 1}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    url = deploy("ranked", {"transport": "gloo", "engine": {"num_blocks": 128, "scheduling_policy": "priority"}})
    expected = httpx.post(f"{gloo_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]

    async def ranked_requests():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{url}/v1/completions", json={**body, "priority": p})
                                          for p in (3, -1, 0, 2)))

    for response in asyncio.run(ranked_requests()):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == expected
    assert httpx.get(f"{url}/admin/ledger").json()["invariant_violations"] == 0
    serve.delete("ranked")


def test_a_response_through_pd_is_its_chat_completion_streamed_and_not(gloo_url):
    """The Responses API rides the chat path: the same tokens, its KV handed off, its record closed."""
    client = openai.OpenAI(base_url=f"{gloo_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to five."}]
    chat = client.chat.completions.create(model="qwen3-tiny", messages=messages, max_completion_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    body = {"model": "qwen3-tiny", "instructions": "Be brief.", "input": "Count to five.", "max_output_tokens": 8,
            "temperature": 0, "extra_body": {"ignore_eos": True}}
    response = client.responses.create(**body)
    assert response.output_text == chat.choices[0].message.content and response.status == "incomplete"
    assert response.usage.input_tokens == chat.usage.prompt_tokens and response.usage.output_tokens == 8
    events = list(client.responses.create(stream=True, **body))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 8
    record = httpx.get(f"{gloo_url}/admin/ledger/{response.id}").json()
    assert record["status"] == "finished" and record["handoff"]["fallback"] is None and record["violations"] == []
    stored_chat = client.chat.completions.create(model="qwen3-tiny", messages=messages, max_completion_tokens=8,
                                                 temperature=0, store=True, metadata={"pd": "yes"},
                                                 extra_body={"ignore_eos": True})
    assert client.chat.completions.retrieve(stored_chat.id).choices[0].message.content == response.output_text
    assert [c.id for c in client.chat.completions.list(metadata={"pd": "yes"})] == [stored_chat.id]
    # stored in the store actor every ingress replica shares, and continued from there
    assert client.responses.retrieve(events[-1].response.id).output_text == response.output_text
    follow = [*messages[1:], {"role": "assistant", "content": response.output_text}, {"role": "user", "content": "Six?"}]
    chat = client.chat.completions.create(model="qwen3-tiny", messages=follow, max_completion_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    continued = client.responses.create(**{**body, "instructions": None, "max_output_tokens": 4, "input": "Six?"},
                                        previous_response_id=response.id)
    assert continued.output_text == chat.choices[0].message.content
    # in the background: queued at once, ended in the store actor as the same response; a long one cancelled
    queued = client.responses.create(background=True, **body)
    assert queued.status == "queued"
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert done.output_text == response.output_text and done.usage.output_tokens == 8
    events = list(client.responses.create(background=True, stream=True, **body))  # streamed: replayed from the actor
    assert events[-1].response.output_text == response.output_text
    replayed = list(client.responses.retrieve(events[0].response.id, stream=True, starting_after=2))
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in events[3:]]
    running = client.responses.create(background=True, **{**body, "max_output_tokens": 3000})
    while httpx.get(f"{gloo_url}/admin/ledger/{running.id}").status_code == 404:  # until its generation begins
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert client.responses.cancel(running.id).status == "cancelled"
    while (record := httpx.get(f"{gloo_url}/admin/ledger/{running.id}").json())["status"] == "in_flight":
        assert time.monotonic() < deadline, record
        time.sleep(0.05)
    assert record["status"] == "abort" and record["violations"] == [], record
    assert client.responses.retrieve(running.id).status == "cancelled"


def test_n_choices_share_one_handoff_recorded_per_choice(gloo_url):
    """The KV of n choices moves once, and every event of it lands in each choice's record: none
    under the request's own id, which would stay open in the ledger for good."""
    prompt = list(range(5000, 5040))  # in no decode replica's prefix cache: its KV must move
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True, "n": 2}
    response = httpx.post(f"{gloo_url}/v1/completions", json=body, timeout=60).json()
    record = httpx.get(f"{gloo_url}/admin/ledger/{response['id']}").json()
    assert record["status"] == "finished" and len(record["choices"]) == 2, record
    for choice in record["choices"]:
        handoff = choice["handoff"]
        assert handoff["prefill_replica"] is not None and handoff["kv_bytes"] > 0 and handoff["fallback"] is None
        assert choice["violations"] == []


def test_shm_transport_copies_through_shared_memory_and_gives_the_same_tokens(ray_serve, reference_tokens):
    url = deploy("shm", {"transport": "shm", "engine": {"num_blocks": 256}})
    for prompt, expected in zip(PROMPTS[:4], reference_tokens[:4]):
        ids, request_id = greedy_ids(url, prompt)
        assert ids == expected
        handoff = httpx.get(f"{url}/admin/ledger/{request_id}").json()["handoff"]
        assert handoff["transport"] == "shm" and handoff["fallback"] is None and handoff["kv_bytes"] > 0
    wait_for_idle_pools(url, replicas=2)  # prefill freed every block once decode said it had copied them
    serve.delete("shm")


def test_gloo_pushes_the_kv_before_decode_asks_and_gives_the_same_tokens(ray_serve, reference_tokens):
    """One prefill and one decode replica over gloo: once their pair is open, each prompt's KV is
    pushed as prefill leases it (pegaserve/pd/push.py); the tokens are the same."""
    url = deploy("push", {"transport": "gloo", "engine": {"num_blocks": 256}})
    pushed = []
    for prompt, expected in zip(PROMPTS[:4], reference_tokens[:4]):
        ids, request_id = greedy_ids(url, prompt)
        assert ids == expected
        handoff = httpx.get(f"{url}/admin/ledger/{request_id}").json()["handoff"]
        assert handoff["transport"] == "gloo" and handoff["fallback"] is None and handoff["kv_bytes"] > 0
        pushed.append(handoff["pushed"])
    assert pushed == [False, True, True, True]  # the first opened the pair
    wait_for_idle_pools(url, replicas=2)  # prefill freed every block once decode said it had copied them
    serve.delete("push")


def test_the_clients_request_id_is_echoed_once_and_kept_in_the_ledger(gloo_url):
    body = {"prompt": PROMPTS[2], "max_tokens": 3}
    responses = [httpx.post(f"{gloo_url}/v1/completions", json=body, headers={"X-Request-Id": "retry-7"}, timeout=60)
                 for _ in range(2)]
    ids = {r.json()["id"] for r in responses}
    assert len(ids) == 2 and all(i.startswith("cmpl-") for i in ids)  # a retry is a request of its own
    for response in responses:
        assert response.headers.get_list("x-request-id") == ["retry-7"]
        record = httpx.get(f"{gloo_url}/admin/ledger/{response.json()['id']}").json()
        assert record["client_request_id"] == "retry-7" and record["status"] == "finished"


def test_object_store_transport_gives_the_same_tokens(ray_serve, reference_tokens):
    url = deploy("objstore", {"transport": "object_store", "engine": {"num_blocks": 256}})
    for prompt, expected in zip(PROMPTS[:4], reference_tokens[:4]):
        ids, request_id = greedy_ids(url, prompt)
        assert ids == expected
        handoff = httpx.get(f"{url}/admin/ledger/{request_id}").json()["handoff"]
        assert handoff["transport"] == "object_store" and handoff["fallback"] is None
    serve.delete("objstore")


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_expired_lease_falls_back_to_recompute(ray_serve, reference_tokens, transport):
    url = deploy("expired", {"transport": transport, "lease_timeout_s": 0, "engine": {"num_blocks": 256}})
    for prompt, expected in zip(PROMPTS[:3], reference_tokens[:3]):
        ids, request_id = greedy_ids(url, prompt)
        assert ids == expected
        record = httpx.get(f"{url}/admin/ledger/{request_id}").json()
        assert record["handoff"]["fallback"] == "lease expired or unknown" and record["violations"] == []
    wait_for_idle_pools(url, replicas=2)
    serve.delete("expired")


def test_two_prefill_two_decode_under_32_concurrent_mixed_requests(gloo_url):
    rng = random.Random(7)

    def body(i: int) -> dict:
        params = rng.choice([{}, {"stop": [" the", "a"]}, {"stop_token_ids": [11, 13]}, {"ignore_eos": True},
                             {"min_tokens": 3}, {"logprobs": 2}])
        return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": rng.randint(3, 16), "temperature": 0,
                "stream": i % 2 == 0, "stream_options": {"include_usage": True} if i % 2 == 0 else None, **params}

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, dict]:
        request = {k: v for k, v in body(i).items() if v is not None}
        if not request["stream"]:
            response = await client.post(f"{gloo_url}/v1/completions", json=request)
            assert response.status_code == 200, response.text
            return response.json()["id"], response.json()["usage"]
        usage, request_id = None, None
        async with client.stream("POST", f"{gloo_url}/v1/completions", json=request) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = httpx.Response(200, content=line[6:]).json()
                    request_id = chunk["id"]
                    usage = chunk.get("usage") or usage
        return request_id, usage

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run_all())
    assert len(results) == 32
    for request_id, usage in results:
        record = httpx.get(f"{gloo_url}/admin/ledger/{request_id}").json()
        assert record["status"] == "finished" and record["violations"] == []
        assert record["completion_tokens"] == usage["completion_tokens"]
        assert record["prompt_tokens"] == usage["prompt_tokens"]
    assert httpx.get(f"{gloo_url}/admin/ledger").json()["invariant_violations"] == 0
    stats = wait_for_idle_pools(gloo_url, replicas=4)
    assert sum(1 for name in stats if "/Prefill#" in name) == 2 and sum(1 for n in stats if "/Decode#" in n) == 2


def test_metrics_reach_the_ray_prometheus_endpoint(gloo_url):
    """After the traffic above, every pegaserve_* family is on the node's metrics endpoint."""
    import time

    from tests.serve.helpers import METRICS_PORT

    wanted = {
        "ray_pegaserve_ttft_seconds_bucket", "ray_pegaserve_inter_token_latency_seconds_bucket",
        "ray_pegaserve_e2e_latency_seconds_bucket", "ray_pegaserve_prompt_tokens_total",
        "ray_pegaserve_completion_tokens_total", "ray_pegaserve_requests_finished_total",
        "ray_pegaserve_kv_transfer_bytes_total", "ray_pegaserve_kv_transfer_seconds_bucket",
        "ray_pegaserve_queue_depth", "ray_pegaserve_running_requests", "ray_pegaserve_kv_blocks_used",
        "ray_pegaserve_kv_blocks_total",
    }
    found: set[str] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and found != wanted:
        text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
        found = {name for name in wanted if any(line.startswith(name + "{") for line in text.splitlines())}
        time.sleep(2)
    assert found == wanted
    finished = [line for line in text.splitlines() if line.startswith("ray_pegaserve_requests_finished_total{")]
    assert any('stop_cause="length"' in line and 'deployment="Ingress"' in line for line in finished)
    assert any('transport="gloo"' in line for line in text.splitlines()
               if line.startswith("ray_pegaserve_kv_transfer_bytes_total{"))


def test_api_keys_hold_under_the_apps_route_prefix(ray_serve):
    """Behind Serve the app is mounted at its route_prefix (/keyed): the guard reads the route's
    path, so every route but /health needs a key there, as at /."""
    url = deploy("keyed", {"mode": "colocated", "api_keys": ["key-a"], "engine": {"num_blocks": 128}})
    body = {"prompt": PROMPTS[0], "max_tokens": 2}
    try:
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
        for path in ("/v1/models", "/admin/ledger", "/openapi.json", "/docs"):
            assert httpx.get(f"{url}{path}", timeout=60).status_code == 401, path
        ok = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer key-a"}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    finally:
        serve.delete("keyed")
