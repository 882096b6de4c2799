"""The paged KV cache's bookkeeping: a pool of fixed-size blocks with reference counts, an O(1)
free queue in LRU order, and the prefix cache's map from block hash to block.

The cache tensor itself lives in the model runner; this file only knows block ids. A block is free
exactly when its reference count is 0. Each block has a generation, the number of times it was
handed out for new KV: bytes read from a block are the ones its holder meant if its generation is
the same after the read as when the holder took it (a prefill replica's KV handoff reads parked
blocks without asking the engine loop). A free block may still hold a cached prefix (it has a
hash): a request that needs that prefix takes it back (`touch`) instead of recomputing it; a
request that needs fresh blocks takes the least recently freed ones, evicting their hashes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import MutableSequence, Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of one full block: it names the block's tokens *and* everything before them,
    so equal hashes mean equal KV. blake2b, not Python's `hash`, so no crafted prompt can collide
    with another's prefix, and prefill and decode replicas compute the same value."""
    h = hashlib.blake2b(parent or b"pegaserve-kv", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def salt_root(salt: str) -> BlockHash:
    """The hash a salted request's chain starts from (`cache_salt`): only requests with the same salt
    name their blocks alike, so no one can learn from cache hits what another tenant's prompts hold.
    16 bytes, never the unsalted chain's 12-byte start."""
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16, person=b"pegaserve-salt").digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None,
                start_block: int = 0) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on, chained from `parent`
    (the hash of block `start_block - 1`)."""
    hashes = []
    for first in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[first : first + block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    """Owns every block id. Question/command pairs keep callers readable: `can_allocate` before
    `allocate`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self.generations: MutableSequence[int] = array("q", bytes(8 * num_blocks))

    def use_generations(self, storage: MutableSequence[int]) -> None:
        """Keep the generations in `storage` from now on (shared memory other processes read)."""
        storage[:] = self.generations
        self.generations = storage

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached prefixes among them: they are reclaimable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks (refcount 1), the least recently freed first; their cached hashes are evicted."""
        assert self.can_allocate(num_blocks), "ask can_allocate first"
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.generations[block_id] += 1  # before anything writes into it
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def share(self, block_ids: Sequence[int]) -> None:
        """Take another reference to held blocks (choices of one prompt, a lease held for export)."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"block {block_id} is free"
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. Blocks reaching 0 join the free queue's recent end, the
        last of `block_ids` first, so a prefix's tail is evicted before its head."""
        for block_id in reversed(block_ids):
            assert self._ref_counts[block_id] > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # --- the prefix cache ------------------------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference to cached blocks, free or not (a prefix-cache hit)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Name a full, held block by its hash; it is never written again. If another block already
        holds the same prefix, the cache keeps that one and this block stays anonymous."""
        assert self._ref_counts[block_id] > 0
        if self._hash_of[block_id] is not None:
            assert self._hash_of[block_id] == block_hash, f"block {block_id} holds another prefix"
            return  # shared by choices of one prompt: the first of them named it
        if block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self._hash_of[block_id] = block_hash

    def is_cached(self, block_id: int) -> bool:
        return self._hash_of[block_id] is not None

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hash_of[block_id] = None

    def reset_cache(self) -> None:
        """Forget every cached prefix (the blocks themselves stay where they are)."""
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks

    def check_conservation(self) -> None:
        """Every block is either free (refcount 0, queued once) or referenced — never both — and the
        hash map and the per-block hashes agree."""
        for block_id, count in enumerate(self._ref_counts):
            assert (count == 0) == (block_id in self._free), f"block {block_id}: refcount {count}"
        for block_hash, block_id in self._cached.items():
            assert self._hash_of[block_id] == block_hash, f"block {block_id}: stale hash"
        assert sum(h is not None for h in self._hash_of) == len(self._cached)
