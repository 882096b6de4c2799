"""What the ingress and the engine replicas send each other in their Serve calls, each call's
arguments one frozen dataclass, and each answer, pickled once by the standard pickler.

Serve serializes a call's arguments and its answer with cloudpickle, which runs Python code for
every object and every class in them: ~2.5x the standard pickler's time for an `EngineRequest`,
a `PrefillResult` or a decode call's arguments (~30 us each on a 2-core host), paid on the event
loop of the ingress or of the replica, for every request. Bytes it passes through as they are.

A message holding an `ObjectRef` (a lease on the object store's KV) travels as it is: Ray must
serialize a ref itself to count who borrows it (one pickled by another pickler pins its object).
"""

from __future__ import annotations

import copyreg
import io
import pickle
from dataclasses import dataclass
from typing import TypeVar

import ray

from pegaserve.messages import EngineRequest, SampledToken, StepOutput
from pegaserve.net.channel import Address
from pegaserve.pd.protocol import Lease

T = TypeVar("T")
Choices = tuple[tuple[int, tuple[SampledToken, ...]], ...]  # (choice index, its tokens so far)


@dataclass(frozen=True)
class PrefillResult:
    outputs: list[StepOutput]  # each choice's first token (or its finish, when it is terminal)
    replica: str
    lease: Lease | None  # None: every choice finished at its first token, nothing to move


@dataclass(frozen=True)
class DecodeCall:
    """Continue `choices` of `request` and stream their tokens to `reply_to`, tagged `tag`; with no
    lease (a resume), the prompt and the choices' tokens are recomputed."""

    request: EngineRequest
    choices: Choices
    lease: Lease | None
    reply_to: Address
    tag: int


@dataclass(frozen=True)
class ColocatedCall:
    """Run `request` (or resume `choices` of it) and stream its tokens to `reply_to`, tagged `tag`."""

    request: EngineRequest
    reply_to: Address
    tag: int
    choices: Choices | None = None


class _HoldsRef(Exception):
    pass


def _refuse(ref: ray.ObjectRef):
    raise _HoldsRef


# (copyreg's table as the import found it: no type in these messages registers with copyreg)
_REFUSE_REFS = {**copyreg.dispatch_table, ray.ObjectRef: _refuse}


def pack(message: T) -> bytes | T:
    """`message` pickled, or `message` itself if it holds an `ObjectRef`."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _REFUSE_REFS
    try:
        pickler.dump(message)
    except _HoldsRef:
        return message
    return buffer.getvalue()


def unpack(packed: bytes | T, kind: type[T]) -> T:
    """A message of `kind` from `pack` (the peers are Serve replicas of one app: they trust each
    other as Ray's own workers do)."""
    message = pickle.loads(packed) if isinstance(packed, bytes) else packed
    if not isinstance(message, kind):
        raise TypeError(f"expected {kind.__name__}, got {type(message).__name__}")
    return message
