"""The worker's GET /healthz (contract/healthz.py), and the Temporal reachability it and the ingest's answer from.

200 while Temporal answered a cheap call within STALE_AFTER and the worker is not shutting down; 503 with the
reason otherwise. A worker that cannot reach Temporal runs nothing, however alive its process looks; one that is
draining its activities after SIGTERM should get no new work routed its way, and an orchestrator should not count
it as a replica.

worker/main.py's run_worker flips it with `begin_shutdown()` when SIGTERM arrives, before the worker's own shutdown
waits for its activities.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client

from contract.formats import iso
from contract.healthz import Verdict, serving_health
from worker.settings import Settings

log = logging.getLogger(__name__)

# A check every CHECK_INTERVAL; unhealthy once none succeeded for STALE_AFTER: four missed checks, so one slow
# answer or a frontend restart does not take a worker out of service.
CHECK_INTERVAL = timedelta(seconds=10)
STALE_AFTER = timedelta(seconds=45)
CHECK_TIMEOUT = timedelta(seconds=5)


def _wall(monotonic_at: float, now: float) -> str:
    return iso(datetime.now(UTC) - timedelta(seconds=now - monotonic_at), "seconds")


class TemporalReachability:
    """Whether Temporal answered recently: GetSystemInfo (what the SDK itself asks on connect: no namespace, no
    history) every `interval`, and any call of the process's own that went through (`answered()`)."""

    def __init__(
        self,
        client: Client,
        *,
        interval: timedelta = CHECK_INTERVAL,
        stale_after: timedelta = STALE_AFTER,
        timeout: timedelta = CHECK_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._interval = interval.total_seconds()
        self._stale_after = stale_after.total_seconds()
        self._timeout = timeout
        self._clock = clock
        self._started = clock()
        self._answered_at: float | None = None
        self._failing_since: float | None = None  # the first failure after the last answer
        self._error = "not asked yet"

    @property
    def address(self) -> str:
        return self._client.service_client.config.target_host

    def answered(self) -> None:
        self._answered_at = self._clock()
        self._failing_since = None

    def failed(self, error: BaseException) -> None:
        if self._failing_since is None:
            self._failing_since = self._clock()
        self._error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__

    async def check(self) -> bool:
        """Ask once; True when it answered."""
        try:
            # The RPC timeout does not cover a lazy client's first connect: bound the whole call.
            async with asyncio.timeout(2 * self._timeout.total_seconds()):
                await self._client.workflow_service.get_system_info(GetSystemInfoRequest(), timeout=self._timeout)
        except Exception as err:  # unreachable, refused, timed out: all mean "not answering"
            if self._failing_since is None:
                log.warning("Temporal at %s not answering: %s", self.address, err)
            self.failed(err)
            return False
        if self._failing_since is not None:
            log.info("Temporal at %s answers again", self.address)
        self.answered()
        return True

    @asynccontextmanager
    async def checking(self) -> AsyncIterator[TemporalReachability]:
        """Checks in the background while inside, the first at once."""

        async def check_forever() -> None:
            while True:
                await self.check()
                await asyncio.sleep(self._interval)

        task = asyncio.create_task(check_forever(), name="temporal-reachability")
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def problem(self) -> str | None:
        """None while Temporal answered within `stale_after`; else why not, with since when."""
        now = self._clock()
        if self._answered_at is not None and now - self._answered_at <= self._stale_after:
            return None
        if self._answered_at is None:
            if now - self._started <= self._stale_after and self._failing_since is None:
                return f"Temporal at {self.address} not asked yet"
            return (
                f"Temporal at {self.address} has not answered since the start at {_wall(self._started, now)} "
                f"({self._error})"
            )
        since = self._failing_since if self._failing_since is not None else self._answered_at
        return (
            f"Temporal at {self.address} unreachable since {_wall(since, now)}, last answered "
            f"{_wall(self._answered_at, now)} ({self._error})"
        )

    def describe(self) -> str:
        now = self._clock()
        if self._answered_at is None:
            return "never answered"
        return f"answered {now - self._answered_at:.0f}s ago"


class WorkerHealth:
    """The worker's /healthz answer: Temporal reachable, and not shutting down."""

    def __init__(self, temporal: TemporalReachability) -> None:
        self.temporal = temporal
        self._shutting_down_since: float | None = None

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down_since is not None

    def begin_shutdown(self) -> None:
        """From now on /healthz answers 503 "shutting down" (idempotent): call it as SIGTERM arrives."""
        if self._shutting_down_since is None:
            self._shutting_down_since = time.time()

    def verdict(self) -> Verdict:
        checks = {"temporal": self.temporal.describe(), "shutting_down": self.shutting_down}
        if self._shutting_down_since is not None:
            since = iso(datetime.fromtimestamp(self._shutting_down_since, UTC), "seconds")
            return Verdict(f"shutting down since {since}", checks)
        return Verdict(self.temporal.problem(), checks)


@asynccontextmanager
async def worker_health(
    settings: Settings, client: Client, *, temporal: TemporalReachability | None = None
) -> AsyncIterator[WorkerHealth]:
    """Serves /healthz on settings.health_bind_address while inside (none when it is None) and yields the
    WorkerHealth to flip at shutdown either way. `temporal`: thresholds other than the defaults (the tests')."""
    health = WorkerHealth(temporal or TemporalReachability(client))
    bind = settings.health_bind_address
    async with contextlib.AsyncExitStack() as stack:
        if bind is not None:
            try:
                url = await stack.enter_async_context(serving_health(bind, health.verdict))
            except OSError as err:
                # The worker's work matters more than its endpoint: it runs on, and the orchestrator's check
                # (refused, or another process's answer) says something is wrong, as this log line does.
                log.error("health endpoint not served on %s: %s; set health_bind_address to a free port", bind, err)
            else:
                await stack.enter_async_context(health.temporal.checking())
                log.info("health endpoint on %s", url)
        yield health
