"""Instances by health status, a gauge counted from Temporal visibility rather than kept by any one worker.

Each health workflow keeps its overall status in the `HealthStatus` search attribute, so "how many instances of
group G are IMPAIRED" is a count query that any worker can answer, whichever workers ran those workflows. Temporal
groups counts only by ExecutionStatus, so it is one query per (group, status) per refresh; a refresh every 30 s for
ten groups is 40 cheap queries.

An instance whose probe has not reported since it registered counts as UNMONITORED, not INSUFFICIENT_DATA: the
instances nobody's probe watches are one number to alert on.

Every worker exports the same fleet-wide numbers: aggregate with `max by (group, health_status)`, never `sum`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

from temporalio.client import Client
from temporalio.common import MetricGauge, MetricMeter

from contract import search_attributes as sa
from contract.health import SEARCH_STATUSES

log = logging.getLogger(__name__)

INSTANCES = "autorepair_instances"
REPAIRS_RUNNING_LONG = "autorepair_repairs_running_long"


class HealthGauges:
    def __init__(
        self, client: Client, groups: Sequence[str], meter: MetricMeter, long_after: timedelta = timedelta(hours=2)
    ) -> None:
        self._client = client
        self._groups = list(groups)
        self._long_after = long_after
        self._long = meter.create_gauge(
            REPAIRS_RUNNING_LONG, "Repairs still running longer than repair_running_long after they started, per group"
        )
        self._gauge = meter.create_gauge(
            INSTANCES,
            "Instances by overall health status (running health workflows), per group; UNMONITORED: no report from"
            " its probe since it registered (its overall status is INSUFFICIENT_DATA)",
        )

    async def refresh(self) -> dict[tuple[str, str], int]:
        """Counts every (group, status); one that cannot be read keeps its last value rather than reading 0."""
        counts = {}
        for group in self._groups:
            for status in SEARCH_STATUSES:
                attributes = {"group": group, "health_status": status}
                count = await self._count(sa.health_count_query(group, status), self._gauge, attributes)
                if count is not None:
                    counts[group, status] = count
        return counts

    async def refresh_repairs(self) -> dict[str, int]:
        """Per group, the repairs running longer than they should: stuck on a step, or waiting without end."""
        counts = {}
        before = datetime.now(UTC) - self._long_after
        for group in self._groups:
            count = await self._count(sa.long_repairs_query(group, before), self._long, {"group": group})
            if count is not None:
                counts[group] = count
        return counts

    async def _count(self, query: str, gauge: MetricGauge, attributes: dict[str, str]) -> int | None:
        """The query's count, set on the gauge; None when it cannot be read (the gauge keeps its last value)."""
        try:
            result = await self._client.count_workflows(query)
        except Exception as exc:  # an unreachable server: stale for one refresh, not a dead worker
            log.warning("not counted (%s): %s", attributes, exc)
            return None
        gauge.set(result.count, attributes)
        return result.count


@asynccontextmanager
async def health_gauges(
    client: Client,
    groups: Sequence[str],
    meter: MetricMeter,
    interval: timedelta,
    long_after: timedelta = timedelta(hours=2),
) -> AsyncIterator[HealthGauges]:
    gauges = HealthGauges(client, groups, meter, long_after)

    async def refresh_forever() -> None:
        while True:
            await gauges.refresh()
            await gauges.refresh_repairs()
            await asyncio.sleep(interval.total_seconds())

    task = asyncio.create_task(refresh_forever(), name="health-gauges")
    try:
        yield gauges
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
