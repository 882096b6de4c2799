"""The engine loop never dies: a failed or cancelled command, a failed step, a caller that went away
— the loop goes on and later requests succeed. And the loop in its own process gives the same
tokens as on a thread, and says so when it dies."""

import asyncio
import dataclasses
import os
import signal

import pytest

from pegaserve.config import EngineConfig, Role
from pegaserve.engine import commands
from pegaserve.engine.async_engine import AsyncEngine, EngineDead
from pegaserve.engine.build import load_engine
from pegaserve.engine.offline import token_ids
from pegaserve.engine.process import EngineRecipe, ProcessLink
from pegaserve.messages import RequestRejected
from pegaserve.stop import Error, Length
from pegaserve.testing.scripted import scripted_engine
from tests.helpers import PROMPTS, greedy_request


async def collect(engine: AsyncEngine, request) -> list:
    return [o async for o in engine.generate(request)]


def test_a_cancelled_caller_never_kills_the_loop(tiny_model_dir):
    async def main():
        engine = AsyncEngine.in_thread(scripted_engine(tiny_model_dir, {}, EngineConfig(num_blocks=64)))
        # hundreds of calls cancelled while queued, running, or just answered
        for i in range(300):
            task = asyncio.ensure_future(engine.call(commands.GetStats()))
            await asyncio.sleep(0 if i % 3 else 0.0005)
            task.cancel()
        generations = [asyncio.ensure_future(collect(engine, greedy_request(f"c{i}", [1, 2, 3], 50)))
                       for i in range(50)]
        await asyncio.sleep(0.01)
        for task in generations[::2]:
            task.cancel()  # closes the iterators: their requests are aborted
        done = await asyncio.gather(*generations[1::2])
        assert all(token_ids(outs) == [64] * 50 for outs in done)
        assert engine.health().alive and engine.health().num_failed_steps == 0
        stats = await engine.stats()
        assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks
        engine.shutdown()

    asyncio.run(main())


def test_a_prefill_cancelled_while_it_is_admitted_leaves_nothing_parked(tiny_model_dir):
    """The caller gives up while the admission is on its way (the command sent, its answer not in):
    the engine admits and prefills the request anyway, so the prompt's blocks would stay parked
    until the lease expires — unless the abort follows the admission."""

    async def main():
        config = EngineConfig(role=Role.PREFILL, num_blocks=64, lease_timeout_s=600)
        engine = AsyncEngine.in_thread(scripted_engine(tiny_model_dir, {}, config))
        for i in range(20):
            request = dataclasses.replace(greedy_request(f"p{i}", [1, 2, 3, 4, 5], 8), n=1 + i % 2)
            task = asyncio.ensure_future(engine.prefill(request))
            await asyncio.sleep(0)  # the AddRequest is sent; its answer has not come back
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        stats = await engine.stats()
        for _ in range(100):  # the last admissions may still be prefilling
            if stats.num_parked == stats.num_running == stats.num_waiting == 0:
                break
            await asyncio.sleep(0.02)
            stats = await engine.stats()
        assert (stats.num_parked, stats.num_running, stats.num_waiting) == (0, 0, 0)
        assert stats.num_free_blocks == stats.num_blocks
        engine.shutdown()

    asyncio.run(main())


def test_a_failing_command_answers_its_caller_and_the_loop_goes_on(tiny_model_dir):
    async def main():
        engine = AsyncEngine.in_thread(scripted_engine(tiny_model_dir, {}, EngineConfig(num_blocks=16)))
        with pytest.raises(RequestRejected):
            await collect(engine, greedy_request("big", [1] * 10, 5000))  # past the context
        with pytest.raises(KeyError):
            await engine.call(commands.ExportKv("nobody"))
        assert token_ids(await collect(engine, greedy_request("ok", [1, 2], 3))) == [64] * 3
        engine.shutdown()

    asyncio.run(main())


class FailsOnce:
    """A model wrapper whose forward raises once, on the step it is armed for."""

    def __init__(self, model) -> None:
        self.model, self.config, self.armed = model, model.config, False

    def __call__(self, *args):
        if self.armed:
            self.armed = False
            raise RuntimeError("boom")
        return self.model(*args)

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


