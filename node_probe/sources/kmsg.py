"""Follow /dev/kmsg: the kernel's ring buffer history first (a fresh open starts at the oldest record kept),
then new records. Each read returns one record; its sequence number identifies it for the finding id.

With a cursor (the probe has a spool dir), a probe restarted within the same boot skips the records up to the last
sequence number it handled: /dev/kmsg cannot seek to a sequence number, so the history is still read, but its old
records are not sent again. Sequence numbers restart at boot, so a cursor from another boot is ignored.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

from node_probe import host
from node_probe.classify.context import RecentLines
from node_probe.classify.findings import record_position
from node_probe.delivery.cursor import CursorStore, KmsgCursor
from node_probe.sources.base import LineAssembler, Observation, SourceStatus, source_name

log = logging.getLogger(__name__)

KMSG_PATH = Path("/dev/kmsg")
# Larger than the kernel's longest record (CONSOLE_EXT_LOG_MAX is 8 KiB), so a read never truncates one.
READ_BYTES = 16 * 1024


class KmsgSource:
    def __init__(
        self,
        path: Path = KMSG_PATH,
        poll_interval: float = 0.5,
        cursor: CursorStore[KmsgCursor] | None = None,
        boot_id: str | None = None,  # this boot's; None reads it from the host
    ) -> None:
        self.path = path
        self.name = source_name("kmsg", None if path == KMSG_PATH else path)
        self.recent = RecentLines()  # for an impairing fault's context
        self._poll = poll_interval
        self._status = SourceStatus.down(f"{path}: not read yet")
        self._cursor = cursor
        self._boot_id = boot_id
        self._seq: int | None = None  # the last sequence number handled, with a cursor

    @property
    def status(self) -> SourceStatus:
        return self._status

    def check(self) -> SourceStatus:
        try:
            os.close(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK))
            self._status = SourceStatus.ok()
        except OSError as exc:
            self._status = SourceStatus.down(f"{self.path}: {exc.strerror or exc}")
        return self._status

    def _load_cursor(self) -> CursorStore[KmsgCursor] | None:
        """The cursor to keep, and the sequence number to skip up to; none when this boot cannot be told apart."""
        if self._cursor is None:
            return None
        boot = self._boot_id if self._boot_id is not None else host.boot_id()
        if not boot:
            log.warning("%s: no boot id; reading the whole ring buffer after each restart", self.path)
            return None
        self._boot_id = boot
        saved = self._cursor.load()
        if saved is not None and (saved.path, saved.boot_id) == (str(self.path), boot):
            self._seq = saved.seq
            log.info("%s: skipping records up to sequence number %d, handled before the restart", self.path, saved.seq)
        return self._cursor

    def _save(self, cursor: CursorStore[KmsgCursor] | None) -> None:
        """Called only between reads: everything yielded before has been consumed (spooled) by then."""
        if cursor is not None and self._seq is not None and self._boot_id:
            cursor.update(KmsgCursor(path=str(self.path), boot_id=self._boot_id, seq=self._seq))

    async def observations(self) -> AsyncIterator[Observation]:
        cursor = self._load_cursor()
        while True:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError as exc:
                self._status = SourceStatus.down(f"{self.path}: {exc.strerror or exc}")
                await asyncio.sleep(self._poll)
                continue
            self._status = SourceStatus.ok()
            try:
                async for observation in self._follow(fd, cursor):
                    yield observation
            finally:
                os.close(fd)
            await asyncio.sleep(self._poll)

    async def _follow(self, fd: int, cursor: CursorStore[KmsgCursor] | None) -> AsyncIterator[Observation]:
        lines = LineAssembler(self.recent)
        while True:
            self._save(cursor)
            try:
                chunk = os.read(fd, READ_BYTES)
            except BlockingIOError:
                if cursor is not None:
                    cursor.flush()
                await asyncio.sleep(self._poll)
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    # Unread records were overwritten in the ring buffer; the next read continues after them.
                    log.warning("%s: some kernel log records were overwritten before they were read", self.path)
                    continue
                self._status = SourceStatus.down(f"{self.path}: {exc.strerror or exc}")
                return
            if not chunk:
                # A regular file standing in for /dev/kmsg (tests, replays) ends; the device never does.
                if cursor is not None:
                    cursor.flush()
                await asyncio.sleep(self._poll)
                continue
            for record in lines.feed(chunk):
                seq = record.kmsg_seq
                if cursor is not None and seq is not None:
                    if self._seq is not None and seq <= self._seq:
                        continue
                    self._seq = seq
                yield Observation(record, self.name, record_position(record))
            await asyncio.sleep(0)
