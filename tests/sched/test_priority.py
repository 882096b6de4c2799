"""The priority scheduling policy (vLLM's `--scheduling-policy priority`): waiting requests start by
priority (lower first), then arrival; running requests of a lower priority make room for a higher
one, and are the first preempted when blocks run out; every preempted request's tokens stay exactly
its solo run's. First come, first served stays the default, unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pegaserve.config import EngineConfig
from pegaserve.engine.build import load_engine
from pegaserve.request import RequestState
from pegaserve.sched.ranked_queue import RankedQueue
from pegaserve.testing.scripted import scripted_engine
from tests.helpers import greedy_request, run_to_completion, token_ids

PRIORITY = EngineConfig(scheduling_policy="priority")


def ranked(request_id: str, priority: int, arrival_s: float, prompt=(1, 2, 3), max_tokens: int = 2):
    return replace(greedy_request(request_id, list(prompt), max_tokens), priority=priority, arrival_s=arrival_s)


def first_outputs_order(engine) -> list[str]:
    order = []
    while engine.has_work():
        for output in engine.step():
            if output.request_id not in order:
                order.append(output.request_id)
    return order


def test_waiting_requests_start_by_priority_then_arrival(tiny_model_dir):
    engine = scripted_engine(tiny_model_dir, {}, replace(PRIORITY, max_num_seqs=1))
    for request in (ranked("a", 2, 1.0), ranked("b", 0, 2.0), ranked("c", 1, 3.0), ranked("d", 0, 4.0),
                    ranked("e", -1, 5.0)):
        engine.add_request(request)
    assert first_outputs_order(engine) == ["e", "b", "d", "c", "a"]
    assert engine.scheduler.num_preemptions == 0  # equal or lower priorities wait their turn


def test_first_come_first_served_is_arrival_order_whatever_the_priority(tiny_model_dir):
    engine = scripted_engine(tiny_model_dir, {}, EngineConfig(max_num_seqs=1))
    for request in (ranked("a", 3, 1.0), ranked("b", 0, 2.0), ranked("c", 1, 3.0)):
        engine.add_request(request)
    assert first_outputs_order(engine) == ["a", "b", "c"]


def test_a_preempted_request_goes_before_the_others_of_its_rank():
    queue = RankedQueue()
    spec = [ranked(name, p, t) for name, p, t in (("x", 1, 1.0), ("y", 1, 1.0), ("z", 0, 9.0))]
    states = [RequestState(s, 0) for s in spec]
    for state in states:
        queue.append(state)
    late = RequestState(ranked("w", 1, 1.0), 0)
    queue.appendleft(late)
    assert [s.request_id for s in queue] == ["z", "w", "x", "y"]
    queue.remove(states[0])
    assert queue.popleft().request_id == "z" and len(queue) == 2 and late in queue


@pytest.fixture(scope="module")
def solo(tiny_model_dir):
    """Each test prompt's 40 greedy tokens, run alone."""
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=64), attention_backend="sdpa")
    out = {}
    for name, prompt in PROMPTS.items():
        engine.add_request(greedy_request(name, prompt, 40))
        out[name] = token_ids(run_to_completion(engine)[name])
    return out


PROMPTS = {"low": list(range(3000, 3040)), "high": list(range(7000, 7040))}


def run_recording(engine, outputs: dict, finished: list, num_steps: int | None = None) -> None:
    """Step `num_steps` times, or until idle, appending each request's outputs and the order they
    finish in."""
    for _ in range(10_000 if num_steps is None else num_steps):
        if not engine.has_work():
            return
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
            if output.finish is not None:
                finished.append(output.request_id)
    assert num_steps is not None, "the engine did not go idle"


def test_a_higher_priority_request_takes_the_only_slot_and_both_stay_exact(tiny_model_dir, solo):
    engine = load_engine(tiny_model_dir, replace(PRIORITY, num_blocks=64, max_num_seqs=1), attention_backend="sdpa")
    engine.add_request(replace(greedy_request("low", PROMPTS["low"], 40), priority=5))
    outputs, finished = {}, []
    run_recording(engine, outputs, finished, num_steps=5)
    engine.add_request(replace(greedy_request("high", PROMPTS["high"], 40), priority=0))
    run_recording(engine, outputs, finished)
    assert finished == ["high", "low"] and engine.scheduler.num_preemptions == 1
    assert {name: token_ids(outs) for name, outs in outputs.items()} == solo
    engine.pool.check_conservation()


@pytest.mark.parametrize("policy, first_done", [("priority", "high"), ("fcfs", "low")])
def test_blocks_running_out_preempt_the_lowest_priority_not_the_newest(tiny_model_dir, solo, policy, first_done):
    # each needs 6 blocks of 16 at its longest (80 tokens); 8 hold both only until 64 tokens each
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=8, block_size=16, scheduling_policy=policy),
                         attention_backend="sdpa")
    engine.add_request(replace(greedy_request("low", PROMPTS["low"], 40), priority=1 if policy == "priority" else 0))
    outputs, finished = {}, []
    run_recording(engine, outputs, finished, num_steps=1)
    engine.add_request(greedy_request("high", PROMPTS["high"], 40))
    run_recording(engine, outputs, finished)
    assert engine.scheduler.num_preemptions == 1 and finished[0] == first_done  # one victim, the right one
    assert {name: token_ids(outs) for name, outs in outputs.items()} == solo
    engine.pool.check_conservation()
