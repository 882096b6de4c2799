"""Chunked prefill, mixed prefill+decode steps, and automatic prefix caching give exactly the
tokens of the plain engine, with every block accounted for."""

from dataclasses import replace

import pytest

from pegaserve.config import EngineConfig
from pegaserve.engine.build import load_engine
from pegaserve.kv.block_pool import BlockPool, hash_blocks, salt_root
from tests.helpers import PROMPTS, greedy_request, run_to_completion, token_ids

NEW_TOKENS = 12


def tokens_of(engine, prompts, tag="r", max_tokens=NEW_TOKENS) -> dict[int, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(greedy_request(f"{tag}{i}", prompt, max_tokens))
    outputs = run_to_completion(engine)
    return {i: token_ids(outputs[f"{tag}{i}"]) for i in range(len(prompts))}


def idle_and_conserved(engine) -> None:
    engine.pool.check_conservation()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert not engine.requests and not engine.parked


@pytest.fixture(scope="module")
def plain_tokens(tiny_model_dir):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=256, enable_prefix_caching=False), "sdpa")
    return tokens_of(engine, PROMPTS)


def test_chunked_prefill_mixed_with_decodes_gives_the_same_tokens(tiny_model_dir, plain_tokens):
    # a 16-token budget: the 37- and 100-token prompts take several steps, beside running decodes
    config = EngineConfig(num_blocks=256, max_num_batched_tokens=16, enable_prefix_caching=False)
    engine = load_engine(tiny_model_dir, config, "sdpa")
    assert tokens_of(engine, PROMPTS) == plain_tokens
    idle_and_conserved(engine)


def test_a_budget_below_the_context_length_is_allowed(tiny_model_dir):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=64, max_num_batched_tokens=8), "sdpa")
    assert engine.max_model_len > engine.config.max_num_batched_tokens
    engine.add_request(greedy_request("long", list(range(1000, 1200)), 4))
    (outputs,) = run_to_completion(engine).values()
    assert len(token_ids(outputs)) == 4


def test_prefix_cache_hits_give_the_same_tokens(tiny_model_dir, plain_tokens):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=256), "sdpa")
    first = tokens_of(engine, PROMPTS, "a")
    assert engine.stats().prefix_cache_hit_tokens == 0
    cached = engine.stats().num_cached_blocks
    assert cached > 0  # finished requests leave their full blocks named, and free
    idle_and_conserved(engine)
    again = tokens_of(engine, PROMPTS, "b")
    assert first == again == plain_tokens
    stats = engine.stats()
    # every prompt's full blocks except the one holding its last token were hits
    expected = sum(((len(p) - 1) // 16) * 16 for p in PROMPTS)
    assert stats.prefix_cache_hit_tokens == expected > 0
    idle_and_conserved(engine)


def test_a_request_that_ends_at_its_first_token_leaves_its_prompt_blocks_cached(tiny_model_dir, plain_tokens):
    """max_tokens 1 (a beam search step, a classifier's one token, a first-token stop): the prompt's
    full blocks are named before its blocks are freed, and the next request on that prompt finds them."""
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=256), "sdpa")
    assert tokens_of(engine, PROMPTS, "one", max_tokens=1) == {i: t[:1] for i, t in plain_tokens.items()}
    idle_and_conserved(engine)
    assert tokens_of(engine, PROMPTS, "b") == plain_tokens
    assert engine.stats().prefix_cache_hit_tokens == sum(((len(p) - 1) // 16) * 16 for p in PROMPTS) > 0
    idle_and_conserved(engine)


def test_a_shared_prefix_is_computed_once(tiny_model_dir):
    system = list(range(3000, 3064))  # 4 full blocks of a shared "system prompt"
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=128), "sdpa")
    reference = load_engine(tiny_model_dir, EngineConfig(num_blocks=128, enable_prefix_caching=False), "sdpa")
    prompts = [system + [5000 + i, 5001 + i] for i in range(4)]
    tokens_of(engine, prompts[:1], "warm")
    assert tokens_of(engine, prompts, "s") == tokens_of(reference, prompts, "s")
    assert engine.stats().prefix_cache_hit_tokens == 4 * 64
    idle_and_conserved(engine)


def test_a_cache_salt_shares_cached_blocks_only_with_its_own_salt(tiny_model_dir, plain_tokens):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=256), "sdpa")

    def new_hits(tag, salt) -> int:
        before = engine.stats().prefix_cache_hit_tokens
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(replace(greedy_request(f"{tag}{i}", prompt, NEW_TOKENS), cache_salt=salt))
        outputs = run_to_completion(engine)
        assert {i: token_ids(outputs[f"{tag}{i}"]) for i in range(len(PROMPTS))} == plain_tokens
        return engine.stats().prefix_cache_hit_tokens - before

    every_full_block = sum(((len(p) - 1) // 16) * 16 for p in PROMPTS)
    assert new_hits("a", "tenant-a") == 0
    assert new_hits("b", "tenant-b") == 0  # another salt finds none of a's blocks
    assert new_hits("u", None) == 0  # nor does an unsalted request
    assert new_hits("a2", "tenant-a") == every_full_block  # its own salt finds them all
    assert new_hits("u2", None) == every_full_block
    idle_and_conserved(engine)


def test_cached_blocks_are_evicted_least_recently_used_first(tiny_model_dir):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=12), "sdpa")
    old, new = list(range(100, 148)), list(range(200, 248))  # 3 full blocks each
    tokens_of(engine, [old], "old", max_tokens=2)
    tokens_of(engine, [new], "new", max_tokens=2)
    # a request needing every free block evicts; the least recently freed (old's) go first
    tokens_of(engine, [list(range(300, 300 + 12 * 16 - 20))], "big", max_tokens=2)
    idle_and_conserved(engine)
    hits_before = engine.stats().prefix_cache_hit_tokens
    tokens_of(engine, [old], "old2", max_tokens=2)
    assert engine.stats().prefix_cache_hit_tokens == hits_before  # old's blocks were gone
    idle_and_conserved(engine)


def test_preemption_with_prefix_caching_stays_exact(tiny_model_dir, plain_tokens):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=12, block_size=16), "sdpa")
    assert tokens_of(engine, PROMPTS) == plain_tokens
    assert engine.scheduler.num_preemptions > 0
    idle_and_conserved(engine)


def test_block_hashes_chain_and_differ_by_prefix():
    a = hash_blocks(list(range(32)), 16)
    b = hash_blocks([99, *range(1, 32)], 16)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # the same second block, another prefix
    assert hash_blocks(list(range(32)), 16) == a  # deterministic across calls (and processes)
    assert hash_blocks(list(range(16, 32)), 16, parent=a[0]) == a[1:]
    salted = hash_blocks(list(range(32)), 16, parent=salt_root("s"))
    assert salted[0] not in a and salted[1] not in a and salted != hash_blocks(list(range(32)), 16, salt_root("t"))


def test_pool_revives_cached_free_blocks_and_evicts_on_allocate():
    pool = BlockPool(num_blocks=3, block_size=4)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h")
    pool.free([block])
    assert pool.num_free_blocks == 3 and pool.lookup(b"h") == block
    pool.touch([block])  # a hit takes it back from the free queue
    assert pool.num_free_blocks == 2 and pool.ref_count(block) == 1
    pool.free([block])
    pool.allocate(3)  # needing everything evicts the cached block
    assert pool.lookup(b"h") is None
    pool.check_conservation()
