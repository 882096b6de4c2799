"""Roles (prefill-only → decode-only equals colocated), preemption and block conservation."""

from dataclasses import replace

import pytest
import torch

from pegaserve.config import EngineConfig, Role
from pegaserve.engine.build import load_engine
from pegaserve.messages import Handoff, SamplingParams
from pegaserve.stop import Eos, Length
from pegaserve.testing.scripted import scripted_engine
from tests.helpers import EOS_IDS, PROMPTS, greedy_request, run_to_completion, token_ids

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def colocated_tokens(tiny_model_dir):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=256), attention_backend="sdpa")
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(greedy_request(f"r{i}", prompt, NEW_TOKENS))
    outputs = run_to_completion(engine)
    return {rid: token_ids(outs) for rid, outs in outputs.items()}


def prefill_then_decode(prefill, decode, requests, move_kv=True, hand_over=None):
    """Prefill every request, hand each non-terminal one over to decode in process — its packed KV
    (or none: `move_kv=False`) through `add_handoff`, or `hand_over(request, first output)` — then
    decode to the end; returns the tokens, the first outputs and what each handover returned."""
    for request in requests:
        prefill.add_request(request)
    first = run_to_completion(prefill)
    if hand_over is None:
        def hand_over(request, out):
            kv = prefill.export_kv(request.request_id) if move_kv else None
            return decode.add_handoff(Handoff.single(request, out.tokens[0], kv))
    handed = {}
    for request in requests:
        (out,) = first[request.request_id]
        if out.finish is not None:
            continue  # terminal first token: nothing exported (rule 21)
        handed[request.request_id] = hand_over(request, out)
        assert prefill.release(request.request_id)
    rest = run_to_completion(decode)
    return {rid: token_ids(first[rid] + rest.get(rid, [])) for rid in first}, first, handed


def test_prefill_then_decode_equals_colocated(tiny_model_dir, colocated_tokens):
    prefill = load_engine(tiny_model_dir, EngineConfig(role=Role.PREFILL, num_blocks=256), attention_backend="sdpa")
    decode = load_engine(tiny_model_dir, EngineConfig(role=Role.DECODE, num_blocks=256), attention_backend="sdpa")
    requests = [greedy_request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    tokens, _, imported = prefill_then_decode(prefill, decode, requests)
    assert tokens == colocated_tokens
    assert all(imported.values())
    for engine in (prefill, decode):
        engine.pool.check_conservation()
        assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_decode_without_kv_recomputes_the_prompt(tiny_model_dir, colocated_tokens):
    prefill = load_engine(tiny_model_dir, EngineConfig(role=Role.PREFILL, num_blocks=256), attention_backend="sdpa")
    decode = load_engine(tiny_model_dir, EngineConfig(role=Role.DECODE, num_blocks=256), attention_backend="sdpa")
    requests = [greedy_request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    tokens, _, imported = prefill_then_decode(prefill, decode, requests, move_kv=False)
    assert tokens == colocated_tokens
    assert not any(imported.values())


def test_terminal_first_token_exports_nothing(tiny_model_dir):
    script = {(7, 8, 9): [151645, 5]}
    prefill = scripted_engine(tiny_model_dir, script, EngineConfig(role=Role.PREFILL, num_blocks=32))
    decode = scripted_engine(tiny_model_dir, script, EngineConfig(role=Role.DECODE, num_blocks=32))
    requests = [
        greedy_request("eos", [7, 8, 9], 8, ignore_eos=False),
        greedy_request("len1", [1, 2], 1),
        greedy_request("go", [7, 8, 9], 3, ignore_eos=True),
    ]
    tokens, first, _ = prefill_then_decode(prefill, decode, requests)
    assert first["eos"][0].finish == Eos(151645) and tokens["eos"] == [151645]
    assert first["len1"][0].finish == Length() and tokens["len1"] == [64]
    assert not prefill.parked and prefill.pool.num_free_blocks == prefill.pool.num_blocks
    assert tokens["go"] == [151645, 5, 64]  # decode continued after the first token, from moved KV


def test_preemption_under_a_tiny_block_budget_gives_identical_tokens(tiny_model_dir, colocated_tokens):
    # 8 requests need ~30 blocks at their longest; 12 blocks of 16 force recompute preemptions.
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=12, block_size=16), attention_backend="sdpa")
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(greedy_request(f"r{i}", prompt, NEW_TOKENS))
    outputs = run_to_completion(engine)
    assert {rid: token_ids(o) for rid, o in outputs.items()} == colocated_tokens
    assert engine.scheduler.num_preemptions > 0
    engine.pool.check_conservation()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_abort_returns_blocks_wherever_the_request_is(tiny_model_dir):
    engine = scripted_engine(tiny_model_dir, {}, EngineConfig(num_blocks=16, max_num_seqs=2))
    for i in range(4):
        engine.add_request(greedy_request(f"r{i}", [1, 2, 3], 20))
    engine.step()  # r0, r1 running; r2, r3 waiting
    assert engine.abort("r0") and engine.abort("r3")
    assert not engine.abort("r0")
    run_to_completion(engine)
    engine.pool.check_conservation()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    prefill = scripted_engine(tiny_model_dir, {}, EngineConfig(role=Role.PREFILL, num_blocks=16))
    prefill.add_request(greedy_request("p", [1, 2, 3], 5))
    (out,) = prefill.step()
    assert out.finish is None and prefill.parked_block_ids("p")
    assert prefill.abort("p") and prefill.pool.num_free_blocks == 16


