"""Background responses (`background: true`): answered `queued` at once, generated on, read back
whole with GET, stopped by cancel — through this frontend, or through another replica sharing the
store (pegaserve/api/responses/background.py)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai

from pegaserve.api.protocol import ResponsesRequest
from pegaserve.api.responses.background import BackgroundResponses
from pegaserve.api.responses.store import ACTIVE, MemoryResponseStore
from pegaserve.api.responses.view import ResponseView

LONG = {"max_output_tokens": 3000, "temperature": 0, "ignore_eos": True}  # seconds of decoding: still running


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def settled(openai_client: openai.OpenAI, response_id: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while (response := openai_client.responses.retrieve(response_id)).status in ACTIVE:
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.05)
    return response


def test_a_background_response_is_queued_then_ends_as_the_foreground_one(real_server):
    openai_client = client(real_server)
    asked = {"model": "qwen3-tiny", "instructions": "Be brief.", "input": "Name a colour.", "max_output_tokens": 6,
             "temperature": 0, "metadata": {"k": "v"}}
    queued = openai_client.responses.create(background=True, **asked)
    assert queued.status == "queued" and queued.background is True and queued.output == [] and queued.usage is None
    done = settled(openai_client, queued.id)
    foreground = openai_client.responses.create(**asked)
    assert done.status == foreground.status == "incomplete" and done.background and not foreground.background
    assert done.output_text == foreground.output_text and done.usage.output_tokens == 6
    assert done.usage.input_tokens == foreground.usage.input_tokens and done.metadata == {"k": "v"}
    assert [i.role for i in openai_client.responses.input_items.list(done.id).data] == ["user"]
    continued = openai_client.responses.create(model="qwen3-tiny", input="More.", previous_response_id=done.id,
                                               max_output_tokens=2, temperature=0)
    assert continued.status == "incomplete"
    record = httpx.get(f"{real_server.base_url}/admin/ledger/{done.id}").json()
    assert record["status"] == "finished" and record["completion_tokens"] == 6 and record["violations"] == []
    assert openai_client.responses.cancel(done.id).status == "incomplete"  # ended: as it is


def test_cancel_stops_the_generation_and_its_engine_request(real_server):
    openai_client = client(real_server)
    running = openai_client.responses.create(model="qwen3-tiny", input="hi", background=True, extra_body=LONG)
    deadline = time.monotonic() + 30
    while httpx.get(f"{real_server.base_url}/admin/ledger/{running.id}").status_code == 404:  # until it begins
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert openai_client.responses.retrieve(running.id).status == "in_progress"
    refused = httpx.post(f"{real_server.base_url}/v1/responses", json={"input": "hi", "previous_response_id": running.id})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
    cancelled = openai_client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.background
    assert openai_client.responses.cancel(running.id).status == "cancelled"  # again: the same
    deadline = time.monotonic() + 30
    while (record := httpx.get(f"{real_server.base_url}/admin/ledger/{running.id}").json())["status"] == "in_flight":
        assert time.monotonic() < deadline, record
        time.sleep(0.05)
    assert record["status"] == "abort" and record["completion_tokens"] < 3000 and record["violations"] == []
    time.sleep(0.3)
    assert openai_client.responses.retrieve(running.id).status == "cancelled"  # the generation's end wrote nothing


def test_a_streamed_background_response_streams_and_replays_from_any_event(real_server):
    openai_client = client(real_server)
    asked = {"model": "qwen3-tiny", "input": "Name a colour.", "max_output_tokens": 6, "temperature": 0}
    events = list(openai_client.responses.create(background=True, stream=True, **asked))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert events[0].response.status == "queued" and events[0].response.background
    assert kinds[-1] == "response.incomplete" and kinds.count("response.created") == 1
    foreground = openai_client.responses.create(**asked)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == foreground.output_text
    done = openai_client.responses.retrieve(events[0].response.id)
    assert done.status == "incomplete" and done.output_text == foreground.output_text and done.usage.output_tokens == 6
    replayed = list(openai_client.responses.retrieve(done.id, stream=True, starting_after=4))
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in events[5:]]
    assert len(list(openai_client.responses.retrieve(done.id, stream=True))) == len(events)


def test_a_streamed_background_response_is_followed_live_and_outlives_its_client(real_server):
    url = f"{real_server.base_url}/v1/responses"
    with httpx.stream("POST", url, json={"input": "hi", "background": True, "stream": True, **LONG}) as first:
        lines = first.iter_lines()
        created = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
    response_id = created["response"]["id"]  # the client left after one event: the generation goes on
    openai_client = client(real_server)
    deadline = time.monotonic() + 30
    while openai_client.responses.retrieve(response_id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    followed = []
    with openai_client.responses.retrieve(response_id, stream=True, starting_after=0) as stream:
        for event in stream:
            followed.append(event)
            if sum(e.type == "response.output_text.delta" for e in followed) == 3:
                break  # live: deltas come while it runs
    assert followed[0].sequence_number == 1 and followed[0].type == "response.queued"
    assert openai_client.responses.cancel(response_id).status == "cancelled"
    rest = list(openai_client.responses.retrieve(response_id, stream=True, starting_after=followed[-1].sequence_number))
    assert rest == [] or rest[0].sequence_number == followed[-1].sequence_number + 1  # the stream ends
    assert all(e.type != "response.completed" for e in rest)


def test_what_cannot_run_in_the_background_or_be_streamed_back_is_a_400_naming_it(real_server):
    url = f"{real_server.base_url}/v1/responses"
    response = httpx.post(url, json={"input": "hi", "background": True, "store": False})
    assert response.status_code == 400 and response.json()["error"]["param"] == "background", response.text
    queued = httpx.post(url, json={"input": "hi", "background": True, "max_output_tokens": 1}).json()
    for query, param in (("stream=true", "stream"), ("starting_after=0", "starting_after"),
                         ("stream=true&starting_after=-1", "starting_after"),
                         ("stream=true&include_obfuscation=true", "include_obfuscation")):
        response = httpx.get(f"{url}/{queued['id']}?{query}")
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (query, response.text)
    assert httpx.get(f"{url}/resp_unknown?stream=true").status_code == 404
    foreground = httpx.post(url, json={"input": "hi", "max_output_tokens": 1}, timeout=60).json()
    response = httpx.post(f"{url}/{foreground['id']}/cancel")
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_id", response.text
    response = httpx.post(f"{url}/resp_unknown/cancel")
    assert response.status_code == 404 and response.json()["error"]["param"] == "response_id", response.text


class _Generation:
    """A frontend whose generations run until cancelled."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def complete(self, job) -> dict:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("never cancelled")


