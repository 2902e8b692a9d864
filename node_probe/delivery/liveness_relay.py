"""Heartbeats coalesced: what reaches an instance's health workflow is only what changed; that it is alive goes to
its group's liveness tracker in periodic batches (contract/liveness.py has the timing rules both sides keep).

The ingest wraps its Temporal reporter in one of these for all hosts (relay=True: it keeps sending batches while
hosts are silent, so its own silence means the pipeline is down); a probe that signals Temporal directly (trusted
lab) wraps its own, for itself alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cachetools import LRUCache

from contract.groups import HEARTBEATS_PER_THRESHOLD, CapacityGroup
from contract.liveness import LivenessReport, flush_tick, report_every, shard_of
from contract.probe import GpuFinding, Heartbeat
from node_probe.delivery.reporter import Reporter

log = logging.getLogger(__name__)

# Instances one relay remembers (what it last forwarded and reported for each): far above a fleet, bounded anyway.
MAX_REMEMBERED = 200_000
FINAL_FLUSH_S = 5.0


@dataclass(frozen=True)
class LivenessRoute:
    """Where and how often a group's receipts go: its tracker shards and the reporting interval."""

    shards: int
    every: timedelta

    @classmethod
    def for_group(cls, group: CapacityGroup) -> LivenessRoute:
        every = report_every(group.heartbeat_loss_threshold, group.heartbeat_interval)
        return cls(shards=group.liveness_shards, every=every)

    @classmethod
    def for_probe(cls, heartbeat_interval: timedelta) -> LivenessRoute:
        """A probe signalling directly knows its heartbeat interval, not its group's threshold: it reports as
        often as the smallest threshold the group may have (3 intervals) requires."""
        return cls(shards=1, every=report_every(HEARTBEATS_PER_THRESHOLD * heartbeat_interval, heartbeat_interval))


def routes_of(groups: list[CapacityGroup]) -> Callable[[str], LivenessRoute]:
    """Each configured group's route; a group not configured (refused by the ingest anyway) gets the defaults'."""
    routes = {group.name: LivenessRoute.for_group(group) for group in groups}
    fallback = LivenessRoute.for_group(CapacityGroup(name="-", cluster="-"))
    return lambda name: routes.get(name, fallback)


def _signature(beat: Heartbeat) -> tuple[object, ...]:
    """What a health workflow needs to hear about when it changes; the send time is not part of it. A new boot is
    news: a reboot-first repair waits for it; so is a GPU gone from the host."""
    sources = tuple((s.name, s.state, s.reason, s.gpu_source) for s in beat.sources)
    return (beat.group, beat.gpu_health, beat.gpu_health_reason, sources, beat.boot_id, beat.gpu_count)


