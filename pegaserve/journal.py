"""The ledger's journal: finished records appended as JSON lines, read back by a restarted ledger.

Best effort, never in the way: a write that fails is counted and logged, and the ledger goes on (the
request it records has finished either way). What it reads back is checked line by line: a line that
is not a record (torn by a crash mid-write, or written by anything else) is skipped and counted, and
a torn last line is cut off before anything is appended after it. It lives in a private directory
(created 0700; refused if it is a symlink or another user's) in a file opened 0600 without following
symlinks, is synced once per batch of records, and rotates: past `max_bytes` the file becomes
`<name>.1` (the one before is dropped), and a restart reads both, oldest first.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)
MAX_BYTES = 32 << 20
REQUIRED = ("request_id", "status", "stop_cause", "violations")


class Journal:
    def __init__(self, path: str | Path, max_bytes: int = MAX_BYTES) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.num_write_failures = 0
        self.num_skipped_lines = 0
        self._file: int | None = None  # the open file descriptor, appending
        self._dirty = False

    def read(self) -> Iterator[dict]:
        """Every record kept, oldest first (the rotated file, then the current one); a torn last
        line of the current file is cut off."""
        if not self._private_directory():
            return
        self._repair_tail()
        for path in (self._rotated(), self.path):
            try:
                with _open_private(path, os.O_RDONLY) as f:
                    yield from self._records(f)
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._failed(f"cannot read {path.name}: {exc}")

    def append(self, record: dict) -> None:
        """Append one record (synced at the next `sync`); a failure is counted, never raised."""
        line = (json.dumps(record) + "\n").encode()
        try:
            if self._file is None:
                if not self._private_directory():
                    raise OSError("the journal's directory is not private")
                self._file = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            os.write(self._file, line)
            self._dirty = True
            if os.fstat(self._file).st_size > self.max_bytes:
                self._rotate()
        except OSError as exc:
            self._close()
            self._failed(f"cannot append to the journal: {exc}")

    def sync(self) -> None:
        """What was appended since the last sync is on disk once this returns (or counted failed)."""
        if self._file is not None and self._dirty:
            try:
                os.fsync(self._file)
                self._dirty = False
            except OSError as exc:
                self._close()
                self._failed(f"cannot sync the journal: {exc}")

    def _rotate(self) -> None:
        os.fsync(self._file)
        self._close()
        os.replace(self.path, self._rotated())

    def _rotated(self) -> Path:
        return self.path.with_name(self.path.name + ".1")

    def _close(self) -> None:
        if self._file is not None:
            try:
                os.close(self._file)
            except OSError:
                pass
            self._file = None
        self._dirty = False

    def _private_directory(self) -> bool:
        """The journal's directory, made 0700 if missing; False (counted) if it is a symlink, not a
        directory, another user's, or open to others."""
        directory = self.path.parent
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = directory.lstat()
        except OSError as exc:
            self._failed(f"cannot make the journal's directory: {exc}")
            return False
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            self._failed(f"{directory} is not a private directory of this user's (a symlink, another user's, "
                         "or writable by others): the journal is off")
            return False
        return True

    def _repair_tail(self) -> None:
        """Cut a torn last line (no newline at its end) off the current file."""
        try:
            with _open_private(self.path, os.O_RDWR) as f:
                data = f.read()
                if data and not data.endswith(b"\n"):
                    f.truncate(data.rfind(b"\n") + 1)
                    self.num_skipped_lines += 1
                    log.warning("the journal's last line was torn (a crash mid-write): cut off")
        except FileNotFoundError:
            return
        except OSError as exc:
            self._failed(f"cannot repair the journal's last line: {exc}")

    def _records(self, f) -> Iterator[dict]:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and all(key in record for key in REQUIRED):
                yield record
            else:
                self.num_skipped_lines += 1
                if self.num_skipped_lines <= 10:
                    log.warning("a journal line that is no record was skipped")

    def _failed(self, message: str) -> None:
        self.num_write_failures += 1
        if self.num_write_failures <= 10 or self.num_write_failures % 1000 == 0:
            log.error("ledger journal (%d failures so far): %s", self.num_write_failures, message)


def _open_private(path: Path, flags: int):
    """`path` opened as a binary file, refusing a symlink."""
    return os.fdopen(os.open(path, flags | os.O_NOFOLLOW), "rb" if flags == os.O_RDONLY else "r+b")
