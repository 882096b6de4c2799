"""The paged KV cache's bookkeeping: a pool of fixed-size blocks with an O(1) free list and
reference counts. Tensors live in `kv_cache.py`; this file only knows block ids."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Owns every block id. A block is free exactly when its reference count is 0.

    Question/command pairs keep the scheduler readable: `can_allocate` before `allocate`.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        assert self.can_allocate(num_blocks), "ask can_allocate first"
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Take another reference (a prefix shared by two requests, a lease held for export)."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"block {block_id} is free"
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go back to the free list."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def check_conservation(self) -> None:
        """Every block is either free (refcount 0, listed once) or referenced — never both."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id, count in enumerate(self._ref_counts):
            assert (count == 0) == (block_id in free), f"block {block_id}: refcount {count}"