def test_eos_ids_stop_when_not_ignored(tiny_model_dir):
    engine = scripted_engine(tiny_model_dir, {(4,): [10, 151643, 11]}, EngineConfig(num_blocks=16))
    engine.add_request(greedy_request("r", [4], 10, ignore_eos=False, eos_token_ids=EOS_IDS))
    (outputs,) = run_to_completion(engine).values()
    assert token_ids(outputs) == [10, 151643] and outputs[-1].finish == Eos(151643)


def test_a_parked_prompt_names_its_blocks_and_their_generations_until_they_are_handed_out_anew(tiny_model_dir):
    """What a KV handoff checks its reads against, without asking the engine loop: the blocks stay
    the prompt's while parked, not once released and given to another request."""
    import time

    prefill = scripted_engine(tiny_model_dir, {}, EngineConfig(role=Role.PREFILL, num_blocks=4, block_size=4,
                                                               lease_timeout_s=60.0))
    prefill.add_request(greedy_request("p", list(range(1, 10)), 5))
    (out,) = prefill.step()
    parked = out.parked
    assert parked is not None and parked.block_ids == prefill.parked_block_ids("p") and len(parked.block_ids) == 3
    assert parked.held_until > time.monotonic() + 50
    now = time.monotonic()
    assert parked.intact(parked.block_ids, prefill.pool.generations, now)
    assert not parked.intact(parked.block_ids, prefill.pool.generations, parked.held_until)  # the lease ran out
    assert prefill.release("p")
    assert parked.intact(parked.block_ids, prefill.pool.generations, now)  # freed, not yet reused: still the prompt's
    prefill.add_request(greedy_request("q", list(range(20, 31)), 5))  # the free block, then p's last two
    prefill.step()
    assert not parked.intact(parked.block_ids, prefill.pool.generations, now)
    assert not parked.intact(parked.block_ids[-1:], prefill.pool.generations, now)
    assert parked.intact(parked.block_ids[:1], prefill.pool.generations, now)  # decode had the rest cached


def shared_handoffs(prefill, decode, requests, source=None, generations=None):
    """Decode copies each prompt's KV out of prefill's cache itself (`add_shared_handoff`, by
    default from prefill's own cache and generations); returns the tokens and the receipts."""
    def hand_over(request, out):
        return decode.add_shared_handoff(
            Handoff.single(request, out.tokens[0]), prefill.runner.kv_cache if source is None else source,
            prefill.pool.generations if generations is None else generations, out.parked)

    tokens, _, receipts = prefill_then_decode(prefill, decode, requests, hand_over=hand_over)
    return tokens, receipts


def roles(tiny_model_dir):
    return [load_engine(tiny_model_dir, EngineConfig(role=role, num_blocks=256), attention_backend="sdpa")
            for role in (Role.PREFILL, Role.DECODE)]


