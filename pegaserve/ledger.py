"""The lifecycle ledger's data model: typed events per request, the record they build, and the
per-request invariants. The Ray actor (deployments/ledger.py) only hosts a `Ledger`.

Events arrive batched (one call per request phase, never per token) from the ingress, prefill and
decode. Memory is bounded: only the most recent `max_records` finished records are kept, and
apart from them the most recent `max_records // 10` of the frontend's own (`internal`: beam search
steps, a width-n search of L tokens making n·L of them), which so push out no client's record.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from pegaserve.journal import Journal
from pegaserve.stop import (
    Eos,
    Error,
    StopCause,
    String,
    Token,
    cause_kind,
    finish_reason,
    stop_reason,
    triggering_token,
)


@dataclass(frozen=True)
class Arrived:
    """A choice reached the frontend. The choices of one prompt share its prefill: the first
    accounts for the prompt's tokens, the others for 0, so records sum to the usage."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    client_request_id: str | None = None  # the client's X-Request-Id: a correlation label, not a key
    internal: bool = False  # the frontend's own engine request (a beam search step), no client's choice


@dataclass(frozen=True)
class Prefilled:
    request_id: str
    first_token_id: int
    first_logprob: float | None  # None where the request asked no logprobs: none was computed
    replica: str


@dataclass(frozen=True)
class KvSent:
    request_id: str
    transport: str
    kv_bytes: int
    seconds: float
    prefill_replica: str
    decode_replica: str


@dataclass(frozen=True)
class KvReceived:
    request_id: str
    transport: str
    kv_bytes: int
    seconds: float
    decode_replica: str
    cached_bytes: int = 0  # prompt KV decode already held in its prefix cache: not moved
    pushed: bool = False  # prefill sent it before decode asked (pegaserve/pd/push.py)


@dataclass(frozen=True)
class Fallback:
    """Decode recomputed the prompt: the transfer failed or the lease expired."""

    request_id: str
    reason: str
    decode_replica: str


@dataclass(frozen=True)
class Migrated:
    """The replica generating the request died (or its stream broke) after `num_tokens` tokens;
    the request resumed on another replica, from exactly those tokens."""

    request_id: str
    from_replica: str
    num_tokens: int
    reason: str


@dataclass(frozen=True)
class TokensCommitted:
    """The tokens the client was given, through the trigger (decided by the ingress)."""

    request_id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Finished:
    request_id: str
    cause: StopCause
    prompt_tokens: int  # the usage sent to the client
    completion_tokens: int


LedgerEvent = Arrived | Prefilled | KvSent | KvReceived | Fallback | Migrated | TokensCommitted | Finished


@dataclass
class _Record:
    request_id: str
    events: list[tuple[str, float, str]] = field(default_factory=list)  # (name, t, component)
    client_request_id: str | None = None
    internal: bool = False  # counted apart in the summary (Arrived.internal)
    prompt_tokens: int | None = None
    committed_token_ids: list[int] = field(default_factory=list)
    first_token: tuple[int, float | None] | None = None
    kv_sent: KvSent | None = None
    kv_received: KvReceived | None = None
    fallback: Fallback | None = None
    migrations: list[Migrated] = field(default_factory=list)
    finished: Finished | None = None
    violations: list[str] = field(default_factory=list)