class LivenessRelay:
    """A ReporterProtocol: findings go straight on; a heartbeat goes on only when it says something new, and every
    report counts as the instance being heard. A relay runs `running()` alongside to send the batches."""

    def __init__(
        self,
        reporter: Reporter,
        routes: Callable[[str], LivenessRoute],
        task_queue: str,
        *,
        relay: bool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._reporter = reporter
        self._routes = routes
        self._task_queue = task_queue
        self._relay = relay
        self._clock = clock
        self.reporter_id = f"{'ingest' if relay else 'probe'}-{uuid.uuid4().hex[:12]}"
        self._forwarded: LRUCache[str, tuple[object, ...]] = LRUCache(MAX_REMEMBERED)
        self._reported: LRUCache[str, float] = LRUCache(MAX_REMEMBERED)  # receipt time last sent to the tracker
        self._pending: dict[tuple[str, int], dict[str, float]] = {}
        self._last_sent: dict[tuple[str, int], float] = {}
        self._failing: set[tuple[str, int]] = set()
        self.batches_sent = 0
        self.heartbeats_forwarded = 0

    async def send_finding(self, finding: GpuFinding, task_queue: str) -> None:
        await self._reporter.send_finding(finding, task_queue)
        self._heard(finding.instance_id, finding.group)
        # A finding can start the health workflow: make sure it also gets the next heartbeat's news.
        self._forwarded.pop(finding.instance_id, None)
        await self._flush_inline()

    async def send_heartbeat(self, heartbeat: Heartbeat, task_queue: str) -> None:
        self._heard(heartbeat.instance_id, heartbeat.group)
        signature = _signature(heartbeat)
        if self._forwarded.get(heartbeat.instance_id) != signature:
            await self._reporter.send_heartbeat(heartbeat, task_queue)
            self._forwarded[heartbeat.instance_id] = signature
            self.heartbeats_forwarded += 1
        await self._flush_inline()

    async def _flush_inline(self) -> None:
        # A probe reporting for itself flushes as it heartbeats (its interval is within the tracker's allowance);
        # a relay flushes from `running()`, on its own tick, since the hosts' reports come at any time.
        if not self._relay:
            await self.flush_due()

    def _heard(self, instance_id: str, group: str) -> None:
        route = self._routes(group)
        key = (group, shard_of(instance_id, route.shards))
        self._pending.setdefault(key, {})[instance_id] = self._clock()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LivenessRelay]:
        task = asyncio.create_task(self._flush_forever(), name="liveness batches")
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # A clean stop sends what it holds, so the trackers do not take a replica's restart for an outage.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FINAL_FLUSH_S):
                    await self.flush_all()

    async def flush_all(self) -> None:
        now = self._clock()
        for key, pending in list(self._pending.items()):
            if pending:
                await self._send(key, pending, now)

    async def _flush_forever(self) -> None:
        while True:
            tick = min((flush_tick(self._routes(group).every) for group, _ in self._pending), default=None)
            await asyncio.sleep((tick or timedelta(seconds=1)).total_seconds())
            await self.flush_due()

    async def flush_due(self) -> None:
        """Send each (group, shard) whose batch is due: an instance last reported a full interval ago has news,
        or the keepalive is due. Everything pending for that shard goes along, so the shard's instances stay on
        one schedule and one batch serves them all."""
        now = self._clock()
        for key, pending in list(self._pending.items()):
            every = self._routes(key[0]).every.total_seconds()
            # A probe reporting for itself sends every receipt: one it held back would die with it, and the tracker
            # would judge it by an older one (lost before the threshold).
            news = (not self._relay and bool(pending)) or any(
                (reported := self._reported.get(instance_id)) is None or now >= reported + every
                for instance_id in pending
            )
            keepalive = self._relay and now >= self._last_sent.get(key, 0.0) + every
            if news or keepalive:
                await self._send(key, pending, now)

    async def _send(self, key: tuple[str, int], pending: dict[str, float], now: float) -> None:
        group, shard = key
        route = self._routes(group)
        sent = dict(pending)  # receipts arriving while the signal is in flight stay pending for the next batch
        # Whole seconds, rounded so that a receipt is never reported earlier than it happened.
        at = math.ceil(now)
        report = LivenessReport(
            group=group,
            shard=shard,
            shards=route.shards,
            reporter=self.reporter_id,
            at=datetime.fromtimestamp(at, tz=UTC),
            report_every=route.every,
            relay=self._relay,
            heard={instance_id: max(int(at - heard), 0) for instance_id, heard in sent.items()},
        )
        try:
            await self._reporter.send_liveness(report, self._task_queue)
        except Exception as err:  # Temporal down: keep what is pending and try again at the next tick
            if key not in self._failing:
                log.warning("liveness batch for %s shard %d not sent (kept, retrying): %s", group, shard, err)
            self._failing.add(key)
            return
        if key in self._failing:
            log.info("liveness batches for %s shard %d delivered again", group, shard)
            self._failing.discard(key)
        self.batches_sent += 1
        self._last_sent[key] = now
        self._reported.update(sent)
        self._pending[key] = {i: t for i, t in self._pending.get(key, {}).items() if t > sent.get(i, -1.0)}
