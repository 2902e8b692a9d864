"""Follow a kernel log file like `tail -F`: the existing history first, then what is appended, across rotation
(a new file at the path) and truncation (copytruncate).

With a cursor (the probe has a spool dir), a restarted probe continues after the last complete line it handled
instead of re-reading the history: the cursor keeps the file's inode, that line's end offset and line number, so
finding ids stay what an uninterrupted probe would give. A file rotated or truncated since is read from the start.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from node_probe.classify.context import RecentLines
from node_probe.classify.record import FaultRecord
from node_probe.delivery.cursor import CursorStore, FileCursor
from node_probe.sources.base import LineAssembler, Observation, SourceStatus, source_name

log = logging.getLogger(__name__)

# 64 KiB: a storm read in 1 MiB chunks held ~9,000 records per chunk at once, enough to push the probe past 100 MB.
CHUNK_BYTES = 64 << 10
# Enough to tell one file's content from another's at the cursor (see FileCursor.tail).
TAIL_BYTES = 64


_COMPRESSED = frozenset({".gz", ".xz", ".bz2", ".zst", ".lz4"})


def _digest(tail: bytes) -> str:
    return hashlib.sha256(tail).hexdigest()[:32]


def _tail_if_cursor_fits(handle: BinaryIO, saved: FileCursor) -> bytes | None:
    """The bytes before the cursor when this file holds them as the cursor saw them; None otherwise."""
    if os.fstat(handle.fileno()).st_size < saved.offset:
        return None
    start = max(0, saved.offset - TAIL_BYTES)
    handle.seek(start)
    tail = handle.read(saved.offset - start)
    return tail if _digest(tail) == saved.tail else None


def _line_start(data: bytes, lines: int) -> int:
    """The offset in `data` after its first `lines` lines."""
    offset = 0
    for _ in range(lines):
        offset = data.index(b"\n", offset) + 1
    return offset


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


class _ResumableLines(LineAssembler):
    """A LineAssembler that knows where its complete lines end, so a cursor can resume there, and that numbers
    lines from where it resumed."""

    def __init__(self, offset: int = 0, line: int = 0, tail: bytes = b"", recent: RecentLines | None = None) -> None:
        super().__init__(recent)
        self._first_line = line
        self._end = offset
        self._tail = tail
        self._banner: tuple[int, int, bytes] | None = None  # where the last banner's first line starts

    def feed(self, chunk: bytes) -> list[FaultRecord]:
        data = self.partial + chunk
        lines_before, end_before, tail_before = self.parser.lines_seen, self._end, self._tail
        records = super().feed(chunk)
        complete = data[: len(data) - len(self.partial)]  # starts at a line start: the old partial is in it
        self._end += len(complete)
        self._tail = (self._tail + complete[-TAIL_BYTES:])[-TAIL_BYTES:]
        pending = self.parser.pending_banner_line
        if pending is None:
            self._banner = None
        elif pending > lines_before:
            # The banner began in this chunk: remember where its first line starts, to resume there.
            start = _line_start(complete, pending - lines_before - 1)
            tail = (tail_before + complete[max(0, start - TAIL_BYTES) : start])[-TAIL_BYTES:]
            self._banner = (end_before + start, self._first_line + pending - 1, tail)
        if self._first_line:
            records = [record._replace(line=record.line + self._first_line) for record in records]
        return records

    def resume_point(self) -> tuple[int, int, bytes]:
        """(offset, line, tail) after the last complete line; but before a banner's first line while the record
        it may become has not come (`KernelLogParser.pending_banner_line`). Records after it are then read again
        after a restart, with the same ids."""
        if self._banner is not None:
            return self._banner
        line = self._first_line + self.parser.lines_seen
        return self._end, line, self._tail


class KernelLogFileSource:
    def __init__(self, path: Path, poll_interval: float = 0.5, cursor: CursorStore[FileCursor] | None = None) -> None:
        self.path = path
        self.name = source_name("kernel_log", path)
        self.recent = RecentLines()  # every generation's lines, for an impairing fault's context
        self._poll = poll_interval
        self._status = SourceStatus.down(f"kernel log {path}: not read yet")
        self._cursor = cursor
        self._position: FileCursor | None = None
        self._loaded = False

    @property
    def status(self) -> SourceStatus:
        return self._status

    def check(self) -> SourceStatus:
        try:
            with open(self.path, "rb"):
                pass
            self._status = SourceStatus.ok()
        except OSError as exc:
            self._status = SourceStatus.down(self._describe(exc))
        return self._status

    def _describe(self, exc: OSError) -> str:
        return f"kernel log {self.path}: {exc.strerror or exc}"

    def _open(self) -> BinaryIO | None:
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 - held across awaits, closed by the caller
        except OSError as exc:
            if self._status.is_ok or self._status.reason != self._describe(exc):
                log.warning("cannot read %s: %s", self.path, exc)
            self._status = SourceStatus.down(self._describe(exc))
            return None
        self._status = SourceStatus.ok()
        return handle

    async def observations(self) -> AsyncIterator[Observation]:
        if self._cursor is not None and not self._loaded:
            self._position = self._cursor.load()
            self._loaded = True
            async for observation in self._rest_of_rotated_file():
                yield observation
        while True:
            handle = self._open()
            if handle is None:
                await asyncio.sleep(self._poll)
                continue
            with handle:
                async for observation in self._follow(handle):
                    yield observation

    def _start(self, handle: BinaryIO, inode: int) -> _ResumableLines:
        """Where to read this file from: after the cursor when it is this file as the cursor left it, else the
        start."""
        saved = self._position
        if saved is None or saved.offset == 0:
            return _ResumableLines(recent=self.recent)
        if saved.path != str(self.path) or saved.inode != inode:
            log.info("%s is not the file the cursor was saved for (rotated?); reading it from the start", self.path)
            return _ResumableLines(recent=self.recent)
        tail = _tail_if_cursor_fits(handle, saved)
        if tail is None:
            log.info("%s changed since the cursor was saved (truncated?); reading it from the start", self.path)
            handle.seek(0)
            return _ResumableLines(recent=self.recent)
        log.info("%s: resuming after line %d (byte %d)", self.path, saved.line, saved.offset)
        return _ResumableLines(saved.offset, saved.line, tail, self.recent)

    async def _rest_of_rotated_file(self) -> AsyncIterator[Observation]:
        """After a restart: if the log was rotated while the probe was down, the lines the cursor had not reached
        are in the rotated file (kern.log.1, renamed or copied by copytruncate), not at the path. Read them first,
        with the ids of the generation the cursor was in; the file at the path is then read from its start."""
        saved = self._position
        if saved is None or saved.offset == 0 or saved.path != str(self.path) or self._cursor_fits_path(saved):
            return
        rotated = self._find_rotated(saved)
        if rotated is None:
            log.warning(
                "%s was rotated or truncated while the probe was down, and no rotated file continues where it "
                "stopped (line %d): lines written to the old file after that are not read",
                self.path,
                saved.line,
            )
            return
        log.info("%s was rotated while the probe was down: reading the rest of %s first", self.path, rotated)
        try:
            with open(rotated, "rb") as handle:
                handle.seek(saved.offset)
                lines = _ResumableLines(saved.offset, saved.line, recent=self.recent)
                while chunk := handle.read(CHUNK_BYTES):
                    for record in lines.feed(chunk):
                        yield Observation(record, self.name, f"ino:{saved.inode}:line:{record.line}")
                    await asyncio.sleep(0)
                for record in lines.feed(b"\n"):  # a last line without its newline: the writer has moved on
                    yield Observation(record, self.name, f"ino:{saved.inode}:line:{record.line}")
        except OSError as exc:
            log.warning("cannot read the rotated %s: %s", rotated, exc)
        # Not saved as a cursor: a crash while reading it reads it again, with the same ids.
        self._position = None

    def _cursor_fits_path(self, saved: FileCursor) -> bool:
        try:
            with open(self.path, "rb") as handle:
                same_file = os.fstat(handle.fileno()).st_ino == saved.inode
                return same_file and _tail_if_cursor_fits(handle, saved) is not None
        except OSError:
            return False  # missing now: moved away by logrotate and not yet recreated

    def _find_rotated(self, saved: FileCursor) -> Path | None:
        """The rotated file holding the cursor's generation: same inode (renamed), or same bytes before the
        cursor (copied). Newest first; compressed ones cannot be followed and are left out."""
        try:
            siblings = [
                path
                for path in self.path.parent.iterdir()
                if path.name.startswith((f"{self.path.name}.", f"{self.path.name}-"))
                and path.suffix not in _COMPRESSED
                and path.is_file()
            ]
        except OSError:
            return None
        for path in sorted(siblings, key=_mtime, reverse=True):
            try:
                with open(path, "rb") as handle:
                    if os.fstat(handle.fileno()).st_ino == saved.inode or _tail_if_cursor_fits(handle, saved):
                        return path
            except OSError:
                continue
        return None

    def _save(self, lines: _ResumableLines, inode: int) -> None:
        """Called only between reads: everything yielded before has been consumed (spooled) by then."""
        if self._cursor is None:
            return
        offset, line, tail = lines.resume_point()
        self._position = FileCursor(path=str(self.path), inode=inode, offset=offset, line=line, tail=_digest(tail))
        self._cursor.update(self._position)

    async def _follow(self, handle: BinaryIO) -> AsyncIterator[Observation]:
        """Read one file generation; return when the path names another file (rotation)."""
        inode = os.fstat(handle.fileno()).st_ino
        lines = self._start(handle, inode) if self._cursor is not None else _ResumableLines(recent=self.recent)
        while True:
            self._save(lines, inode)
            try:
                chunk = handle.read(CHUNK_BYTES)
            except OSError as exc:
                self._status = SourceStatus.down(self._describe(exc))
                return
            if chunk:
                for record in lines.feed(chunk):
                    # The inode tells generations apart: line numbers restart in a new file, ids must not.
                    yield Observation(record, self.name, f"ino:{inode}:line:{record.line}")
                # Let heartbeats and delivery run while a long history is being read.
                await asyncio.sleep(0)
                continue
            if self._cursor is not None:
                self._cursor.flush()
            try:
                stat = os.stat(self.path)
            except OSError as exc:
                # Moved away and not yet recreated (logrotate): keep the old handle, but we see nothing new.
                self._status = SourceStatus.down(self._describe(exc))
                await asyncio.sleep(self._poll)
                continue
            if stat.st_ino != inode:
                # Rotated. The writer may have added to the old file between our read and the stat: drain it.
                for record in lines.feed(handle.read() + b"\n"):
                    yield Observation(record, self.name, f"ino:{inode}:line:{record.line}")
                return
            if stat.st_size < handle.tell():
                log.info("%s was truncated; reading it from the start", self.path)
                handle.seek(0)
                lines = _ResumableLines(recent=self.recent)
            self._status = SourceStatus.ok()
            await asyncio.sleep(self._poll)
