"""Where a log source stopped reading, kept under the probe's spool dir so that a restarted probe continues there
instead of re-reading (and re-sending) the whole history.

One small JSON file per source, `<instance>.<source>.cursor`, replaced atomically. A cursor says how far the
source's records have been handled, i.e. put into the spool, so it only exists together with a file spool: without
one a restart loses the undelivered findings anyway and re-reading the history is what recovers them. A cursor that
cannot be read (corrupt, from another layout) means "start from the beginning": that costs time and duplicate ids,
which the health workflow drops, never a missed fault.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from pydantic import BaseModel, Field, ValidationError

log = logging.getLogger(__name__)

# Each write is fsynced: while a long history is read, a write per chunk would cost more than the reading.
DEFAULT_MIN_INTERVAL_S = 1.0


class FileCursor(BaseModel):
    """A kernel-log file: the end of the last complete line handled."""

    path: str
    inode: int
    offset: int = Field(ge=0)  # bytes
    line: int = Field(ge=0)  # lines up to `offset`; the next line is number line + 1
    # Digest of the (up to TAIL_BYTES) bytes before `offset`: a file truncated and grown again past `offset`
    # while the probe was down, or a new file on a recycled inode, keeps the inode and size but not these.
    tail: str


class KmsgCursor(BaseModel):
    """/dev/kmsg: sequence numbers restart with each boot, so they only mean something together with the boot id."""

    path: str
    boot_id: str
    seq: int


M = TypeVar("M", bound=BaseModel)


class CursorStore(Generic[M]):
    """One source's cursor file. `update` is cheap to call before every read: it writes only when the cursor changed
    and at most once per `min_interval` seconds; `flush` writes what is left, for when the source has caught up."""

    def __init__(
        self,
        path: Path,
        model: type[M],
        *,
        min_interval: float = DEFAULT_MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        spooled: Callable[[], bool] = lambda: True,
    ) -> None:
        """`spooled` says whether everything the source handled is on disk in the spool: while a disk error keeps
        findings in memory only, the cursor stays behind them, so a restart reads them again instead of losing
        them."""
        self.path = path
        self._model = model
        self._min_interval = min_interval
        self._clock = clock
        self._spooled = spooled
        self._latest: M | None = None
        self._written: M | None = None
        self._written_at = -math.inf
        self._failing = False
        self.writes = 0

    def load(self) -> M | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read cursor %s (%s); reading the log from the start", self.path, exc)
            return None
        try:
            cursor = self._model.model_validate_json(data)
        except ValidationError as exc:
            log.warning("corrupt cursor %s (%s); reading the log from the start", self.path, exc)
            return None
        self._latest = self._written = cursor
        return cursor

    def update(self, cursor: M) -> None:
        self._latest = cursor
        if cursor != self._written and self._clock() - self._written_at >= self._min_interval and self._spooled():
            self._write(cursor)

    def flush(self) -> None:
        if self._latest is not None and self._latest != self._written and self._spooled():
            self._write(self._latest)

    def _write(self, cursor: M) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as handle:
                handle.write(cursor.model_dump_json().encode())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            # The probe goes on without it: a stale cursor only means re-reading more after a restart.
            if not self._failing:
                log.warning("cannot write cursor %s: %s", self.path, exc)
            self._failing = True
            return
        if self._failing:
            log.info("cursor %s written again", self.path)
        self._failing = False
        self._written = cursor
        self._written_at = self._clock()
        self.writes += 1
        self._sync_directory()

    def _sync_directory(self) -> None:
        """Make the rename itself durable; best effort (not every filesystem lets a directory be opened)."""
        with contextlib.suppress(OSError):
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def cursor_path(directory: Path, instance: str, source: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", instance) or "probe"
    return directory / f"{safe}.{source}.cursor"


def open_cursor(
    directory: Path | None,
    instance: str,
    source: str,
    model: type[M],
    spooled: Callable[[], bool],
) -> CursorStore[M] | None:
    """None without a spool dir (see the module docstring); `spooled` as for CursorStore."""
    if directory is None:
        return None
    return CursorStore(cursor_path(directory, instance, source), model, spooled=spooled)
