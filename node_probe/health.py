"""The probe's GET /healthz (contract/healthz.py), for the ECS DAEMON task's container health check or systemd, and
its GET /metrics for Prometheus (node_probe/metrics.py) with a /healthz of its own on `--metrics-bind`.

200 while the probe's loop runs, it delivered a heartbeat within STALE_HEARTBEATS heartbeat intervals (or started
less than that ago), no finding has been failing to go out for that long, and at least one of its sources reads;
503 with the reason otherwise. With NVML, `checks.gpus` adds each GPU's clock event reasons, PCIe link and the
warnings that hold, as the last poll read them. Answered from what the probe keeps anyway (Probe.delivery, its
sources' health, NVML's last poll): no timer, no polling, nothing at idle. The probe runs with host networking on GPU
hosts, hence loopback by default for /healthz, and no metrics port unless one is named: a port open on every GPU
host is the operator's choice (the shipped unit and ECS template name 0.0.0.0:9482).

Delivery failing is usually the ingest's or Temporal's trouble rather than the probe's, and a restart does not
mend it: with a spool dir nothing is lost by one, but a liveness probe on it should be patient (docs/operations.md).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from contract.formats import iso
from contract.health import HealthState
from contract.healthz import DEFAULT_PROBE_HEALTH_BIND, OFF, PROBE_METRICS_PORT, Verdict, health_bind, serving_health
from contract.probe import ProbeSourceHealth
from node_probe.probe import Probe

log = logging.getLogger(__name__)

# Heartbeat intervals without a delivered heartbeat (or with a finding failing to go out) before it is unhealthy:
# the worker's heartbeat-loss threshold is at least as many, so by then the instance is about to be declared lost.
STALE_HEARTBEATS = 3


def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    def bind(text: str) -> str | None:
        try:
            return health_bind(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parser.add_argument(
        "--health-bind",
        type=bind,
        default=DEFAULT_PROBE_HEALTH_BIND,
        metavar="HOST:PORT",
        help="serve GET /healthz here for a container or host health check: 200 while the probe reads a source "
        f"and delivers, 503 and why not; {OFF!r}: none (default: {DEFAULT_PROBE_HEALTH_BIND})",
    )
    parser.add_argument(
        "--metrics-bind",
        type=bind,
        default=None,
        metavar="HOST:PORT",
        help="serve GET /metrics (Prometheus) and GET /healthz here, plain HTTP, e.g. "
        f"0.0.0.0:{PROBE_METRICS_PORT} for a Prometheus elsewhere (default: {OFF}; the same HOST:PORT as "
        "--health-bind serves both there)",
    )


def _shown(source: ProbeSourceHealth) -> str:
    """A source as /healthz shows it: why it is down, or ok (with how it looked, where an OK source says: the
    container runtime's API or its unit only)."""
    if source.state is not HealthState.OK:
        return source.reason or "down"
    return f"ok: {source.reason}" if source.reason else "ok"


def _wall(at: float, now: float) -> str:
    return iso(datetime.now(UTC) - timedelta(seconds=now - at), "seconds")


class ProbeHealth:
    """The probe's /healthz answer. `stale_after`: default STALE_HEARTBEATS heartbeat intervals."""

    def __init__(
        self, probe: Probe, stale_after: timedelta | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._probe = probe
        interval = probe.config.heartbeat_interval
        self._stale_after = (stale_after or STALE_HEARTBEATS * interval).total_seconds()
        self._clock = clock

    def verdict(self) -> Verdict:
        probe, delivery, now = self._probe, self._probe.delivery, self._clock()
        if delivery.running_since is None:
            return Verdict("the probe's loop is not running")
        sources = probe.source_health()
        checks: dict[str, Any] = {
            "sources": {source.name: _shown(source) for source in sources},
            "heartbeat": "none delivered yet"
            if delivery.heartbeat_at is None
            else f"delivered {now - delivery.heartbeat_at:.0f}s ago",
            "pending_findings": probe.pending,
        }
        gpus = probe.gpu_readings()
        if gpus:
            # Clocks slowed or a link below its maximum, live: the findings say when they began, this says if they last.
            checks["gpus"] = gpus
        problems: list[str] = []
        if not sources:
            problems.append("no source is configured")
        elif all(source.state is not HealthState.OK for source in sources):
            problems.append("every source is down: " + "; ".join(str(source.reason) for source in sources))
        last = delivery.heartbeat_at if delivery.heartbeat_at is not None else delivery.running_since
        if now - last > self._stale_after:
            what = "since the start at" if delivery.heartbeat_at is None else "since"
            problems.append(
                f"no heartbeat delivered {what} {_wall(last, now)} ({delivery.heartbeat_error or 'still trying'})"
            )
        failing = delivery.findings_failing_since
        if failing is not None and probe.pending and now - failing > self._stale_after:
            count = f"{probe.pending} finding{'' if probe.pending == 1 else 's'}"
            problems.append(f"{count} undelivered, failing since {_wall(failing, now)} ({delivery.finding_error})")
        return Verdict("; ".join(problems) or None, checks)


@asynccontextmanager
async def serving_probe_health(
    probe: Probe, bind: str | None, stale_after: timedelta | None = None, metrics_bind: str | None = None
) -> AsyncIterator[str | None]:
    """/healthz on `bind` and /metrics with /healthz on `metrics_bind` while inside (none where None; one server
    where they are the same); yields the /healthz URL on `bind`, None when not served."""
    verdict = ProbeHealth(probe, stale_after).verdict
    render = None
    if metrics_bind is not None:
        # Here, not at the top: a probe that serves no metrics does not carry prometheus_client.
        from node_probe.metrics import ProbeMetrics

        render = ProbeMetrics(probe).render
    async with contextlib.AsyncExitStack() as stack:
        url: str | None = None
        for where, metrics in _endpoints(bind, metrics_bind, render):
            try:
                served = await stack.enter_async_context(serving_health(where, verdict, metrics))
            except OSError as err:
                # Watching the GPUs matters more than answering health checks: the probe runs on, and the check
                # (refused) says something is wrong, as this log line does.
                flag = "--health-bind" if where == bind else "--metrics-bind"
                log.error("health endpoint not served on %s: %s; choose a free port with %s", where, err, flag)
                continue
            log.info("health endpoint on %s%s", served, " with metrics" if metrics is not None else "")
            if where == bind:
                url = served
        yield url


def _endpoints(
    bind: str | None, metrics_bind: str | None, render: Callable[[], bytes] | None
) -> list[tuple[str, Callable[[], bytes] | None]]:
    """Where to serve, and with which metrics: one server where the two binds are the same."""
    if metrics_bind is not None and metrics_bind == bind:
        return [(bind, render)]
    served: list[tuple[str, Callable[[], bytes] | None]] = [] if bind is None else [(bind, None)]
    return served if metrics_bind is None else [*served, (metrics_bind, render)]


async def run_with_health(probe: Probe, bind: str | None, metrics_bind: str | None = None) -> None:
    """The probe's run, with its /healthz served on `bind` and its metrics on `metrics_bind` for as long as it lasts."""
    async with serving_probe_health(probe, bind, metrics_bind=metrics_bind):
        await probe.run()
