"""A probe stand-in for large simulated fleets: what a real node probe sends, without what a real probe costs.

A real `node_probe` Probe per simulated instance follows its kernel-log file (a read every poll interval), keeps a
spool and read cursors on disk and runs its burst and correlation machinery: at a thousand instances in one process
that is most of the simulator's CPU (benchmarks/SCALE.md). Above a size (`autorepair sim --probe-standin-above`) the
simulator runs this instead, per instance:

- heartbeats as the real probe on a simulated node sends them (contract.probe.Heartbeat: its one GPU source, the
  kernel log, named as the probe names it; the node's boot id), at the heartbeat interval the scenario gives (60 s in
  production, the demo's compressed 2 s where the demo says so), the first at once;
- findings: the lines the simulator writes to the node's kernel log reach it as they are written (SimNode's
  kernel_news), classified by the probe's own parser and policy (node_probe.classify.manual, as `autorepair inject`
  does) and sent one by one, each retried until delivered, as the probe's spool does;
- through the same IngestReporter, signed with the same per-instance credentials (HostIdentities), to the same
  ingest: the engine cannot tell it from a real probe.

What it does not do: read the file back (a line written behind the simulator's back is not seen), collapse bursts
(one finding per fault line, as injection writes them), or attach the fault's neighbouring lines (the evidence
upload carries the whole kernel log anyway).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from contract.health import HealthState
from contract.probe import GpuFinding, Heartbeat, ProbeSourceHealth
from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.manual import manual_findings
from node_probe.classify.policy import POLICY_ECS, Policy
from node_probe.sources.base import source_name
from simulator.nodes import SimNode
from simulator.probes import ProbeFleet, ProbeRunner, reporting_via_ingest

if TYPE_CHECKING:
    from node_probe.delivery.ingest_reporter import IngestReporter
    from node_probe.delivery.reporter import ReporterProtocol
    from simulator.host_identity import HostIdentities

log = logging.getLogger(__name__)

PROBE_STANDIN = "stand-in"
# The probe's retry backoff starts here (node_probe.probe: Probe._deliver) and doubles up to the heartbeat interval.
_FIRST_BACKOFF_S = 0.5


class ProbeStandIn:
    """One simulated instance's stand-in: its heartbeats and findings, through `reporter`, until cancelled."""

    def __init__(self, fleet: ProbeFleet, node: SimNode, reporter: ReporterProtocol) -> None:
        self._fleet = fleet
        self._node = node
        self._reporter = reporter
        self._source = source_name("kernel_log", node.kernel_log)  # what the real probe calls its file source
        self._policy = Policy(POLICY_ECS)
        self.heartbeats_sent = 0
        self.findings_sent = 0

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            instance_id=self._node.instance_id,
            group=self._fleet.group,
            sent_at=datetime.now(UTC),
            gpu_health=HealthState.OK,
            sources=[ProbeSourceHealth(name=self._source, state=HealthState.OK)],
            boot_id=self._node.boot_id,
        )

    def findings(self, lines: list[str]) -> list[GpuFinding]:
        """What the probe's parser and policy make of lines written to the kernel log (none for lines that are no
        GPU fault: a boot's)."""
        records = list(parse_lines(lines))
        if not records:
            return []
        return manual_findings(
            records,
            self._policy,
            instance_id=self._node.instance_id,
            group=self._fleet.group,
            source=self._source,
            now=datetime.now(UTC),
        )

    async def run(self) -> None:
        news: asyncio.Queue[list[str]] = asyncio.Queue()
        self._node.kernel_news = news
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._heartbeats())
                tasks.create_task(self._deliver(news))
        finally:
            if self._node.kernel_news is news:
                self._node.kernel_news = None

    async def _heartbeats(self) -> None:
        interval = self._fleet.timing.heartbeat_interval.total_seconds()
        while True:
            try:
                await self._reporter.send_heartbeat(self.heartbeat(), self._fleet.task_queue)
                self.heartbeats_sent += 1
            except Exception as err:  # a lost heartbeat is replaced by the next one, as the probe's
                log.warning("stand-in %s: heartbeat not delivered: %s", self._node.instance_id, err)
            await asyncio.sleep(interval)

    async def _deliver(self, news: asyncio.Queue[list[str]]) -> None:
        most = self._fleet.timing.heartbeat_interval.total_seconds()
        while True:
            for finding in self.findings(await news.get()):
                backoff = _FIRST_BACKOFF_S
                while True:
                    try:
                        await self._reporter.send_finding(finding, self._fleet.task_queue)
                        self.findings_sent += 1
                        break
                    except Exception as err:  # kept until delivered, as the probe's spool keeps it
                        log.warning("stand-in %s: %s not delivered: %s", self._node.instance_id, finding.reason, err)
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, most)


def standin_via_ingest(url: str, ingest_id: str, sts_endpoint: str, identities: HostIdentities) -> ProbeRunner:
    """The stand-in reporting through the ingest as simulator.probes.via_ingest's real probe does."""

    async def standin(fleet: ProbeFleet, node: SimNode, reporter: IngestReporter) -> None:
        await ProbeStandIn(fleet, node, reporter).run()

    return reporting_via_ingest(url, ingest_id, sts_endpoint, identities, standin)