def test_a_failing_step_fails_its_requests_only(tiny_model_dir):
    async def main():
        inner = scripted_engine(tiny_model_dir, {}, EngineConfig(num_blocks=32))
        wrapper = FailsOnce(inner.runner.model)
        inner.runner.model = wrapper
        engine = AsyncEngine.in_thread(inner)
        # armed once the request runs, which its 480 tokens (of the 512 its blocks hold) keep it doing
        # for far longer than the wait (200 scripted tokens took under 50 ms on a fast host)
        first = asyncio.ensure_future(collect(engine, greedy_request("doomed", [1, 2, 3], 480)))
        await asyncio.sleep(0.01)
        wrapper.armed = True
        outputs = await first
        assert isinstance(outputs[-1].finish, Error)
        assert token_ids(await collect(engine, greedy_request("after", [4, 5], 4))) == [64] * 4
        health = engine.health()
        assert health.alive and health.num_failed_steps == 1
        engine.shutdown()

    asyncio.run(main())


@pytest.fixture(scope="module")
def thread_tokens(tiny_model_dir):
    async def main():
        engine = AsyncEngine.in_thread(load_engine(tiny_model_dir, EngineConfig(num_blocks=128), "sdpa"))
        outs = await asyncio.gather(*(collect(engine, greedy_request(f"r{i}", p, 8)) for i, p in enumerate(PROMPTS)))
        engine.shutdown()
        return [token_ids(o) for o in outs]

    return asyncio.run(main())


def test_the_engine_in_its_own_process_gives_the_same_tokens(tiny_model_dir, thread_tokens):
    async def main():
        recipe = EngineRecipe(str(tiny_model_dir), EngineConfig(num_blocks=128), attention_backend="sdpa")
        engine = AsyncEngine(ProcessLink(recipe))
        outs = await asyncio.gather(*(collect(engine, greedy_request(f"r{i}", p, 8)) for i, p in enumerate(PROMPTS)))
        assert [token_ids(o) for o in outs] == thread_tokens
        assert all(o[-1].finish == Length() for o in outs)
        assert engine.kv_cache.abs().sum() > 0  # the replica sees the engine's KV: shared memory
        await asyncio.sleep(1.2)
        assert engine.health().alive and engine.health().num_steps > 0
        # the process dies: calls in flight fail, health says so
        stream = asyncio.ensure_future(collect(engine, greedy_request("long", [1, 2, 3], 2000)))
        await asyncio.sleep(0.3)
        os.kill(engine.link._process.pid, signal.SIGKILL)  # noqa: SLF001
        outputs = await asyncio.wait_for(stream, 30)
        assert isinstance(outputs[-1].finish, Error)
        assert not engine.health().alive
        with pytest.raises(EngineDead):
            await engine.stats()
        engine.shutdown()

    asyncio.run(main())


def test_one_engine_serves_one_event_loop_after_another(tiny_model_dir):
    engine = AsyncEngine.in_thread(scripted_engine(tiny_model_dir, {}, EngineConfig(num_blocks=16)))
    for i in range(3):  # each asyncio.run closes its loop; the engine delivers to the next one
        outputs = asyncio.run(collect(engine, greedy_request(f"r{i}", [1, 2], 3)))
        assert token_ids(outputs) == [64] * 3
    assert engine.health().alive
    engine.shutdown()


def test_the_engine_process_delivers_to_one_event_loop_after_another(tiny_model_dir):
    """Its messages are read on the event loop: each new loop takes over the reading, and a message
    longer than one read (here ~0.5 MiB of prompt logprobs) arrives whole."""
    recipe = EngineRecipe(str(tiny_model_dir), EngineConfig(num_blocks=512, max_num_batched_tokens=4096),
                      builder="pegaserve.testing.scripted:build_from_recipe", builder_args=({},))
    engine = AsyncEngine(ProcessLink(recipe))
    for i in range(3):  # each asyncio.run closes its loop; the engine delivers to the next one
        outputs = asyncio.run(collect(engine, greedy_request(f"r{i}", [1, 2], 3)))
        assert token_ids(outputs) == [64] * 3
    prompt = [1 + i % 1000 for i in range(4000)]
    scored = dataclasses.replace(greedy_request("long", prompt, 2), num_prompt_logprobs=5)
    outputs = asyncio.run(collect(engine, scored))
    assert token_ids(outputs) == [64] * 2
    assert len(outputs[0].prompt_logprobs) == len(prompt) and outputs[0].prompt_logprobs[0] is None
    assert all(len(score.top_logprobs) == 5 for score in outputs[0].prompt_logprobs[1:])
    assert engine.health().alive
    engine.shutdown()
