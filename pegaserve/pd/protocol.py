"""The handoff's messages. A `Lease` travels prefill -> ingress -> decode in ordinary Serve calls;
the rest travel on the direct connection between a decode and a prefill replica, one exchange at a
time, so the blocking send/recv of a pair channel happen in the same order on both sides.

Nothing in a handoff waits for the prefill engine's loop (which answers only between steps, and a
long prompt's step takes hundreds of ms): the lease names the blocks, their generations and its
expiry (`ParkedKv`), the bytes are read straight from the engine's cache, and a read is the
prompt's KV if, once it is over, the lease had not expired and no block was handed out anew."""

from __future__ import annotations

from dataclasses import dataclass

from pegaserve.messages import ParkedKv
from pegaserve.net.channel import Address


@dataclass(frozen=True)
class SharedCache:
    """The prefill engine's KV cache as a file in shared memory, for decode replicas of its node
    (`node_id`: `NodeInfo.node_id`)."""

    node_id: str
    path: str
    shape: tuple[int, ...]  # the whole cache: [layers, 2, num_blocks, block_size, kv_heads, head_dim]


@dataclass(frozen=True)
class Lease:
    """What decode needs to fetch a prompt's KV from the prefill replica holding it."""

    request_id: str
    prefill_replica: str
    address: Address  # the prefill replica's KV server
    kv_shape: tuple[int, ...]  # the whole prompt, packed: [layers, 2, blocks, block_size, kv_heads, head_dim]
    kv_dtype: str
    block_bytes: int  # one block across every layer, K and V
    parked: ParkedKv  # where the prompt's blocks lie in the prefill engine's cache, and for how long
    # what the sender's transport put in it (`LeaseKv`, pd/transports/base.py):
    kv_ref: list | None = None  # a reference to the packed prompt in a store (wrapped: Ray must not resolve it)
    shared: SharedCache | None = None  # where a decode replica of the same node maps the prefill's cache
    pushed_to: str | None = None  # the pair (its group name) its KV is being pushed on (pd/push.py)

    def fits(self, cache_shape: tuple[int, ...], cache_dtype: str) -> bool:
        """Whether the prompt's blocks have the layout of a cache of this shape and dtype (a pair
        channel moves raw bytes straight into the cache)."""
        layout = (*self.kv_shape[:2], *self.kv_shape[3:])
        return (layout, self.kv_dtype) == ((*cache_shape[:2], *cache_shape[3:]), cache_dtype)


@dataclass(frozen=True)
class OpenPair:
    """Decode asks for a pair channel (`PairTransport`) on this connection."""

    group_name: str


@dataclass(frozen=True)
class PairOffer:
    """Prefill's answer: where the pair's rendezvous listens (if its transport has one)."""

    host: str
    port: int


@dataclass(frozen=True)
class Fetch:
    """Send the lease's blocks `source_block_ids` (those decode does not have cached) over the pair
    channel into decode's `target_block_ids`, for the choices `choice_ids` (the ledger's keys: the
    request id itself when it has one choice). Decode has posted its receives already; prefill
    sends at once and, once its reads are over, whether they were the prompt's, as the transfer's
    last message."""

    request_id: str
    choice_ids: tuple[str, ...]
    parked: ParkedKv
    source_block_ids: tuple[int, ...]
    target_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Copied:
    """Decode is done with the lease's blocks: it copied them out of the prefill engine's cache
    itself (same node) or out of their push (`held`: the copy was the prompt's, otherwise decode
    recomputes), or it will not read them (no bytes; it has them cached, or recomputes). Prefill
    frees them."""

    request_id: str
    choice_ids: tuple[str, ...]
    kv_bytes: int
    seconds: float
    held: bool
    transport: str  # the name of the transport that copied them (the ledger's)


@dataclass(frozen=True)
class ReleaseLease:
    """The ingress will not continue the request (its first token was terminal after all, the
    client left): free the blocks now rather than at the lease's expiry."""

    request_id: str
