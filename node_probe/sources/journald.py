"""Follow the kernel's entries in the systemd journal: `journalctl -k -o json --follow`, this boot's history first,
then new entries, for hosts where the kernel log lives in journald rather than in a file.

Each JSON entry's MESSAGE is fed to one KernelLogParser for the life of the source (across journalctl restarts), as
`[<seconds since boot>] <MESSAGE>` so that the record gets its uptime as from dmesg; the three entries of the "fallen
off the bus" banner then join into one record. The journal cursor of the entry that completes a record is its
position, so finding ids are stable across restarts.

A journalctl that exits is restarted after the poll interval with `--after-cursor` (the last entry handled), so its
death loses and repeats nothing; until then the source is down. With a cursor store (the probe has a spool dir), a
restarted probe continues after the last entry it handled in this boot, or before a banner not yet complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from node_probe import host
from node_probe.classify.context import RecentLines
from node_probe.classify.findings import record_position
from node_probe.classify.kernel_log import KernelLogParser
from node_probe.classify.record import FaultRecord
from node_probe.delivery.cursor import CursorStore
from node_probe.sources.base import Observation, SourceStatus, TrackedStatus, source_name

log = logging.getLogger(__name__)

SOURCE_NAME = "journald"
# `--no-tail`: with --follow, journalctl would otherwise start at the last 10 entries, even after a cursor.
# `--all`: without it, JSON output replaces fields over 4 KiB by null. No --output-fields: systemd < 236 (Amazon
# Linux 2) rejects it, and a kernel entry has few fields anyway.
JOURNALCTL_ARGS = ("-k", "-o", "json", "--no-pager", "--follow", "--no-tail", "--all")
# A kernel message is at most ~1 KiB, but a byte-array MESSAGE takes up to 4 characters per byte in JSON, and
# --all keeps every field of the entry whole.
LINE_LIMIT = 4 << 20
# A journalctl that fails (bad cursor, unreadable journal) exits within milliseconds: only one that has stayed up
# this long, or printed an entry, makes the source OK, so a restart loop does not look healthy between its tries.
STARTED_AFTER_S = 1.0
# Let heartbeats and delivery run while a long history is read, without paying a loop turn per entry.
_YIELD_EVERY = 256
# journalctl's notice, on stderr, when it finds no journal at all (it keeps running): e.g. a containerised probe
# without the host's /var/log/journal and /run/log/journal mounted. It would see nothing, so it is not OK.
_NO_FILES = "No journal files were found"
_REAP_TIMEOUT_S = 5.0


class JournalCursor(BaseModel):
    """journald: where to continue (`--after-cursor`). Cursors of another boot are not used: `-k` reads this boot
    only, and seeking to an old boot's place could skip this boot's entries that sort before it (clock changes)."""

    cursor: str
    boot_id: str  # journald's spelling: 32 hex digits, no dashes


def _plain_boot_id(boot_id: str) -> str:
    return boot_id.replace("-", "").lower()


def _message(value: Any) -> str | None:
    """MESSAGE is a string, a list of byte values when it is not valid UTF-8 (or has control characters), or a list
    of such values when the entry has the field more than once."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if all(isinstance(item, int) for item in value):
            try:
                return bytes(value).decode("utf-8", "replace")
            except ValueError:  # not byte values
                return None
        parts = [_message(item) for item in value]
        return "\n".join(part for part in parts if part is not None)
    return None  # null: a field journalctl did not print


def _uptime_prefix(entry: dict[str, Any]) -> str:
    """dmesg's `[seconds.micro] `. _SOURCE_MONOTONIC_TIMESTAMP is the kernel's own timestamp of the record;
    __MONOTONIC_TIMESTAMP is when journald received it, which for the boot's early records is much later."""
    for key in ("_SOURCE_MONOTONIC_TIMESTAMP", "__MONOTONIC_TIMESTAMP"):
        value = entry.get(key)
        if isinstance(value, str) and value.isdigit():
            usec = int(value)
            return f"[{usec // 1_000_000}.{usec % 1_000_000:06d}] "
    return ""


