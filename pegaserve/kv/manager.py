"""Which blocks each request holds — its block table — and the prefix cache over them.

The scheduler is the only caller: a request's blocks change only through these methods. Full
blocks are named by the chained hash of their tokens (`block_pool.hash_block`) and are never
written again, so they can be shared: by requests with a common prefix (the prefix cache), and by
the choices of one prompt (`fork`). A partial block shared by choices is copied before a choice
writes into it (copy-on-write: `prepare_write` returns the copies for the runner to make).
"""

from __future__ import annotations

from dataclasses import dataclass

from pegaserve.kv.block_pool import BlockHash, BlockPool, hash_blocks, salt_root
from pegaserve.request import RequestState


@dataclass(frozen=True)
class CachedPrefix:
    """The longest cached prefix of a request: its blocks, in order, and the tokens they hold."""

    block_ids: tuple[int, ...] = ()

    def num_tokens(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


@dataclass
class PrefixCacheStats:
    num_queried_tokens: int = 0  # prompt tokens looked up
    num_hit_tokens: int = 0  # of which found cached


class KvCacheManager:
    def __init__(self, pool: BlockPool, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # the request's full blocks' hashes, in order
        self._num_named: dict[str, int] = {}  # how many leading blocks of its table are hashed

    # --- questions -------------------------------------------------------------------------------

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables.get(request_id, ()))

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def find_cached_prefix(self, request: RequestState) -> CachedPrefix:
        """The longest run of the request's full blocks already in the cache, leaving at least one
        token to compute (its logits give the next token). Requests that score their prompt need
        every position's hidden state, so they never reuse KV."""
        if not self.enable_prefix_caching or request.engine_request.num_prompt_logprobs is not None:
            return CachedPrefix()
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids = []
        for block_hash in self._request_hashes(request)[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return CachedPrefix(tuple(block_ids))

    def num_blocks_needed(self, request: RequestState, num_tokens: int, prefix: CachedPrefix = CachedPrefix()) -> int:
        """Free blocks `allocate(request, num_tokens, prefix)` would take from the pool."""
        held = len(self._tables.get(request.request_id, ())) or len(prefix.block_ids)
        revived = 0 if request.request_id in self._tables else sum(
            self.pool.ref_count(b) == 0 for b in prefix.block_ids)
        return max(0, self.pool.blocks_for(num_tokens) - held) + revived

    # --- commands --------------------------------------------------------------------------------

    def allocate(self, request: RequestState, num_tokens: int, prefix: CachedPrefix = CachedPrefix()) -> bool:
        """Hold blocks for `num_tokens` of the request's tokens, starting from `prefix` when it holds
        none yet. False (and nothing changes) when the pool cannot spare them."""
        if not self.pool.can_allocate(self.num_blocks_needed(request, num_tokens, prefix)):
            return False
        table = self._tables.get(request.request_id)
        if table is None:
            table = self._tables[request.request_id] = list(prefix.block_ids)
            self.pool.touch(prefix.block_ids)
            self._num_named[request.request_id] = len(prefix.block_ids)
        missing = self.pool.blocks_for(num_tokens) - len(table)
        if missing > 0:
            table += self.pool.allocate(missing)
        return True

    def count_prefix_query(self, request: RequestState, prefix: CachedPrefix) -> None:
        self.stats.num_queried_tokens += request.num_prompt_tokens
        self.stats.num_hit_tokens += prefix.num_tokens(self.block_size)

    def prepare_write(self, request: RequestState, first_position: int) -> list[tuple[int, int]]:
        """Before the request's KV is written from `first_position` on: give it its own copy of every
        shared block it will write into. Returns the (source, destination) copies to make first."""
        table = self._tables[request.request_id]
        copies = []
        for i in range(first_position // self.block_size, len(table)):
            block_id = table[i]
            if self.pool.ref_count(block_id) > 1:
                assert not self.pool.is_cached(block_id), "full cached blocks are never written"
                (copy,) = self.pool.allocate(1)  # the caller checked room: see `num_copies_needed`
                self.pool.free([block_id])
                table[i] = copy
                copies.append((block_id, copy))
        return copies

    def num_copies_needed(self, request: RequestState, first_position: int) -> int:
        table = self._tables.get(request.request_id, ())
        return sum(self.pool.ref_count(b) > 1 for b in table[first_position // self.block_size :])

    def fork(self, parent: RequestState, child: RequestState) -> None:
        """`child` shares every block of `parent` (choices of one prompt after its prefill)."""
        table = self._tables[parent.request_id]
        self.pool.share(table)
        self._tables[child.request_id] = list(table)
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, ()))
        self._num_named[child.request_id] = self._num_named[parent.request_id]

    def truncate(self, request: RequestState, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (rejected speculative positions)."""
        table = self._tables[request.request_id]
        keep = self.pool.blocks_for(num_tokens)
        if len(table) > keep:
            self.pool.free(table[keep:])
            del table[keep:]

    def name_full_blocks(self, request: RequestState) -> None:
        """Enter the request's newly computed full blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        first = self._num_named[request.request_id]
        if num_full <= first:
            return
        hashes = self._request_hashes(request)
        for i in range(first, num_full):
            self.pool.cache(table[i], hashes[i])
        self._num_named[request.request_id] = num_full

    def free(self, request: RequestState) -> None:
        """Give back every block of the request (finish, abort, preemption, release)."""
        table = self._tables.pop(request.request_id, None)
        if table is not None:
            self.pool.free(table)
        self._num_named.pop(request.request_id, None)

    def forget(self, request: RequestState) -> None:
        """The request is gone for good: drop its memoized hashes too."""
        self.free(request)
        self._hashes.pop(request.request_id, None)

    def _request_hashes(self, request: RequestState) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended as its tokens grow (memoized per request)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            salt = request.engine_request.cache_salt
            parent = hashes[-1] if hashes else salt_root(salt) if salt is not None else None
            start = len(hashes) * self.block_size
            tokens = request.token_ids(start, num_full * self.block_size)
            hashes += hash_blocks(tokens, self.block_size, parent)
        return hashes
