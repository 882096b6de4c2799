import pytest

from pegaserve.kv.block_pool import BlockPool


def test_allocate_free_share_and_conservation():
    pool = BlockPool(num_blocks=4, block_size=16)
    assert pool.blocks_for(0) == 0 and pool.blocks_for(16) == 1 and pool.blocks_for(17) == 2
    a = pool.allocate(3)
    assert pool.num_free_blocks == 1 and not pool.can_allocate(2)
    pool.share(a[:1])
    pool.free(a)
    assert pool.num_free_blocks == 3  # a[0] still held by the share
    pool.free(a[:1])
    assert pool.num_free_blocks == 4
    pool.check_conservation()


def test_double_free_is_caught():
    pool = BlockPool(2, 4)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(AssertionError):
        pool.free(ids)