class JournaldSource(TrackedStatus):
    def __init__(
        self,
        poll_interval: float = 0.5,
        cursor: CursorStore[JournalCursor] | None = None,
        *,
        journalctl: str = "journalctl",
        directory: Path | None = None,  # read journal files there (`--directory`) instead of the system journal
        boot_id: str | None = None,  # this boot's; None reads it from the host
    ) -> None:
        super().__init__(f"{SOURCE_NAME}: not read yet")
        self.name = source_name(SOURCE_NAME, directory)
        self.entries = 0  # journal entries handled since the source started
        self._poll = poll_interval
        self._cursor = cursor
        self._journalctl = journalctl
        self._directory = directory
        self._boot_id = boot_id
        # One parser for the life of the source: a banner's entries may straddle a journalctl restart.
        self.recent = RecentLines()  # for an impairing fault's context
        self._parser = KernelLogParser(recent=self.recent)
        self._last: str | None = None  # cursor of the last entry handled: a restarted journalctl continues after it
        self._last_boot: str | None = None
        self._banner: tuple[str | None, int] | None = None  # cursor before a banner's first entry, that line's number
        self._loaded = False
        self._blind = False  # journalctl said it found no journal files, and no entry has come since

    def argv(self) -> list[str]:
        argv = [self._journalctl, *JOURNALCTL_ARGS]
        if self._directory is not None:
            argv.append(f"--directory={self._directory}")
        if self._last is not None:
            argv.append(f"--after-cursor={self._last}")
        return argv

    def check(self) -> SourceStatus:
        if shutil.which(self._journalctl) is None:
            self._set_down(self._not_found())
        elif self._directory is not None and not self._directory.is_dir():
            self._set_down(f"{SOURCE_NAME}: {self._directory}: no such directory")
        else:
            self._mark_ok()
        return self.status

    def _not_found(self) -> str:
        return f"{SOURCE_NAME}: {self._journalctl} not found"

    def _load_cursor(self) -> None:
        if self._loaded or self._cursor is None:
            return
        self._loaded = True
        saved = self._cursor.load()
        if saved is None:
            return
        boot = _plain_boot_id(self._boot_id if self._boot_id is not None else host.boot_id())
        if not boot:
            log.warning("%s: no boot id; reading this boot's kernel entries after each restart", self.name)
        elif _plain_boot_id(saved.boot_id) != boot:
            log.info("%s: the cursor is from another boot; reading this boot's kernel entries", self.name)
        else:
            self._last, self._last_boot = saved.cursor, saved.boot_id
            log.info("%s: continuing after the entry handled before the restart", self.name)

    def _resume_point(self) -> str | None:
        """The last entry handled; but before a banner's first entry while the record it may become has not come:
        the parser holds those entries in memory only, and a cursor past them would lose the banner on a restart.
        Entries after it are then read again after a restart, and give the same ids."""
        return self._banner[0] if self._banner is not None else self._last

    def _save(self) -> None:
        """Called only between reads: everything yielded before has been consumed (spooled) by then."""
        if self._cursor is None:
            return
        resume = self._resume_point()
        if resume is not None and self._last_boot:
            self._cursor.update(JournalCursor(cursor=resume, boot_id=self._last_boot))

    async def observations(self) -> AsyncIterator[Observation]:
        self._load_cursor()
        while True:
            proc = await self._start()
            if proc is not None:
                try:
                    async for observation in self._follow(proc):
                        yield observation
                finally:
                    await _stop(proc)
            await asyncio.sleep(self._poll)

    async def _start(self) -> asyncio.subprocess.Process | None:
        try:
            return await asyncio.create_subprocess_exec(
                *self.argv(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                limit=LINE_LIMIT,
            )
        except FileNotFoundError:
            self._set_down(self._not_found())
        except OSError as exc:
            self._set_down(f"{SOURCE_NAME}: {self._journalctl}: {exc.strerror or exc}")
        return None

    def _started(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None and not self._blind:
            self._mark_ok(f"{self.name}: reading the journal")

    async def _drain(self, stream: asyncio.StreamReader, into: list[str]) -> None:
        """Read journalctl's stderr (a full pipe would stall it), keeping the last non-empty line."""
        while True:
            try:
                line = await stream.readline()
            except ValueError:
                continue
            if not line:
                return
            text = host.first_line(line.decode("utf-8", "replace"))
            if not text:
                continue
            log.debug("journalctl: %s", text)
            into[:] = [text]
            if _NO_FILES in text:
                self._blind = True
                self._set_down(f"{SOURCE_NAME}: {text}")

    async def _follow(self, proc: asyncio.subprocess.Process) -> AsyncIterator[Observation]:
        """Until journalctl exits; then the source is down, with journalctl's last word as the reason."""
        assert proc.stdout is not None and proc.stderr is not None
        after_cursor = self._last is not None
        stderr: list[str] = []
        self._blind = False
        drain = asyncio.create_task(self._drain(proc.stderr, stderr))
        started = asyncio.get_running_loop().call_later(STARTED_AFTER_S, self._started, proc)
        try:
            since_yield = 0
            while True:
                self._save()
                try:
                    async with asyncio.timeout(self._poll):
                        line = await proc.stdout.readline()
                except TimeoutError:
                    # Caught up: nothing new for a poll interval.
                    if self._cursor is not None:
                        self._cursor.flush()
                    continue
                except ValueError:
                    log.warning("%s: skipping an entry longer than %d bytes", self.name, LINE_LIMIT)
                    continue
                if not line:
                    break
                self._blind = False
                self._started(proc)
                for observation in self._handle(line):
                    yield observation
                since_yield += 1
                if since_yield >= _YIELD_EVERY:
                    since_yield = 0
                    await asyncio.sleep(0)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_REAP_TIMEOUT_S):
                    await proc.wait()
                    await drain
        finally:
            started.cancel()
            drain.cancel()
        last = stderr[-1] if stderr else ""
        returncode = proc.returncode
        if returncode is None:  # closed its output but lives on: _stop ends it
            how = "closed its output"
        elif returncode < 0:
            how = f"killed by signal {-returncode}"
        else:
            how = f"exited with status {returncode}"
        self._set_down(f"{SOURCE_NAME}: journalctl {how}" + (f": {last}" if last else ""))
        if after_cursor and returncode and returncode > 0 and "cursor" in last.lower():
            # A cursor journalctl cannot seek to (corrupt, another journal's): read the boot from the start.
            # That repeats findings (same ids, dropped by the workflow); it never misses one.
            log.warning("%s: journalctl rejected the cursor; reading this boot's kernel entries again", self.name)
            self._last = None
            self._banner = None

    def _handle(self, line: bytes) -> list[Observation]:
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if not isinstance(entry, dict):
            log.warning("%s: skipping output that is not a journal entry: %r", self.name, line[:200])
            return []
        self.entries += 1
        message = _message(entry.get("MESSAGE"))
        cursor = entry.get("__CURSOR")
        cursor = cursor if isinstance(cursor, str) and cursor else None
        records: list[FaultRecord] = []
        if message is not None:
            prefix = _uptime_prefix(entry)
            for text in message.split("\n"):
                records.extend(self._parser.feed(prefix + text))
        pending = self._parser.pending_banner_line
        if pending is None:
            self._banner = None
        elif self._banner is None or self._banner[1] != pending:
            self._banner = (self._last, pending)  # the banner began in this entry: resume before it
        if cursor is not None:
            self._last = cursor
            boot = entry.get("_BOOT_ID")
            if isinstance(boot, str) and boot:
                self._last_boot = boot
            elif self._last_boot is None:
                self._last_boot = self._host_boot()
        observations = []
        for record in records:
            position = f"journal:{cursor}" if cursor is not None else record_position(record)
            observations.append(Observation(record, self.name, position))
        return observations

    def _host_boot(self) -> str | None:
        boot = _plain_boot_id(self._boot_id if self._boot_id is not None else host.boot_id())
        return boot or None


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_REAP_TIMEOUT_S):
            await proc.wait()
