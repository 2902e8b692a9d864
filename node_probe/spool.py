"""Findings waiting for delivery, oldest first. While Temporal is unreachable they wait here; a file spool
also survives a probe restart. Memory holds at most the head, whatever the backlog.

File layout under the spool dir: `<instance>.findings.jsonl` (append-only JSON lines) and `<instance>.offset`
(bytes of it already delivered, replaced atomically). When everything is delivered both are reset to empty.
"""

from __future__ import annotations

import logging
import os
import re
from collections import deque
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from workflows.models import GpuFinding

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_ITEMS = 10_000


class Spool(Protocol):
    def append(self, finding: GpuFinding) -> bool:
        """False when the finding was dropped because the spool is full (never for impairing findings)."""
        ...

    def peek(self) -> GpuFinding | None: ...

    def pop(self) -> None: ...

    def __len__(self) -> int: ...


class MemorySpool:
    """Not durable: for probes configured without a spool dir (e.g. the demo's simulated instances)."""

    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        self._items: deque[GpuFinding] = deque()
        self._max_items = max_items

    def append(self, finding: GpuFinding) -> bool:
        # When full, warnings give way: losing one costs a count, losing an impairing finding costs a repair.
        if len(self._items) >= self._max_items and not finding.impairs:
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
    def __init__(self, directory: Path, name: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name) or "probe"
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{safe}.findings.jsonl"
        self._offset_path = directory / f"{safe}.offset"
        self._max_bytes = max_bytes
        self._head: tuple[GpuFinding, int] | None = None
        self.path.touch(exist_ok=True)
        self._repair_tail()
        self._offset = min(self._read_offset(), self.path.stat().st_size)
        self._pending = self._count_pending()

    def _repair_tail(self) -> None:
        """A crash mid-append leaves a partial last line; cut it so the next append starts a clean line."""
        with open(self.path, "rb+") as handle:
            data = handle.read()
            if data and not data.endswith(b"\n"):
                handle.truncate(data.rfind(b"\n") + 1)

    def _read_offset(self) -> int:
        try:
            return int(self._offset_path.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _write_offset(self, offset: int) -> None:
        tmp = self._offset_path.with_suffix(".offset.tmp")
        tmp.write_text(str(offset))
        os.replace(tmp, self._offset_path)

    def _count_pending(self) -> int:
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            return sum(1 for _ in handle)

    def append(self, finding: GpuFinding) -> bool:
        line = finding.model_dump_json().encode() + b"\n"
        if self.path.stat().st_size + len(line) > self._max_bytes and not finding.impairs:
            log.warning("spool %s full: dropped warning finding %s", self.path, finding.reason)
            return False
        with open(self.path, "ab") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        self._pending += 1
        return True

    def peek(self) -> GpuFinding | None:
        while self._head is None and self._pending:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                line = handle.readline()
            if not line.endswith(b"\n"):
                return None
            try:
                self._head = (GpuFinding.model_validate_json(line), len(line))
            except ValidationError as exc:
                log.error("spool %s: skipping an unreadable entry: %s", self.path, exc)
                self._advance(len(line))
        return self._head[0] if self._head is not None else None

    def pop(self) -> None:
        if self._head is None and self.peek() is None:
            return
        assert self._head is not None
        self._advance(self._head[1])
        self._head = None

    def _advance(self, nbytes: int) -> None:
        self._offset += nbytes
        self._pending -= 1
        if self._pending <= 0:
            # All delivered: start the file over so it never grows past one outage's worth.
            with open(self.path, "wb"):
                pass
            self._offset = 0
            self._pending = 0
        self._write_offset(self._offset)

    def __len__(self) -> int:
        return self._pending


def open_spool(directory: Path | None, name: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Spool:
    return FileSpool(directory, name, max_bytes) if directory is not None else MemorySpool()
