"""Follow /dev/kmsg: the kernel's ring buffer history first (a fresh open starts at the oldest record kept),
then new records. Each read returns one record; its sequence number identifies it for the finding id."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

from node_probe.findings import record_position
from node_probe.source import LineAssembler, Observation, SourceStatus

log = logging.getLogger(__name__)

KMSG_PATH = Path("/dev/kmsg")
# Larger than the kernel's longest record (CONSOLE_EXT_LOG_MAX is 8 KiB), so a read never truncates one.
READ_BYTES = 16 * 1024


class KmsgSource:
    def __init__(self, path: Path = KMSG_PATH, poll_interval: float = 0.5) -> None:
        self.path = path
        self.name = "kmsg" if path == KMSG_PATH else f"kmsg:{path}"
        self._poll = poll_interval
        self._status = SourceStatus.down(f"{path}: not read yet")

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

    async def observations(self) -> AsyncIterator[Observation]:
        while True:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError as exc:
                self._status = SourceStatus.down(f"{self.path}: {exc.strerror or exc}")
                await asyncio.sleep(self._poll)
                continue
            self._status = SourceStatus.ok()
            try:
                async for observation in self._follow(fd):
                    yield observation
            finally:
                os.close(fd)
            await asyncio.sleep(self._poll)

    async def _follow(self, fd: int) -> AsyncIterator[Observation]:
        lines = LineAssembler()
        while True:
            try:
                chunk = os.read(fd, READ_BYTES)
            except BlockingIOError:
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
                await asyncio.sleep(self._poll)
                continue
            for record in lines.feed(chunk):
                yield Observation(record, self.name, record_position(record))
            await asyncio.sleep(0)
