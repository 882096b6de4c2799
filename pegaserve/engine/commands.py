"""What callers send the engine loop (typed, frozen, so they cross a process boundary), and what
a replica's health check reads from it."""

from __future__ import annotations

from dataclasses import dataclass

from pegaserve.messages import EngineRequest, Handoff, ParkedKv


@dataclass(frozen=True)
class AddRequest:
    request: EngineRequest


@dataclass(frozen=True)
class Receive:
    """Decode role: admit a handoff whose KV the caller will write (answers a `ReceiveTarget`)."""

    handoff: Handoff


@dataclass(frozen=True)
class AddHandoff:
    """Decode role: admit a handoff whose packed KV (or None) travels with it (answers imported?)."""

    handoff: Handoff


@dataclass(frozen=True)
class SharedKv:
    """Where a prompt's KV lies in another engine's cache on this node: its shared-memory file
    (`kv_files.map_kv_file`) and the prompt's blocks there."""

    path: str
    shape: tuple[int, ...]  # the whole cache: [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    parked: ParkedKv


@dataclass(frozen=True)
class AddSharedHandoff:
    """Decode role: admit a handoff and copy its KV from `source` in this boundary (answers a
    `SharedReceipt`, or None when it recomputes for want of blocks)."""

    handoff: Handoff
    source: SharedKv


@dataclass(frozen=True)
class Received:
    request_id: str
    ok: bool


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class ReleaseRequest:
    request_id: str


@dataclass(frozen=True)
class ExportKv:
    """Prefill role, in process: the packed KV of a parked request from `first_block` on."""

    request_id: str
    first_block: int = 0


@dataclass(frozen=True)
class GetStats:
    pass


Command = (AddRequest | Receive | AddHandoff | AddSharedHandoff | Received | AbortRequest | ReleaseRequest | ExportKv
           | GetStats)


@dataclass(frozen=True)
class Health:
    """What a replica's health check reads: is the loop alive, and is it keeping up?"""

    alive: bool
    has_work: bool
    seconds_since_step: float  # since the last step (or since it last went idle)
    num_steps: int
    num_failed_steps: int
