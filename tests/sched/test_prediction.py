"""OpenAI's predicted outputs (`EngineRequest.prediction`, `spec.PredictionProposer`): the prediction
only drafts, and a draft changes no draw (sampler.py), so the output is token for token what it is
without one — greedy and seeded sampling, colocated and prefill → decode — and a right prediction
takes fewer steps; the proposer follows the prediction, finds its place again after the output
departs from it, and proposes nothing when lost."""

from dataclasses import replace

import pytest

from pegaserve.config import EngineConfig, Role
from pegaserve.engine.build import load_engine
from pegaserve.messages import SamplingParams
from pegaserve.sched.speculation import PredictionProposer
from tests.engine.test_engine_roles import prefill_then_decode
from tests.helpers import PROMPTS, greedy_request, token_ids

NEW_TOKENS = 32
PROMPT = PROMPTS[1]


def requests(predictions: dict[str, tuple[int, ...]] | None = None):
    """A greedy and a seeded sampled request of the same prompt, each with its prediction if given."""
    greedy = greedy_request("greedy", PROMPT, NEW_TOKENS, num_top_logprobs=0)
    sampled = replace(greedy, request_id="sampled", sampling=SamplingParams(temperature=1.0, seed=11, num_top_logprobs=0))
    return [replace(r, prediction=(predictions or {}).get(r.request_id, ())) for r in (greedy, sampled)]


def run(engine, batch) -> tuple[dict[str, list[int]], dict[str, int], dict]:
    """Each request's tokens, the step it finished in, and its outputs."""
    for request in batch:
        engine.add_request(request)
    steps, finished, outputs = 0, {}, {}
    while engine.has_work():
        steps += 1
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
            if output.finish is not None:
                finished[output.request_id] = steps
    return {rid: token_ids(outs) for rid, outs in outputs.items()}, finished, outputs


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=128), "sdpa")
    tokens, steps, outputs = run(engine, requests())
    return tokens, steps, outputs


def predictions_of(tokens: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
    return {rid: tuple(ids) for rid, ids in tokens.items()}


def test_a_right_prediction_takes_fewer_steps_and_changes_no_token(tiny_model_dir, plain):
    expected, plain_steps, plain_outputs = plain
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=128), "sdpa")
    tokens, steps, outputs = run(engine, requests(predictions_of(expected)))
    assert tokens == expected  # the seeded sampled request's too
    for rid in expected:  # the logprobs too, token by token
        got = [t.logprob for o in outputs[rid] for t in o.tokens]
        assert got == pytest.approx([t.logprob for o in plain_outputs[rid] for t in o.tokens], abs=1e-3)
    assert engine.scheduler.drafter.stats.num_accepted_tokens >= 2 * ((NEW_TOKENS - 1) - 8)  # nearly every token
    for rid in expected:
        assert steps[rid] * 3 <= plain_steps[rid], (steps, plain_steps)
    engine.pool.check_conservation()


def test_a_wrong_or_partly_right_prediction_changes_no_token(tiny_model_dir, plain):
    expected = plain[0]
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=128), "sdpa")
    wrong = tuple(range(3000, 3000 + NEW_TOKENS))
    assert run(engine, requests({rid: wrong for rid in expected}))[0] == expected
    assert engine.scheduler.drafter.stats.num_accepted_tokens == 0
    # a few tokens replaced in the middle and a stretch left out: the proposer finds its place again
    partly = {rid: (*ids[:10], 5, 6, 7, *ids[10:16], *ids[20:]) for rid, ids in expected.items()}
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=128), "sdpa")
    assert run(engine, requests(partly))[0] == expected
    assert engine.scheduler.drafter.stats.num_accepted_tokens > NEW_TOKENS


def test_decode_drafts_from_the_prediction_after_a_handoff(tiny_model_dir, plain):
    expected = plain[0]
    prefill = load_engine(tiny_model_dir, EngineConfig(role=Role.PREFILL, num_blocks=128), "sdpa")
    decode = load_engine(tiny_model_dir, EngineConfig(role=Role.DECODE, num_blocks=128), "sdpa")
    tokens, _, _ = prefill_then_decode(prefill, decode, requests(predictions_of(expected)))
    assert tokens == expected
    assert decode.scheduler.drafter.stats.num_accepted_tokens > NEW_TOKENS


def test_the_proposer_follows_loses_and_finds_its_place():
    proposer = PredictionProposer(max_drafts=3)
    prediction = (1, 2, 3, 4, 5, 6, 7, 8, 9)
    assert proposer.propose("r", prediction, (1,), 10) == (2, 3, 4)
    assert proposer.propose("r", prediction, (1, 2, 3), 10) == (4, 5, 6)
    assert proposer.propose("r", prediction, (1, 2, 3, 40), 10) == ()  # departed, no n-gram found: lost
    assert proposer.propose("r", prediction, (1, 2, 3, 40, 6, 7), 1) == (8,)  # "6 7" found again
    assert proposer.propose("r", prediction, (1, 2, 3, 40, 6, 7, 8, 9), 10) == ()  # the prediction's end
    proposer.forget("r")
    assert proposer.propose("r", prediction, (7,), 0) == ()  # no room
    assert proposer.propose("other", (5, 5, 1, 5, 5, 2), (9, 5, 5), 2) == (1, 5)  # the first occurrence
