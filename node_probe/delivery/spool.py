"""Findings waiting for delivery, oldest first. While Temporal is unreachable they wait here; a file spool
also survives a probe restart. Memory holds at most the head, whatever the backlog, while the disk works.

File layout under the spool dir: `<instance>.findings.jsonl` (append-only JSON lines) and `<instance>.offset`
(`<bytes of it already delivered> <inode of the file they were counted in>`, replaced atomically). The cap counts
only what is undelivered. When everything is delivered, or the delivered prefix grows past half the cap, the
undelivered tail is copied to a new file that atomically replaces the old one (compaction). The inode in the
offset file makes that crash-safe: an offset recorded for a file that has since been replaced reads as 0 (the new
file holds only undelivered entries), so a crash between the rename and the new offset loses nothing and sends
nothing twice.

A disk error never escapes (the probe, heartbeats included, must outlive a full or read-only disk): a finding that
cannot be written waits in memory (bounded like MemorySpool: warnings give way, impairing findings never do, nor do
those stating NVIDIA's verdicts) behind
the file's undelivered entries, and later ones queue behind it there, so the order holds. Once the memory queue has
been delivered, the next finding tries the file again. Delivery progress that cannot be recorded is kept in memory
(nothing is sent twice by this process; after a restart some may be, and the health workflow drops a finding whose
`finding_id` it has seen). An error line when a kind of fault starts (writing, recording progress, compacting,
reading: not one per finding), one line when all have cleared; `degraded` says whether any is present.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections import deque
from pathlib import Path
from typing import BinaryIO, Protocol

from pydantic import ValidationError

from contract.probe import GpuFinding

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_ITEMS = 10_000
_CHUNK = 1024 * 1024

# What each fault costs, for the one line logged when it starts.
_FAULTS = {
    "write": "findings wait in memory (lost if the probe stops) until it can be written again",
    "offset": "delivery progress is kept in memory; after a restart, findings delivered since may be sent again",
    "compact": "delivered findings stay in it until it can be rewritten",
    "read": "findings wait in memory (lost if the probe stops) for the rest of this run",
    "reread": "its undelivered findings stay in it, and reading it is tried again",
}


def gives_way(finding: GpuFinding) -> bool:
    """Whether a full spool drops the finding. A warning does: losing one costs a count. An impairing finding does
    not (losing it costs a repair), nor one stating NVIDIA's verdict on a GPU: the health workflow holds a verdict
    until it hears otherwise, so losing one leaves it choosing a remedy NVIDIA withdrew, or missing one it asked for.
    Those come one per change of the verdict, not in floods."""
    return not finding.impairs and not finding.verdict


class Spool(Protocol):
    def append(self, finding: GpuFinding) -> bool:
        """False when the finding was dropped because the spool is full (never for impairing findings, nor those
        stating a verdict)."""
        ...

    def peek(self) -> GpuFinding | None: ...

    def pop(self) -> None: ...

    def __len__(self) -> int: ...

    @property
    def degraded(self) -> bool:
        """True while a file spool cannot use its disk as it should (findings may wait in memory only)."""
        ...

    @property
    def on_disk(self) -> bool:
        """Whether every undelivered finding is in the file (a restart would still deliver it)."""
        ...


class MemorySpool:
    """Not durable: for probes configured without a spool dir (e.g. the demo's simulated instances)."""

    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        self._items: deque[GpuFinding] = deque()
        self._max_items = max_items

    @property
    def degraded(self) -> bool:
        return False  # memory only is how it was configured, not a fault

    @property
    def on_disk(self) -> bool:
        return not self._items

    def append(self, finding: GpuFinding) -> bool:
        if len(self._items) >= self._max_items and gives_way(finding):
            log.warning("spool full: dropped warning finding %s", finding.reason)
            return False
        self._items.append(finding)
        return True

    def peek(self) -> GpuFinding | None:
        return self._items[0] if self._items else None

    def pop(self) -> None:
        self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


class FileSpool:
    def __init__(
        self, directory: Path, name: str, max_bytes: int = DEFAULT_MAX_BYTES, max_items: int = DEFAULT_MAX_ITEMS
    ) -> None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name) or "probe"
        self._directory = directory
        self.path = directory / f"{safe}.findings.jsonl"
        self._offset_path = directory / f"{safe}.offset"
        self._tmp_path = directory / f"{safe}.findings.jsonl.tmp"
        self._max_bytes = max_bytes
        self._max_items = max_items  # bounds the memory queue only; the file is bounded by max_bytes
        self._inode: int | None = None  # the file that _size, _offset and _pending describe
        self._size = 0  # end of its last complete line: where the next append goes
        self._offset = 0  # bytes of it delivered
        # Whether the offset file can make a restart skip nothing undelivered: it names this file with at most
        # _offset, or is absent (reads as 0). Only then may the file be replaced (see _offset_safe_to_compact).
        self._offset_durable = True
        self._pending = 0  # undelivered entries in the file
        self._head: tuple[GpuFinding, int] | None = None  # the file's first undelivered entry, once read
        self._overflow: deque[tuple[GpuFinding, int]] = deque()  # after the file's entries: what it could not take
        self._overflow_bytes = 0
        self._peeked: GpuFinding | None = None
        self._faults: dict[str, str] = {}
        self._load()

    @property
    def degraded(self) -> bool:
        """True from a disk error until the spool works as designed again (reported once each way in the log)."""
        return bool(self._faults)

    @property
    def on_disk(self) -> bool:
        return not self._overflow

    def __len__(self) -> int:
        return self._pending + len(self._overflow)

    # --- faults ---------------------------------------------------------------------------------------------

    def _fault(self, kind: str, error: object) -> None:
        if kind not in self._faults:
            self._faults[kind] = str(error)
            log.error("spool %s degraded: %s; %s", self.path, error, _FAULTS[kind])

    def _clear(self, kind: str) -> None:
        if self._faults.pop(kind, None) is not None and not self._faults:
            log.info("spool %s recovered: the disk takes its writes again", self.path)

    # --- startup --------------------------------------------------------------------------------------------

    def _load(self) -> None:
        stored = self._read_offset()
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError as exc:
            self._fault("write", f"cannot create {self.path}: {exc}")
            try:  # a read-only filesystem may still hold an earlier run's backlog: deliver it
                fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                return
        try:
            with os.fdopen(fd, "rb") as handle:
                self._inode = os.fstat(handle.fileno()).st_ino
                offset = stored[0] if stored is not None and stored[1] in (None, self._inode) else 0
                end, size, pending = _scan(handle, offset)
        except OSError as exc:
            self._inode = None
            self._fault("read", f"cannot read {self.path}: {exc}")
            return
        self._size = end
        self._offset = min(offset, end)
        self._pending = pending
        if size > end:  # a crash mid-append left a partial last line; the next append overwrites it anyway
            with contextlib.suppress(OSError), open(self.path, "rb+") as handle:
                handle.truncate(end)
        if stored is not None and stored != (self._offset, self._inode):
            self._write_offset()

    def _read_offset(self) -> tuple[int, int | None] | None:
        """None when there is no offset file; the inode is None in an offset file from before it was recorded."""
        try:
            fields = self._offset_path.read_text().split()
        except FileNotFoundError:
            return None
        except OSError:
            return 0, None
        try:
            if len(fields) == 2:
                return int(fields[0]), int(fields[1])
            return (int(fields[0]) if fields else 0), None
        except ValueError:
            return 0, None

    # --- writing --------------------------------------------------------------------------------------------

    def append(self, finding: GpuFinding) -> bool:
        line = finding.model_dump_json().encode() + b"\n"
        backlog = self._size - self._offset + self._overflow_bytes
        if gives_way(finding) and (backlog + len(line) > self._max_bytes or len(self._overflow) >= self._max_items):
            log.warning("spool %s full: dropped warning finding %s", self.path, finding.reason)
            return False
        # Behind findings already waiting in memory, a finding must wait there too, or it would overtake them.
        if not self._overflow and "read" not in self._faults and self._write_line(line):
            self._pending += 1
        else:
            self._overflow.append((finding, len(line)))
            self._overflow_bytes += len(line)
        return True

    def _write_line(self, line: bytes) -> bool:
        try:
            fd = self._open_for_write()
        except OSError as exc:
            self._fault("write", f"cannot open {self.path}: {exc}")
            return False
        try:
            st = os.fstat(fd)
            if st.st_ino != self._inode or st.st_size < self._size:
                self._rebase(st.st_ino)
            written = 0
            while written < len(line):
                written += os.pwrite(fd, line[written:], self._size + written)
            if st.st_size > self._size:  # what a failed append left
                os.ftruncate(fd, self._size + len(line))
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):  # a partial line must not stay in front of the next one
                os.ftruncate(fd, self._size)
            self._fault("write", f"cannot write {self.path}: {exc}")
            return False
        finally:
            os.close(fd)
        self._size += len(line)
        self._clear("write")
        return True

    def _open_for_write(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the spool dir was removed under the probe
            self._directory.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    def _rebase(self, inode: int) -> None:
        """The file is not the one this spool wrote (deleted, replaced, truncated by someone else): start it over."""
        if self._inode is not None:
            log.error(
                "spool %s was replaced or truncated by something else: %d undelivered findings in it are lost",
                self.path,
                self._pending,
            )
        self._inode = inode
        self._size = self._offset = self._pending = 0
        self._head = None
        self._write_offset()

    def _write_offset(self) -> bool:
        tmp = self._offset_path.with_suffix(".offset.tmp")
        try:
            tmp.write_text(f"{self._offset} {self._inode}")
            os.replace(tmp, self._offset_path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._offset_durable = False
            self._fault("offset", f"cannot write {self._offset_path}: {exc}")
            return False
        self._offset_durable = True
        self._clear("offset")
        return True

    # --- reading and delivery -------------------------------------------------------------------------------

    def peek(self) -> GpuFinding | None:
        """The oldest undelivered finding. None also while the file's head cannot be read just now (a full fd
        table, an I/O error): the findings stay, and `len()` still counts them, so the caller tries again later."""
        while self._head is None and self._pending:
            try:
                with open(self.path, "rb") as handle:
                    replaced = os.fstat(handle.fileno()).st_ino != self._inode
                    handle.seek(self._offset)
                    line = b"" if replaced else handle.readline()
            except FileNotFoundError:
                self._forget_file("it was deleted")
                break
            except OSError as exc:
                # Most likely passing; the memory queue must not overtake the file either.
                self._fault("reread", f"cannot read {self.path}: {exc}")
                self._peeked = None
                return None
            self._clear("reread")
            if not line.endswith(b"\n") or self._offset + len(line) > self._size:
                self._forget_file("it was replaced or truncated by something else")
                break
            try:
                self._head = (GpuFinding.model_validate_json(line), len(line))
            except ValidationError as exc:
                log.error("spool %s: skipping an unreadable entry: %s", self.path, exc)
                self._advance(len(line))
        if self._head is not None:
            self._peeked = self._head[0]
        else:
            self._peeked = self._overflow[0][0] if self._overflow else None
        return self._peeked

    def pop(self) -> None:
        """Removes what peek returned (the head, if peek was not called since the last pop)."""
        target = self._peeked if self._peeked is not None else self.peek()
        self._peeked = None
        if target is None:
            return
        if self._head is not None and self._head[0] is target:
            nbytes = self._head[1]
            self._head = None
            self._advance(nbytes)
        elif self._overflow and self._overflow[0][0] is target:
            _, nbytes = self._overflow.popleft()
            self._overflow_bytes -= nbytes
        # else it went with a file that something else deleted (logged then): nothing left to remove

    def _forget_file(self, reason: str) -> None:
        log.error("spool %s: %s; the %d undelivered findings in it are lost", self.path, reason, self._pending)
        self._fault("read", f"cannot read {self.path}")
        self._head = None
        self._pending = 0
        self._offset = self._size
        if self._compact():  # a fresh, empty file: the spool can go on using the disk
            self._clear("read")

    def _advance(self, nbytes: int) -> None:
        self._offset += nbytes
        self._pending -= 1
        # All delivered: start the file over, so it never grows past one outage's worth. Under steady traffic the
        # backlog may never reach zero; then the delivered prefix is cut once it is large.
        if (self._pending <= 0 or self._offset > self._max_bytes // 2) and self._compact():
            return
        self._write_offset()

    def _offset_safe_to_compact(self) -> bool:
        """The offset file must name the current file (or be absent, which reads as 0 whatever the file) before
        that file is replaced: one naming an older file could name the new one, should its inode be reused."""
        if self._offset_durable or self._write_offset():
            return True
        # A full disk cannot take even the offset file, and only compaction frees the space: remove it instead
        # (a restart before it is written again sends what is in the file once more, and loses nothing).
        try:
            self._offset_path.unlink(missing_ok=True)
        except OSError:
            return False
        self._offset_durable = True
        return True

    def _compact(self) -> bool:
        """Replace the file by its undelivered tail. Crash-safe: the new file is complete on disk before it
        replaces the old, and until the offset names it, the recorded offset names the old file, so reads as 0."""
        if not self._offset_safe_to_compact():
            return False
        tail = self._size - self._offset
        try:
            with open(self._tmp_path, "wb") as out:
                if tail:
                    with open(self.path, "rb") as source:
                        if os.fstat(source.fileno()).st_ino != self._inode:
                            raise OSError(f"{self.path} was replaced by something else")
                        source.seek(self._offset)
                        remaining = tail
                        while remaining:
                            chunk = source.read(min(_CHUNK, remaining))
                            if not chunk:
                                raise OSError(f"{self.path} was truncated by something else")
                            out.write(chunk)
                            remaining -= len(chunk)
                out.flush()
                os.fsync(out.fileno())
                inode = os.fstat(out.fileno()).st_ino
            os.replace(self._tmp_path, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._tmp_path.unlink(missing_ok=True)
            self._fault("compact", f"cannot rewrite {self.path}: {exc}")
            return False
        self._fsync_directory()
        self._inode = inode
        self._size = tail
        self._offset = 0
        self._head = None
        self._clear("compact")
        self._write_offset()
        return True

    def _fsync_directory(self) -> None:
        with contextlib.suppress(OSError):
            fd = os.open(self._directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _scan(handle: BinaryIO, offset: int) -> tuple[int, int, int]:
    """(end of the last complete line, size, complete lines from offset on), reading a chunk at a time."""
    end = position = pending = 0
    while chunk := handle.read(_CHUNK):
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            end = position + newline + 1
        if position + len(chunk) > offset:
            pending += chunk.count(b"\n", max(0, offset - position))
        position += len(chunk)
    return end, position, pending


def open_spool(directory: Path | None, name: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Spool:
    return FileSpool(directory, name, max_bytes) if directory is not None else MemorySpool()
