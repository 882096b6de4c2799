"""n > 1: one prefill for all choices, blocks shared (copy-on-write for the partial one), each
choice sampling as a lone request with seed + index would; prompt scoring; max_tokens=0."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

from pegaserve.config import EngineConfig, Role
from pegaserve.engine.build import load_engine
from pegaserve.messages import EngineRequest, Handoff, SamplingParams
from pegaserve.stop import Length, StopPolicy
from pegaserve.testing.scripted import scripted_engine
from tests.helpers import EOS_IDS, PROMPTS, run_to_completion, token_ids

NEW_TOKENS = 10


def request(request_id, prompt, n=1, max_tokens=NEW_TOKENS, prompt_logprobs=None, **sampling) -> EngineRequest:
    return EngineRequest(request_id, tuple(prompt), SamplingParams(**sampling),
                         StopPolicy(max_tokens, eos_token_ids=EOS_IDS, ignore_eos=True), n=n,
                         num_prompt_logprobs=prompt_logprobs)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return load_engine(tiny_model_dir, EngineConfig(num_blocks=256), "sdpa")


def run(engine, *requests) -> dict[str, list]:
    for r in requests:
        engine.add_request(r)
    return run_to_completion(engine)


def test_each_choice_equals_a_lone_request_with_seed_plus_index(engine):
    prompt = PROMPTS[3]  # 37 tokens: a partial last block the choices share, then copy
    grouped = run(engine, request("g", prompt, n=4, seed=11))
    assert sorted(grouped) == ["g/0", "g/1", "g/2", "g/3"]
    for i in range(4):
        alone = run(engine, request(f"alone{i}", prompt, seed=11 + i))[f"alone{i}"]
        assert token_ids(grouped[f"g/{i}"]) == token_ids(alone)
    assert len({tuple(token_ids(o)) for o in grouped.values()}) == 4  # distinct choices
    engine.pool.check_conservation()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_greedy_choices_are_identical_and_the_prompt_is_computed_once(tiny_model_dir):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=64, enable_prefix_caching=False), "sdpa")
    prompt = PROMPTS[7]  # 100 tokens
    engine.add_request(request("g", prompt, n=3, temperature=0.0))
    output = engine.scheduler.schedule()
    assert [r.request_id for r in output.requests] == ["g/0"]  # one prefill, not three
    assert len(output.requests[0].samples) == 3  # three first tokens from its last position
    engine.scheduler.update(output, engine.runner.run(output))
    assert len(engine.kv.block_ids("g/1")) == 7 and engine.kv.block_ids("g/1") == engine.kv.block_ids("g/0")
    outputs = run_to_completion(engine)
    lone = load_engine(tiny_model_dir, EngineConfig(num_blocks=64), "sdpa")
    expected = token_ids(run(lone, request("one", prompt, temperature=0.0))["one"])
    assert all(token_ids(outputs[f"g/{i}"])[:] == expected[1:] for i in range(3))
    engine.pool.check_conservation()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_aborting_one_choice_leaves_the_others(engine):
    engine.add_request(request("a", PROMPTS[1], n=3, seed=3, max_tokens=20))
    engine.step()  # prefill: every choice has its first token
    assert engine.abort("a/1")
    outputs = run_to_completion(engine)
    assert "a/1" not in outputs and all(len(token_ids(outputs[f"a/{i}"])) == 19 for i in (0, 2))
    assert not engine.abort("a")  # nothing left
    engine.pool.check_conservation()


def test_aborting_the_lead_before_its_prefill_keeps_the_others(tiny_model_dir):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=64, max_num_batched_tokens=16), "sdpa")
    engine.add_request(request("a", PROMPTS[7], n=3, seed=5))
    engine.step()  # the first chunk of a 100-token prompt
    assert engine.abort("a/0")
    outputs = run_to_completion(engine)
    assert sorted(outputs) == ["a/1", "a/2"] and all(len(token_ids(o)) == NEW_TOKENS for o in outputs.values())
    engine.pool.check_conservation()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_prefill_role_parks_the_choices_and_decode_continues_them_from_one_kv(tiny_model_dir, engine):
    prefill = load_engine(tiny_model_dir, EngineConfig(role=Role.PREFILL, num_blocks=64), "sdpa")
    decode = load_engine(tiny_model_dir, EngineConfig(role=Role.DECODE, num_blocks=64), "sdpa")
    spec = request("pd", PROMPTS[3], n=3, seed=21)
    first = run(prefill, spec)
    assert sorted(prefill.parked) == ["pd/0", "pd/1", "pd/2"]
    kv = prefill.export_kv("pd")  # the prompt's blocks once, not once per choice
    assert kv.shape[2] == 3  # 37 tokens in blocks of 16
    assert prefill.release("pd") and not prefill.parked
    handoff = Handoff(spec, tuple((i, first[f"pd/{i}"][0].tokens) for i in range(3)), kv)
    assert decode.add_handoff(handoff)
    rest = run_to_completion(decode)
    colocated = run(engine, request("co", PROMPTS[3], n=3, seed=21))
    for i in range(3):
        assert token_ids(first[f"pd/{i}"] + rest[f"pd/{i}"]) == token_ids(colocated[f"co/{i}"])
    for e in (prefill, decode):
        e.pool.check_conservation()
        assert e.pool.num_free_blocks == e.pool.num_blocks


# --- prompt scoring -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_logprobs(tiny_model_dir):
    hf = Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([PROMPTS[7]])).logits[0].double()
    return torch.log_softmax(logits, -1)  # [100, vocab]: row p predicts prompt token p + 1


@pytest.mark.parametrize("budget", [8192, 24], ids=["one-step", "chunked"])
def test_prompt_logprobs_are_the_reference_log_softmax(tiny_model_dir, reference_logprobs, budget):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=64, max_num_batched_tokens=budget), "sdpa")
    prompt = PROMPTS[7]  # 100 tokens: more rows than one LM-head chunk
    outputs = run(engine, request("p", prompt, prompt_logprobs=2, max_tokens=1, temperature=0.0))["p"]
    scores = outputs[0].prompt_logprobs
    assert len(scores) == len(prompt) and scores[0] is None
    for p in range(1, len(prompt)):
        row = reference_logprobs[p - 1]
        score = scores[p]
        assert score.token_id == prompt[p]
        assert score.logprob == pytest.approx(row[prompt[p]].item(), abs=1e-4, rel=1e-5)  # fp32 rounding
        target = row[prompt[p]]  # rank counts strictly better tokens; near-ties may go either way in fp32
        assert 1 + int((row > target + 1e-4).sum()) <= score.rank <= 1 + int((row > target - 1e-4).sum())
        assert [t for t, _ in score.top_logprobs] == torch.topk(row, 2).indices.tolist()


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny_model_dir):
    script = {(5, 6, 7): (8, 9)}
    engine = scripted_engine(tiny_model_dir, script, EngineConfig(num_blocks=16))
    spec = EngineRequest("z", (5, 6, 7), SamplingParams(temperature=0.0), StopPolicy(0, eos_token_ids=EOS_IDS),
                         num_prompt_logprobs=0)
    (output,) = run(engine, spec)["z"]
    assert output.tokens == () and output.finish == Length()
    assert [s.token_id if s else None for s in output.prompt_logprobs] == [None, 6, 7]
    engine.pool.check_conservation()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
