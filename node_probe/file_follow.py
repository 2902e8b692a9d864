"""Follow a kernel log file like `tail -F`: the existing history first, then what is appended, across rotation
(a new file at the path) and truncation (copytruncate)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from node_probe.source import LineAssembler, Observation, SourceStatus

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


class KernelLogFileSource:
    def __init__(self, path: Path, poll_interval: float = 0.5) -> None:
        self.path = path
        self.name = f"kernel_log:{path}"
        self._poll = poll_interval
        self._status = SourceStatus.down(f"kernel log {path}: not read yet")

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
        while True:
            handle = self._open()
            if handle is None:
                await asyncio.sleep(self._poll)
                continue
            with handle:
                async for observation in self._follow(handle):
                    yield observation

    async def _follow(self, handle: BinaryIO) -> AsyncIterator[Observation]:
        """Read one file generation; return when the path names another file (rotation)."""
        inode = os.fstat(handle.fileno()).st_ino
        lines = LineAssembler()
        while True:
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
                lines = LineAssembler()
            self._status = SourceStatus.ok()
            await asyncio.sleep(self._poll)
