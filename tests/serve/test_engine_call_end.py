"""An engine call's end (deployments/orchestration.py `_stream`): a request whose every choice finished
leaves its call to end on its own; a request given up part way (the client left) cancels it."""

import asyncio
import itertools

from pegaserve.deployments.orchestration import ColocatedClient
from pegaserve.messages import EngineRequest, SampledToken, SamplingParams, StepOutput
from pegaserve.stop import Length, StopPolicy

REQUEST = EngineRequest("cmpl-1", (220, 16), SamplingParams(), StopPolicy(2, frozenset(), frozenset()), n=1)


class _Inbox:
    def open(self, choice_ids, queue, tag) -> None:
        pass

    def close(self, choice_ids) -> None:
        pass


def _client() -> ColocatedClient:
    """Only what `_stream` uses: no Ray, no inbox listener, no ledger."""
    client = object.__new__(ColocatedClient)
    client.inbox, client.stream_interval, client._tags = _Inbox(), 1, itertools.count(1)
    return client


async def _call_cancelled(outputs_to_read: int) -> bool:
    calls = []

    def start(choices, tag, resume):
        calls.append(asyncio.get_running_loop().create_future())
        return calls[0]

    queue = asyncio.Queue()
    choice = REQUEST.choice_id(0)
    stream = _client()._stream(REQUEST, {choice: []}, queue, start)
    queue.put_nowait(StepOutput(choice, (SampledToken(5, -0.1),)))
    queue.put_nowait(StepOutput(choice, (SampledToken(6, -0.2),), Length()))
    for _ in range(outputs_to_read):
        await anext(stream)
        await asyncio.sleep(0)  # the call's watcher starts: it awaits the call
    if outputs_to_read == 2:
        assert await anext(stream, None) is None  # every choice finished: the stream ends
    await stream.aclose()
    await asyncio.sleep(0)
    return calls[0].cancelled()  # (asyncio.run cancels what is left once this returns)


def test_a_finished_request_leaves_its_call_to_end_on_its_own():
    assert not asyncio.run(_call_cancelled(outputs_to_read=2))


def test_a_request_given_up_part_way_cancels_its_call():
    assert asyncio.run(_call_cancelled(outputs_to_read=1))
