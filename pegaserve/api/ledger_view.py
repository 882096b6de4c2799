"""`GET /admin/ledger/{key}`: the ledger keeps one record per choice, keyed by its engine id, and
this finds them from the ids a client knows.

A response `R` with one choice has the record `R`. With several, prompt p's engine request is
`R-p` (or `R` for one prompt), and its choice j is `R-p/j` (`R-p` when n is 1): `R` answers every
choice's record under "choices", in wire order, and `R-i` answers choice i's record (what
`pegaserve.testing.contract.ledger_keys` asks for).
"""

from __future__ import annotations

import re

from pegaserve.api.services import LedgerClient

_INDEXED = re.compile(r"^(.+)-(\d+)$")


async def ledger_view(ledger: LedgerClient, key: str) -> dict | None:
    record = await ledger.get(key)
    if record is not None:
        return record
    match = _INDEXED.match(key)
    if match is not None:
        records = await choice_records(ledger, match.group(1))
        index = int(match.group(2))
        if index < len(records):
            return records[index]
    records = await choice_records(ledger, key)
    if not records:
        return None
    return {
        "request_id": key,
        "client_request_id": records[0].get("client_request_id"),
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in records),
        "completion_tokens": sum(r.get("completion_tokens") or 0 for r in records),
        "status": _status(records),
        "violations": [v for r in records for v in r.get("violations", ())],
        "choices": records,
    }


async def choice_records(ledger: LedgerClient, response_id: str) -> list[dict]:
    """The records of a response's choices in wire order ([] when there are none)."""
    records = await _engine_request_records(ledger, response_id, alone=False)
    if records:
        return records
    p = 0
    while part := await _engine_request_records(ledger, f"{response_id}-{p}", alone=True):
        records += part
        p += 1
    return records


async def _engine_request_records(ledger: LedgerClient, request_id: str, alone: bool) -> list[dict]:
    """The choices of one engine request: `request_id/j`, or the request itself when `alone` (n=1)."""
    if alone and (record := await ledger.get(request_id)) is not None:
        return [record]
    records = []
    while (record := await ledger.get(f"{request_id}/{len(records)}")) is not None:
        records.append(record)
    return records


def _status(records: list[dict]) -> str:
    statuses = {r.get("status") for r in records}
    return statuses.pop() if len(statuses) == 1 else "mixed"