def test_a_cancel_through_another_replica_reaches_the_generation_through_the_shared_store():
    store = MemoryResponseStore()
    view = ResponseView(ResponsesRequest(input="hi", background=True), "resp_x", "qwen3-tiny", store)

    async def run() -> tuple[str, str]:
        ours, theirs = BackgroundResponses(store, poll_s=0.05), BackgroundResponses(store, poll_s=0.05)
        frontend = _Generation()
        await ours.start(frontend, None, view)
        while (await store.get("resp_x"))["response"]["status"] != "in_progress":
            await asyncio.sleep(0.01)
        renewed = (await store.get("resp_x"))["alive_until"]
        await asyncio.sleep(0.2)  # a few looks: each renews it
        assert (await store.get("resp_x"))["alive_until"] > renewed
        cancelled = await theirs.cancel("resp_x", await store.get("resp_x"))  # it runs in `ours`
        await asyncio.wait_for(frontend.cancelled.wait(), timeout=5)
        await asyncio.sleep(0.1)
        return cancelled["status"], (await store.get("resp_x"))["response"]["status"]

    assert asyncio.run(run()) == ("cancelled", "cancelled")


class _Tokens:
    """A frontend whose generations stream one word every 20 ms."""

    async def stream(self, job):
        for word in ("one ", "two ", "three"):
            await asyncio.sleep(0.02)
            yield {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
        yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}


def test_a_streamed_response_is_followed_through_another_replica_from_the_shared_store():
    store = MemoryResponseStore()
    view = ResponseView(ResponsesRequest(input="hi", background=True, stream=True), "resp_s", "qwen3-tiny", None)

    async def run() -> tuple[list, list, list]:
        ours, theirs = BackgroundResponses(store, flush_s=0.01), BackgroundResponses(store, flush_s=0.01)
        await ours.start(_Tokens(), None, view)
        here, there = ours.follow("resp_s"), theirs.follow("resp_s", 1)  # it runs in `ours`
        seen_here = [await anext(here)]
        seen_there = [await anext(there)]  # while it runs: from the store
        assert (await store.get("resp_s"))["response"]["status"] == "in_progress"
        seen_here += [e async for e in here]
        seen_there += [e async for e in there]
        return seen_here, seen_there, (await store.get("resp_s"))["events"]

    here, there, stored = asyncio.run(run())
    assert [e["sequence_number"] for e in here] == list(range(len(here))) and here == stored
    assert there == here[2:] and there[0]["type"] == "response.in_progress"
    assert here[-1]["type"] == "response.completed" and here[-1]["response"]["output"][0]["content"][0]["text"] == \
        "one two three"


def test_a_status_moves_only_from_the_statuses_named():
    store = MemoryResponseStore()

    async def run() -> list:
        await store.put("r", {"response": {"status": "queued"}})
        moved = [await store.replace("r", {"response": {"status": s}}, statuses)
                 for s, statuses in (("in_progress", ("queued",)), ("completed", ("queued",)),
                                     ("cancelled", ACTIVE), ("completed", ACTIVE))]
        return [*moved, (await store.get("r"))["response"]["status"], await store.replace("gone", {}, ACTIVE)]

    assert asyncio.run(run()) == [True, False, True, False, "cancelled", False]


def test_a_response_whose_generation_stopped_looking_reads_as_failed_not_in_progress_for_good():
    store = MemoryResponseStore()
    view = ResponseView(ResponsesRequest(input="hi", background=True), "resp_lost", "qwen3-tiny", store)
    responses = BackgroundResponses(store)

    async def run() -> list:
        running = view.with_status("in_progress")
        await store.put("resp_lost", {**view.stored(running), "alive_until": time.time() - 1})  # its replica died
        await store.put("resp_alive", {**view.stored(running), "alive_until": time.time() + 60})
        lost, alive = await responses.get("resp_lost", None), await responses.get("resp_alive", None)
        return [lost["response"]["status"], lost["response"]["error"]["code"],
                (await store.get("resp_lost"))["response"]["status"], alive["response"]["status"]]

    assert asyncio.run(run()) == ["failed", "server_error", "failed", "in_progress"]