def test_decode_copies_a_prompt_out_of_prefill_s_cache_as_it_admits_it(tiny_model_dir, colocated_tokens):
    prefill, decode = roles(tiny_model_dir)
    requests = [greedy_request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    tokens, receipts = shared_handoffs(prefill, decode, requests)
    assert tokens == colocated_tokens
    assert receipts and all(r.held and r.num_blocks > 0 for r in receipts.values())
    for engine in (prefill, decode):
        engine.pool.check_conservation()
        assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("fault", ["blocks handed out anew", "cache not mapped", "blocks the cache lacks"])
def test_a_shared_prompt_that_did_not_hold_is_recomputed(tiny_model_dir, colocated_tokens, fault):
    prefill, decode = roles(tiny_model_dir)
    requests = [greedy_request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    if fault == "cache not mapped":
        tokens, receipts = shared_handoffs(prefill, decode, requests, source=torch.zeros(0))
    elif fault == "blocks the cache lacks":
        empty = prefill.runner.kv_cache[:, :, :0].contiguous()  # the same layout, no blocks: copies fail
        tokens, receipts = shared_handoffs(prefill, decode, requests, source=empty)
    else:
        tokens, receipts = shared_handoffs(prefill, decode, requests, generations=[-1] * 256)
    assert tokens == colocated_tokens  # the same tokens, from a recomputed prompt
    assert receipts and not any(r.held for r in receipts.values())
    decode.pool.check_conservation()
    assert decode.pool.num_free_blocks == decode.pool.num_blocks


def test_the_engine_loop_maps_prefill_s_cache_file_once_and_copies_from_it(tiny_model_dir, colocated_tokens,
                                                                          tmp_path):
    from pegaserve.engine.commands import AddSharedHandoff, SharedKv
    from pegaserve.engine.loop import EngineLoop
    from pegaserve.engine.process import map_kv_file

    prefill, decode = roles(tiny_model_dir)
    shape = tuple(prefill.runner.kv_cache.shape)
    path = str(tmp_path / "prefill-kv")
    mapped, generations = map_kv_file(path, shape, prefill.kv_dtype, create=True)
    prefill.runner.kv_cache = mapped  # prefill's engine process keeps its cache in such a file
    prefill.pool.use_generations(generations)
    requests = [greedy_request(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    for request in requests:
        prefill.add_request(request)
    first = run_to_completion(prefill)
    loop = EngineLoop(decode)
    receipts = []
    for request in requests:
        (out,) = first[request.request_id]
        if out.finish is None:
            handoff = Handoff.single(request, out.tokens[0])
            receipts.append(loop.execute(AddSharedHandoff(handoff, SharedKv(path, shape, out.parked))))
    gone = greedy_request("gone", PROMPTS[1], NEW_TOKENS)
    prefill.add_request(gone)
    (out,) = run_to_completion(prefill)["gone"]
    receipts_gone = loop.execute(AddSharedHandoff(Handoff.single(gone, out.tokens[0]),
                                                  SharedKv(str(tmp_path / "no-such-file"), shape, out.parked)))
    rest = run_to_completion(decode)
    assert all(r.held for r in receipts) and not receipts_gone.held  # an unmappable cache: recomputed
    assert {rid: token_ids(first[rid] + rest.get(rid, [])) for rid in first} == colocated_tokens
    assert token_ids([out] + rest["gone"]) == colocated_tokens["r1"]
    assert len(loop._sources) == 1  # mapped once for all the handoffs from it


def test_a_salted_prompt_finds_no_other_salt_s_blocks_in_either_role(tiny_model_dir, colocated_tokens):
    prefill, decode = roles(tiny_model_dir)

    def new_hits(salt) -> list[int]:
        before = [engine.stats().prefix_cache_hit_tokens for engine in (prefill, decode)]
        requests = [replace(greedy_request(f"r{i}", p, NEW_TOKENS), cache_salt=salt) for i, p in enumerate(PROMPTS)]
        tokens, _, imported = prefill_then_decode(prefill, decode, requests)
        assert tokens == colocated_tokens and all(imported.values())
        return [engine.stats().prefix_cache_hit_tokens - hit for engine, hit in zip((prefill, decode), before)]

    assert new_hits(None) == [0, 0]
    assert new_hits("tenant-a") == [0, 0]
    prefill_hits, _ = new_hits("tenant-a")
    assert prefill_hits == sum(((len(p) - 1) // 16) * 16 for p in PROMPTS)
    for engine in (prefill, decode):
        engine.pool.check_conservation()


def test_allowed_token_ids_hold_on_both_sides_of_the_handoff(tiny_model_dir):
    allowed = frozenset(range(1000, 1010))

    def requests():
        return [replace(greedy_request(f"r{i}", p, NEW_TOKENS), sampling=SamplingParams(seed=i, allowed_token_ids=allowed))
                for i, p in enumerate(PROMPTS)]  # fmt: skip

    colocated = load_engine(tiny_model_dir, EngineConfig(num_blocks=256), attention_backend="sdpa")
    for request in requests():
        colocated.add_request(request)
    expected = {rid: token_ids(outputs) for rid, outputs in run_to_completion(colocated).items()}
    tokens, _, _ = prefill_then_decode(*roles(tiny_model_dir), requests())
    assert tokens == expected
    assert all(set(t) <= allowed and len(t) == NEW_TOKENS for t in tokens.values())


def test_bad_words_read_the_tokens_prefill_gave_once_decode_has_them(tiny_model_dir, colocated_tokens):
    # each prompt's first two greedy tokens, as a word: the second may not follow the first, which prefill chose
    requests = [replace(greedy_request(f"r{i}", p, NEW_TOKENS),
                        sampling=SamplingParams(temperature=0.0, bad_words=(tuple(colocated_tokens[f"r{i}"][:2]),)))
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    tokens, _, _ = prefill_then_decode(*roles(tiny_model_dir), requests)
    for rid, plain in colocated_tokens.items():
        assert tokens[rid][0] == plain[0] and tokens[rid][1] != plain[1]
        assert all(tokens[rid][k:k + 2] != plain[:2] for k in range(NEW_TOKENS - 1))