class Ledger:
    """Records by request id. With a `journal` path, every finished record is appended to it as a
    JSON line, and a new ledger reloads the most recent `max_records` of them: a restarted ledger
    loses only what was still in flight."""

    def __init__(self, max_records: int = 10_000, journal: str | Path | None = None) -> None:
        self.max_records = max_records
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self._restored: OrderedDict[str, dict] = OrderedDict()
        # finished internal records: live ones (late events from other components still land on
        # them) and, after a restart, their JSON
        self._internal: OrderedDict[str, _Record | dict] = OrderedDict()
        self._num_violations = 0
        self._status_counts: Counter[str] = Counter()
        self._cause_counts: Counter[str] = Counter()
        self._num_internal = 0  # finished internal records (Arrived.internal)
        self._num_evicted = 0
        self._journal = Journal(journal) if journal else None
        if self._journal is not None:
            self._restore()

    def _restore(self) -> None:
        for record in self._journal.read():
            if record.get("internal", False):
                self._keep_internal(record["request_id"], record)
                continue
            self._restored[record["request_id"]] = record
            self._restored.move_to_end(record["request_id"])
            if len(self._restored) > self.max_records:
                self._restored.popitem(last=False)
        for record in (*self._restored.values(), *self._internal.values()):  # all JSON here
            self._count(record["status"], record["stop_cause"]["kind"], record.get("internal", False))
            self._num_violations += len(record["violations"])

    def _append_to_journal(self, rec: _Record) -> None:
        if self._journal is not None:
            self._journal.append(_to_json(rec))

    def record(self, events: list[LedgerEvent], component: str, t: float | None = None) -> None:
        t = time.time() if t is None else t
        for event in events:
            rec = self._records.get(event.request_id) or self._internal.get(event.request_id)
            if not isinstance(rec, _Record):
                rec = self._records[event.request_id] = _Record(event.request_id)
            rec.events.append((_event_name(event), t, component))
            self._apply(rec, event)
        self._evict()
        if self._journal is not None:
            self._journal.sync()

    def _apply(self, rec: _Record, event: LedgerEvent) -> None:
        match event:
            case Arrived(prompt_tokens=n, client_request_id=client_id, internal=internal):
                rec.prompt_tokens = n
                rec.client_request_id = client_id
                rec.internal = internal
            case Prefilled(first_token_id=token_id, first_logprob=logprob):
                rec.first_token = (token_id, logprob)
            case KvSent():
                rec.kv_sent = event
            case KvReceived():
                rec.kv_received = event
            case Fallback():
                rec.fallback = event
            case Migrated():
                rec.migrations.append(event)
            case TokensCommitted(token_ids=ids):
                rec.committed_token_ids += ids
            case Finished():
                self._finish(rec, event)

    def _finish(self, rec: _Record, event: Finished) -> None:
        if rec.finished is not None:
            self._violate(rec, "more than one terminal event")
            return
        rec.finished = event
        self._count(_status(event.cause), cause_kind(event.cause), rec.internal)
        for problem in check_invariants(rec):
            self._violate(rec, problem)
        self._append_to_journal(rec)
        if rec.internal:  # into its own window
            del self._records[rec.request_id]
            self._keep_internal(rec.request_id, rec)

    def _keep_internal(self, request_id: str, record: _Record | dict) -> None:
        self._internal[request_id] = record
        self._internal.move_to_end(request_id)
        if len(self._internal) > max(1, self.max_records // 10):
            self._internal.popitem(last=False)

    def _count(self, status: str, cause: str, internal: bool) -> None:
        """A finished record in the summary: a client's choice by status and stop cause, the
        frontend's own requests (beam search steps) apart."""
        if internal:
            self._num_internal += 1
        else:
            self._status_counts[status] += 1
            self._cause_counts[cause] += 1

    def _violate(self, rec: _Record, problem: str) -> None:
        rec.violations.append(problem)
        self._num_violations += 1

    def _evict(self) -> None:
        while len(self._records) > self.max_records:
            oldest = next(iter(self._records.values()))
            if oldest.finished is None and len(self._records) < 2 * self.max_records:
                break  # keep in-flight records unless something is badly wrong
            self._records.popitem(last=False)
            self._num_evicted += 1

    def end_orphans(self, owners: set[str], reason: str) -> int:
        """End the in-flight records whose ingress (the component that recorded their arrival) is
        gone: an `Error` finish with what was committed so far. Returns how many were ended."""
        orphans = [r for r in self._records.values() if r.finished is None and r.events and r.events[0][2] in owners]
        for rec in orphans:
            event = Finished(rec.request_id, Error(reason), rec.prompt_tokens or 0, len(rec.committed_token_ids))
            rec.events.append(("finished", time.time(), "ledger"))
            self._finish(rec, event)
        if self._journal is not None:
            self._journal.sync()
        return len(orphans)

    def get(self, request_id: str) -> dict | None:
        rec = self._records.get(request_id)
        if rec is not None:
            return _to_json(rec)
        internal = self._internal.get(request_id)
        if isinstance(internal, _Record):
            return _to_json(internal)
        return self._restored.get(request_id) or internal

    def summary(self) -> dict:
        in_flight = sum(1 for r in self._records.values() if r.finished is None)
        return {
            "num_records": len(self._records) + len(self._restored) + len(self._internal),
            "num_evicted": self._num_evicted,
            "by_status": {**self._status_counts, "in_flight": in_flight},
            "by_stop_cause": dict(self._cause_counts),
            "internal_requests": self._num_internal,
            "invariant_violations": self._num_violations,
            **({"journal_failures": self._journal.num_write_failures,
                "journal_skipped_lines": self._journal.num_skipped_lines} if self._journal is not None else {}),
        }


def check_invariants(rec: _Record) -> list[str]:
    """Per-request invariants, checked when the terminal event arrives."""
    fin = rec.finished
    assert fin is not None
    problems = []
    if fin.completion_tokens != len(rec.committed_token_ids):
        problems.append(f"completion_tokens {fin.completion_tokens} != {len(rec.committed_token_ids)} committed")
    trigger = triggering_token(fin.cause)
    if isinstance(fin.cause, Eos | Token) and rec.committed_token_ids[-1:] != [trigger]:
        problems.append(f"trigger {trigger} is not the last committed token")
    if rec.prompt_tokens is not None and fin.prompt_tokens != rec.prompt_tokens:
        problems.append(f"usage prompt_tokens {fin.prompt_tokens} != arrived {rec.prompt_tokens}")
    if rec.first_token is not None and rec.committed_token_ids and rec.committed_token_ids[0] != rec.first_token[0]:
        problems.append("the first committed token is not prefill's first token")
    for migration in rec.migrations:
        if migration.num_tokens > len(rec.committed_token_ids):
            problems.append(f"migrated after {migration.num_tokens} tokens but {len(rec.committed_token_ids)} committed")
    return problems


def _status(cause: StopCause) -> str:
    kind = cause_kind(cause)
    return kind if kind in ("abort", "error") else "finished"


def _event_name(event: LedgerEvent) -> str:
    return {
        Arrived: "arrived", Prefilled: "prefilled", KvSent: "kv_sent", KvReceived: "kv_received",
        Fallback: "fallback", Migrated: "migrated", TokensCommitted: "tokens_committed", Finished: "finished",
    }[type(event)]


def _handoff(rec: _Record) -> dict | None:
    """None when no KV was ever meant to move (the first token was terminal, or colocated)."""
    sent, received, fallback = rec.kv_sent, rec.kv_received, rec.fallback
    if sent is None and received is None and fallback is None:
        return None
    moved = received or sent
    return {
        "transport": moved.transport if moved else None,
        "kv_bytes": moved.kv_bytes if moved else 0,
        "seconds": moved.seconds if moved else None,  # decode's view: claim to KV in hand
        "prefill_replica": sent.prefill_replica if sent else None,
        "decode_replica": (received or fallback or sent).decode_replica,
        "fallback": fallback.reason if fallback else None,
        "cached_bytes": received.cached_bytes if received else 0,
        "pushed": received.pushed if received else False,
    }


def _to_json(rec: _Record) -> dict:
    fin = rec.finished
    cause = fin.cause if fin else None
    return {
        "request_id": rec.request_id,
        "client_request_id": rec.client_request_id,
        "internal": rec.internal,
        "status": _status(cause) if cause else "in_flight",
        "prompt_tokens": fin.prompt_tokens if fin else rec.prompt_tokens,
        "completion_tokens": fin.completion_tokens if fin else len(rec.committed_token_ids),
        "finish_reason": finish_reason(cause) if cause else None,
        "stop_reason": stop_reason(cause) if cause else None,
        "stop_cause": None if cause is None else {
            "kind": cause_kind(cause),
            "token_id": triggering_token(cause),
            "text": cause.text if isinstance(cause, String) else None,
        },
        "first_token": None if rec.first_token is None else {"id": rec.first_token[0], "logprob": rec.first_token[1]},
        "handoff": _handoff(rec),
        "migrations": [{"from_replica": m.from_replica, "num_tokens": m.num_tokens, "reason": m.reason}
                       for m in rec.migrations],
        "events": [{"name": n, "t": t, "component": c} for n, t, c in rec.events],
        "violations": list(rec.violations),
    }
