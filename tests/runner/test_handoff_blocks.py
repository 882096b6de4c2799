"""The handoff's block moves on the CPU (pegaserve/runner/model_runner.py): packing and unpacking whole
prompts or one layer at a time, and the shm handoff's copy between two caches, against plain
advanced indexing."""

import random

import pytest
import torch

from pegaserve.runner.model_runner import block_runs, copy_blocks, pack_blocks, pack_layer, unpack_blocks, unpack_layer


def cache(num_blocks: int, seed: int) -> torch.Tensor:
    return torch.randn(3, 2, num_blocks, 4, 2, 8, generator=torch.Generator().manual_seed(seed))


def test_pack_and_unpack_whole_and_by_layer_are_indexing():
    source, ids = cache(20, 0), [7, 3, 4, 5, 19]
    packed = pack_blocks(source, ids)
    assert torch.equal(packed, source[:, :, ids])
    by_layer = torch.empty_like(packed)
    for layer in range(3):
        pack_layer(source, layer, torch.tensor(ids), by_layer[layer])
    assert torch.equal(by_layer, packed)

    target, into = cache(30, 1), [0, 29, 10, 11, 12]
    expected = target.clone()
    expected[:, :, into] = packed
    unpack_blocks(target, into, packed)
    assert torch.equal(target, expected)
    target = cache(30, 1)
    for layer in range(3):
        unpack_layer(target, layer, torch.tensor(into), packed[layer])
    assert torch.equal(target, expected)


def test_block_runs_pair_stretches_that_step_alike():
    assert list(block_runs([1, 2, 3, 7, 6, 5, 9], [10, 11, 12, 20, 19, 18, 4])) == [(1, 10, 3), (5, 18, 3), (9, 4, 1)]
    assert list(block_runs([1, 2, 3], [5, 4, 3])) == [(1, 5, 1), (2, 4, 1), (3, 3, 1)]  # opposite directions
    assert list(block_runs([4, 5, 6, 5], [0, 1, 2, 3])) == [(4, 0, 3), (5, 3, 1)]  # a change of direction
    assert list(block_runs([], [])) == []
    assert list(block_runs([4, 5, 6], [9, 10, 11])) == [(4, 9, 3)]  # one rising run on both sides
    assert list(block_runs([7], [2])) == [(7, 2, 1)]
    assert list(block_runs([4, 5, 6], [9, 10, 12])) == [(4, 9, 2), (6, 12, 1)]  # rising on one side only


@pytest.mark.parametrize("trial", range(40))
def test_copy_blocks_is_indexing(trial):
    rng = random.Random(trial)
    source, target = cache(40, trial), cache(50, 100 + trial)
    n = rng.randint(1, 30)
    start = rng.randrange(0, 40 - n)
    source_ids = list(range(start, start + n)) if trial % 3 == 0 else rng.sample(range(40), n)
    start = rng.randrange(0, 50 - n)
    target_ids = list(range(start, start + n))[:: 1 if trial % 4 else -1] if trial % 2 == 0 \
        else rng.sample(range(50), n)
    expected = target.clone()
    expected[:, :, target_ids] = source[:, :, source_ids]
    copy_blocks(source, source_ids, target, target_ids)
    assert torch.equal(target, expected)
