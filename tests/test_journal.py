"""The ledger's journal (pegaserve/journal.py): best effort and never in the way of the ledger,
checked line by line when read back, private, synced, rotated."""

from __future__ import annotations

import json
import os
import stat

from pegaserve.ledger import Arrived, Finished, Ledger, TokensCommitted
from pegaserve.stop import Length


def finished(ledger: Ledger, request_id: str) -> None:
    ledger.record([Arrived(request_id, 3, 16), TokensCommitted(request_id, (5, 6)),
                   Finished(request_id, Length(), 3, 2)], "app/Ingress#1")


def test_a_journal_that_cannot_be_written_is_counted_and_the_ledger_goes_on(tmp_path):
    path = tmp_path / "journal.jsonl"
    path.mkdir()  # a directory where the file should be
    ledger = Ledger(journal=path)
    finished(ledger, "a")
    finished(ledger, "b")
    summary = ledger.summary()
    assert summary["by_status"]["finished"] == 2 and summary["invariant_violations"] == 0
    assert summary["journal_failures"] >= 2
    assert ledger.get("b")["status"] == "finished"


def test_lines_that_are_no_records_are_skipped_and_a_torn_tail_is_cut_off(tmp_path):
    path = tmp_path / "journal.jsonl"
    first = Ledger(journal=path)
    finished(first, "kept")
    with open(path, "a") as f:
        f.write("[]\n{\"request_id\": 1}\nnot json\n{\"request_id\": \"torn\", \"sta")
    restarted = Ledger(journal=path)
    assert restarted.get("kept")["status"] == "finished"
    assert restarted.summary()["journal_skipped_lines"] == 4  # three lines and the torn tail
    finished(restarted, "after")  # appended on a line of its own, not glued to the torn one
    again = Ledger(journal=path)
    assert again.get("after")["status"] == "finished" and again.get("kept") is not None
    assert again.summary()["journal_skipped_lines"] == 3 and again.summary()["invariant_violations"] == 0


def test_the_journal_is_private_and_refuses_a_directory_that_is_not(tmp_path):
    path = tmp_path / "private" / "journal.jsonl"
    finished(Ledger(journal=path), "a")
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere, target_is_directory=True)
    ledger = Ledger(journal=tmp_path / "link" / "journal.jsonl")
    finished(ledger, "b")
    assert ledger.summary()["journal_failures"] >= 1 and not any(elsewhere.iterdir())
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    ledger = Ledger(journal=shared / "journal.jsonl")
    finished(ledger, "c")
    assert ledger.summary()["journal_failures"] >= 1 and not any(shared.iterdir())


def test_the_journal_rotates_and_a_restart_reads_both_files(tmp_path):
    path = tmp_path / "journal.jsonl"
    ledger = Ledger(journal=path)
    ledger._journal.max_bytes = 2000  # a few records a file
    for i in range(13):
        finished(ledger, f"r{i}")
    rotated = path.with_name("journal.jsonl.1")
    assert rotated.exists() and (not path.exists() or path.stat().st_size <= 2000)
    restarted = Ledger(journal=path)
    kept = [json.loads(line)["request_id"] for f in (rotated, path) if f.exists() for line in f.read_text().splitlines()]
    assert all(restarted.get(r) is not None for r in kept) and "r11" in kept
    assert restarted.summary()["journal_skipped_lines"] == 0
