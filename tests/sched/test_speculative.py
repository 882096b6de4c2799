"""n-gram speculation: greedy output identical to no speculation, drafts verified in one step,
rejected positions rolled back, and the stop rules applied one token at a time inside an accepted
run (docs/contract.md rule 1: nothing after the first terminal token is kept)."""

import pytest

from pegaserve.config import EngineConfig, Role, SpeculativeConfig
from pegaserve.engine.build import load_engine
from pegaserve.messages import EngineRequest, Handoff, SamplingParams
from pegaserve.sched.speculation import NgramProposer
from pegaserve.stop import Eos, Length, StopPolicy, Token
from pegaserve.testing.scripted import scripted_engine
from tests.helpers import EOS_IDS, PROMPTS, greedy_request, run_to_completion, token_ids

SPEC = SpeculativeConfig(num_draft_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
REPETITIVE = [11, 12, 13, 14, 15] * 8  # its greedy continuation need not repeat, but lookups will hit


def all_outputs(engine, requests):
    for r in requests:
        engine.add_request(r)
    return run_to_completion(engine)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=256), "sdpa")
    return all_outputs(engine, [greedy_request(f"r{i}", p, 24, num_top_logprobs=0) for i, p in enumerate([*PROMPTS, REPETITIVE])])


def test_greedy_with_speculation_equals_greedy_without(tiny_model_dir, plain):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=256, speculative=SPEC), "sdpa")
    spec = all_outputs(engine, [greedy_request(f"r{i}", p, 24, num_top_logprobs=0) for i, p in enumerate([*PROMPTS, REPETITIVE])])
    for rid, outputs in plain.items():
        assert token_ids(spec[rid]) == token_ids(outputs), rid
        for a, b in zip([t for o in spec[rid] for t in o.tokens], [t for o in outputs for t in o.tokens]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert spec[rid][-1].finish == outputs[-1].finish == Length()
    stats = engine.stats()
    assert stats.num_draft_tokens > 0 and stats.num_spec_steps > 0
    engine.pool.check_conservation()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def scripted(tiny_model_dir, script, **config):
    return scripted_engine(tiny_model_dir, script, EngineConfig(num_blocks=64, speculative=SPEC, **config))


LOOP = (21, 22, 23, 24)  # the prompt is this loop; the script continues it, so drafts are all accepted


def spec_request(rid, generated_max, **policy) -> EngineRequest:
    policy = {"eos_token_ids": EOS_IDS, **policy}
    return EngineRequest(rid, LOOP * 3, SamplingParams(temperature=0.0), StopPolicy(generated_max, **policy))


def run_script(tiny_model_dir, generated, request, **config):
    engine = scripted(tiny_model_dir, {LOOP * 3: generated}, **config)
    outputs = all_outputs(engine, [request])[request.request_id]
    engine.pool.check_conservation()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    return outputs, engine.stats()


def test_accepted_runs_carry_several_tokens_per_step(tiny_model_dir):
    outputs, stats = run_script(tiny_model_dir, LOOP * 5, spec_request("r", 16, ignore_eos=True))
    assert token_ids(outputs) == list(LOOP * 4)
    assert max(len(o.tokens) for o in outputs) == 5  # four drafts and the sampled bonus token
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


@pytest.mark.parametrize("where", [0, 2, 4], ids=["start", "middle", "end"])
def test_a_stop_id_inside_an_accepted_run_ends_it_there(tiny_model_dir, where):
    # after the first loop the drafts say 21 22 23 24 21; the script agrees, so the whole run is
    # accepted, but the stop id at `where` ends the request and nothing after it is kept
    generated = LOOP + (*LOOP, 21)[:where] + (99,) + LOOP * 2
    stop = {"stop_token_ids": frozenset({99})}
    outputs, _ = run_script(tiny_model_dir, generated, spec_request("r", 30, ignore_eos=True, **stop))
    assert token_ids(outputs) == list(generated[: 4 + where + 1])
    assert outputs[-1].finish == Token(99) and outputs[-1].tokens[-1].token_id == 99


def test_eos_inside_an_accepted_run(tiny_model_dir):
    generated = (*LOOP, 21, 22, 151645, 23, 24)
    outputs, _ = run_script(tiny_model_dir, generated, spec_request("r", 30))
    assert token_ids(outputs) == [*LOOP, 21, 22, 151645] and outputs[-1].finish == Eos(151645)


def test_max_tokens_inside_an_accepted_run_is_length(tiny_model_dir):
    outputs, _ = run_script(tiny_model_dir, LOOP * 5, spec_request("r", 6, ignore_eos=True))
    assert token_ids(outputs) == list((LOOP * 2)[:6]) and outputs[-1].finish == Length()


def test_a_stop_on_the_last_allowed_token_is_a_stop(tiny_model_dir):
    generated = (*LOOP, 21, 99, 23)
    outputs, _ = run_script(tiny_model_dir, generated, spec_request("r", 6, ignore_eos=True,
                                                                     stop_token_ids=frozenset({99})))
    assert token_ids(outputs) == [*LOOP, 21, 99] and outputs[-1].finish == Token(99)


def test_min_tokens_masking_applies_per_drafted_position(tiny_model_dir):
    # the script wants EOS right away; with min_tokens=6 EOS is masked at positions 1..6 (the
    # runner-up 65 wins), even when a draft proposes it; then EOS ends the request
    generated = (151645,) * 12
    outputs, _ = run_script(tiny_model_dir, generated, spec_request("r", 12, min_tokens=6))
    assert token_ids(outputs) == [65] * 6 + [151645]


def test_bad_words_apply_per_drafted_position(tiny_model_dir):
    # the script continues the loop, so drafts propose 24 after 23: the drafts before a position count
    # as its output, and the bad word (23, 24) gives that position to the runner-up 65
    request = EngineRequest("r", LOOP * 3, SamplingParams(temperature=0.0, bad_words=((23, 24),)),
                            StopPolicy(12, eos_token_ids=EOS_IDS))
    outputs, stats = run_script(tiny_model_dir, LOOP * 3, request)
    assert token_ids(outputs) == [21, 22, 23, 65] * 3 and stats.num_draft_tokens > 0


def test_decode_role_speculates_after_the_first_token(tiny_model_dir):
    script = {LOOP * 3: LOOP * 5}
    prefill = scripted_engine(tiny_model_dir, script, EngineConfig(role=Role.PREFILL, num_blocks=32))
    decode = scripted_engine(tiny_model_dir, script, EngineConfig(role=Role.DECODE, num_blocks=32, speculative=SPEC))
    spec = spec_request("r", 12, ignore_eos=True)
    (first,) = all_outputs(prefill, [spec])["r"]
    kv = prefill.export_kv("r")
    prefill.release("r")
    assert decode.add_handoff(Handoff.single(spec, first.tokens[0], kv))
    rest = run_to_completion(decode)["r"]
    assert token_ids([first, *rest]) == list((LOOP * 3)[:12])
    assert decode.stats().num_accepted_tokens > 0


def test_ngram_proposer_finds_the_latest_earlier_occurrence():
    proposer = NgramProposer(SpeculativeConfig(num_draft_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3))
    tokens = [1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3]
    assert proposer.propose("r", tokens, 3) == (9, 1, 2)  # the 3-gram 1 2 3 last occurred before 9
    assert proposer.propose("r", [*tokens, 9, 1], 3) == (2, 3, 9)  # incremental: the index grows
    assert proposer.propose("x", [5, 6, 7], 3) == ()
    assert proposer.propose("r", tokens, 0) == ()


def test_seeded_sampling_with_speculation_equals_it_without(tiny_model_dir):
    # a draft changes no draw (sampler.py: the scheduler accepts it when the draw is the draft). The
    # script's token wins ~87% of draws at temperature 1, so n-gram drafts of its loop are often
    # accepted, and the other draws make each seed's output its own. The loop's ids come late in
    # the vocabulary, so a draw that weighed the draft first would part from the plain one.
    loop = (150001, 150002, 150003, 150004)
    script = {loop * 3: loop * 10}

    def sampled(seed: int) -> EngineRequest:
        return EngineRequest(f"s{seed}", loop * 3, SamplingParams(temperature=1.0, seed=seed),
                             StopPolicy(24, eos_token_ids=EOS_IDS, ignore_eos=True))

    outputs = {}
    for speculative in (None, SPEC):
        engine = scripted_engine(tiny_model_dir, script, EngineConfig(num_blocks=64, speculative=speculative))
        outputs[speculative] = {rid: token_ids(o) for rid, o in all_outputs(engine, [sampled(s) for s in range(6)]).items()}
    assert outputs[SPEC] == outputs[None]
    assert engine.stats().num_accepted_tokens > 0
    assert any(ids != list(loop * 6) for ids in outputs[None].values())  # not the script alone
