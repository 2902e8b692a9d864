"""The node probe on each simulated instance: the real one by default, started, stopped and restarted per node.

A probe is one asyncio task per node. The fleet decides when a node's probe should run (booted, not terminated,
agent not down); `NodeProbes` owns the tasks themselves: it never lets a crash vanish unseen, restarts a probe
after a blip, and refuses to start anything once the fleet is closing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from simulator.nodes import SimNode

if TYPE_CHECKING:
    from temporalio.client import Client

    from node_probe.delivery.ingest_reporter import IngestReporter
    from node_probe.probe import ProbeConfig
    from simulator.host_identity import HostIdentities

log = logging.getLogger(__name__)


class ProbeTiming(Protocol):
    """The fleet's time constants a probe runs at (SimTiming provides them)."""

    @property
    def heartbeat_interval(self) -> timedelta: ...

    @property
    def probe_poll_interval(self) -> timedelta: ...


class ProbeFleet(Protocol):
    """What a node's probe needs from the fleet it runs in (SimulatedFleet provides it). Declared here rather than
    naming the fleet, so simulator.fleet can depend on this module without this module depending back on it."""

    @property
    def group(self) -> str: ...

    @property
    def task_queue(self) -> str: ...

    @property
    def state_dir(self) -> Path: ...

    @property
    def client(self) -> Client | None: ...

    @property
    def timing(self) -> ProbeTiming: ...


# What runs as a node's probe; tests pass a fake that only records starts.
ProbeRunner = Callable[[ProbeFleet, SimNode], Awaitable[None]]


async def run_real_probe(fleet: ProbeFleet, node: SimNode) -> None:
    """The real node probe, following the node's kernel log and signalling its health workflow directly (the
    probe's trusted-lab mode: the end-to-end tests' default)."""
    # Imported here so the AWS side of the simulator (and its tests) works without Temporal or the probe.
    from node_probe.delivery.liveness_relay import LivenessRelay, LivenessRoute
    from node_probe.delivery.reporter import Reporter
    from node_probe.probe import Probe

    if fleet.client is None:
        raise RuntimeError("a probe needs a Temporal client")
    config = _probe_config(fleet, node)
    route = LivenessRoute.for_probe(config.heartbeat_interval)
    relay = LivenessRelay(Reporter(fleet.client), lambda group: route, config.task_queue, relay=False)
    await Probe(config, relay).run()


def via_ingest(url: str, ingest_id: str, sts_endpoint: str, identities: HostIdentities) -> ProbeRunner:
    """The real node probe reporting through the ingest, as a host in production does: each node signs its
    reports with credentials of its own instance (HostIdentities)."""

    async def probe(fleet: ProbeFleet, node: SimNode, reporter: IngestReporter) -> None:
        from node_probe.probe import Probe

        await Probe(_probe_config(fleet, node), reporter).run()

    return reporting_via_ingest(url, ingest_id, sts_endpoint, identities, probe)


def reporting_via_ingest(
    url: str,
    ingest_id: str,
    sts_endpoint: str,
    identities: HostIdentities,
    report: Callable[[ProbeFleet, SimNode, IngestReporter], Awaitable[None]],
) -> ProbeRunner:
    """A runner whose node reports through the ingest with credentials of its own instance, as `report` says."""

    async def run(fleet: ProbeFleet, node: SimNode) -> None:
        from node_probe.delivery.ingest_reporter import IngestReporter

        reporter = IngestReporter(
            url,
            ingest_id=ingest_id,
            sts_endpoint=sts_endpoint,
            credentials=lambda: identities.credentials(node.instance_id),
        )
        async with reporter:
            await report(fleet, node, reporter)

    return run


def _probe_config(fleet: ProbeFleet, node: SimNode) -> ProbeConfig:
    from node_probe.probe import ProbeConfig

    return ProbeConfig(
        instance_id=node.instance_id,
        group=fleet.group,
        kernel_log=node.kernel_log,
        heartbeat_interval=fleet.timing.heartbeat_interval,
        poll_interval=fleet.timing.probe_poll_interval,
        task_queue=fleet.task_queue,
        # A file spool, as on a real host: a finding not yet delivered survives a blip's probe restart.
        spool_dir=fleet.state_dir / "spool",
        # Retries at the demo's time scale, not production's.
        retry_max_backoff=fleet.timing.heartbeat_interval,
        # Each simulated node boots (and reboots) on its own, though all share this process's host.
        boot_id=node.boot_id,
    )


class NodeProbes:
    """The probe tasks of one fleet's nodes. No runner: no probe ever starts (the AWS side alone)."""

    def __init__(self, run: Callable[[SimNode], Awaitable[None]] | None) -> None:
        self._run = run
        self._restarts: set[asyncio.Task[None]] = set()
        self._closed = False

    def start(self, node: SimNode) -> None:
        """Start the node's probe unless it already runs or the node should be silent."""
        silent = node.agent_down or node.terminated or node.rebooting
        if self._run is None or silent or node.probe_running or self._closed:
            return
        node.probe_error = None
        node.probe = asyncio.create_task(self._main(node), name=f"probe {node.instance_id}")

    async def _main(self, node: SimNode) -> None:
        assert self._run is not None
        try:
            await self._run(node)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            # A crashed probe is a silent node: the engine will (rightly) see a heartbeat loss. Keep the
            # reason visible in snapshots instead of losing it in a never-awaited task.
            node.probe_error = f"{type(err).__name__}: {err}"
            log.exception("probe for %s crashed", node.instance_id)

    async def stop(self, node: SimNode) -> None:
        probe, node.probe = node.probe, None
        if probe is not None and not probe.done():
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe

    def restart_after(self, node: SimNode, duration: timedelta) -> None:
        """Start the node's probe again once `duration` has passed; returns at once."""
        restart = asyncio.create_task(self._restart_after(node, duration), name=f"blip {node.instance_id}")
        # Held until done: the event loop keeps only a weak reference to a task.
        self._restarts.add(restart)
        restart.add_done_callback(self._restarts.discard)

    async def _restart_after(self, node: SimNode, duration: timedelta) -> None:
        await asyncio.sleep(duration.total_seconds())
        self.start(node)

    def close(self, nodes: Iterable[SimNode]) -> list[asyncio.Task[Any]]:
        """Start nothing from now on; the pending restarts and running probes, for the caller to cancel."""
        self._closed = True
        tasks: list[asyncio.Task[Any]] = [t for t in self._restarts if not t.done()]
        tasks += [n.probe for n in nodes if n.probe is not None and not n.probe.done()]
        return tasks
