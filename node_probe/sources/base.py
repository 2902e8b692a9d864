"""What every record source of the probe looks like (kernel log file, /dev/kmsg, journald, NVML, DCGM, daemons).

A source says whether it can currently see the GPUs (`status`) and yields records as they appear. The probe
reports INSUFFICIENT_DATA while any configured GPU source is down: what only that source sees could be missed,
so the GPUs are not known to be OK, and a source being down never impairs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from contract.health import HealthState
from contract.limits import MAX_NAME
from node_probe.classify.context import RecentLines
from node_probe.classify.kernel_log import KernelLogParser
from node_probe.classify.record import FaultRecord

log = logging.getLogger(__name__)

# A line without a newline this long is cut, so a writer that never ends its line cannot grow memory.
MAX_LINE_BYTES = 64 * 1024


def source_name(kind: str, path: object | None = None) -> str:
    """A source's name, e.g. "kernel_log:/var/log/kern.log", as findings and heartbeats can carry it: a path may be
    longer than any name may be (MAX_NAME), and a name the probe cannot send is a probe that stops. The end of a path
    tells files apart: kept."""
    if path is None:
        return kind
    name = f"{kind}:{path}"
    if len(name) <= MAX_NAME:
        return name
    head = f"{kind}:..."
    return head + name[-(MAX_NAME - len(head)) :]


@dataclass(frozen=True, slots=True)
class SourceStatus:
    state: HealthState
    reason: str | None = None

    @classmethod
    def ok(cls) -> SourceStatus:
        return cls(HealthState.OK)

    @classmethod
    def down(cls, reason: str) -> SourceStatus:
        return cls(HealthState.INSUFFICIENT_DATA, reason)

    @property
    def is_ok(self) -> bool:
        return self.state == HealthState.OK


@dataclass(frozen=True, slots=True)
class Observation:
    record: FaultRecord
    source: str  # e.g. "kernel_log:/var/log/kern.log", "kmsg"
    position: str  # stable place of the record within the source, for the finding id


class RecordSource(Protocol):
    name: str

    @property
    def status(self) -> SourceStatus: ...

    def check(self) -> SourceStatus:
        """Look at the source now (cheaply) and update `status`; used before the first heartbeat."""
        ...

    def observations(self) -> AsyncIterator[Observation]: ...


class TrackedStatus:
    """A source's status, for sources that are polled: each new reason for being down is logged once, not once per
    poll, and a recovery is logged when the source comes back."""

    def __init__(self, initial_reason: str) -> None:
        self._status = SourceStatus.down(initial_reason)
        self._last_reason: str | None = None

    @property
    def status(self) -> SourceStatus:
        return self._status

    def _mark_ok(self, recovered: str | None = None) -> None:
        if recovered is not None and not self._status.is_ok:
            log.info("%s", recovered)
        self._status = SourceStatus.ok()
        self._last_reason = None

    def _set_down(self, reason: str) -> None:
        if reason != self._last_reason:
            log.warning("%s", reason)
        self._last_reason = reason
        self._status = SourceStatus.down(reason)


async def polled(poll: Callable[[], Awaitable[list[Observation]]], interval: float) -> AsyncIterator[Observation]:
    """A polled source's observations: what each poll found, then a pause."""
    while True:
        for observation in await poll():
            yield observation
        await asyncio.sleep(interval)


class LineAssembler:
    """Bytes in, complete lines out, parsed; keeps the partial last line between chunks."""

    def __init__(self, recent: RecentLines | None = None) -> None:
        self.parser = KernelLogParser(recent=recent)
        self._partial = b""

    @property
    def partial(self) -> bytes:
        """The incomplete last line, waiting for its newline."""
        return self._partial

    def feed(self, chunk: bytes) -> list[FaultRecord]:
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE_BYTES:
            lines.append(self._partial)
            self._partial = b""
        records: list[FaultRecord] = []
        for line in lines:
            records.extend(self.parser.feed(line.decode("utf-8", "replace")))
        return records
