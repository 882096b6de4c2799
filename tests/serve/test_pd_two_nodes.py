"""Two Ray nodes (ray.cluster_utils.Cluster): prefill pinned to one, decode to the other by custom
resources; with the default `shm` transport the KV crosses nodes over gloo (shared memory is for
replicas of one node) and the answer is still transformers' greedy answer."""

from __future__ import annotations

import httpx
import pytest
import ray
import torch
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors
from transformers import Qwen3ForCausalLM

from tests.helpers import PROMPTS
from tests.serve.helpers import HTTP_PORT, deploy

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"prefill_node": 1}})
    cluster.add_node(num_cpus=4, resources={"decode_node": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
    yield cluster
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


def test_kv_crosses_nodes_over_gloo(two_nodes, tiny_model_dir):
    url = deploy(
        "twonodes", {"transport": "shm", "engine": {"num_blocks": 128}},
        prefill_options={"num_cpus": 0.1, "resources": {"prefill_node": 0.1}},
        decode_options={"num_cpus": 0.1, "resources": {"decode_node": 0.1}},
    )
    hf = Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = PROMPTS[1]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        for _ in range(8):
            ids = torch.cat([ids, hf(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert response["choices"][0]["token_ids"] == ids[0, len(prompt):].tolist()
    record = httpx.get(f"{url}/admin/ledger/{response['id']}").json()
    handoff = record["handoff"]
    assert handoff["transport"] == "gloo" and handoff["fallback"] is None and handoff["kv_bytes"] > 0
    nodes = {node["NodeID"]: node for node in ray.nodes() if node["Alive"]}
    assert len(nodes) == 2
    placement = {a["class_name"]: a["node_id"] for a in list_actors(filters=[("state", "=", "ALIVE")])
                 if "Prefill" in a["class_name"] or "Decode" in a["class_name"]}
    prefill_node = next(n for c, n in placement.items() if "Prefill" in c)
    decode_node = next(n for c, n in placement.items() if "Decode" in c)
    assert prefill_node != decode_node
