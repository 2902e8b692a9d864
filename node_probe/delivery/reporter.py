"""Deliver findings and heartbeats to the instance's health workflow by signal-with-start.

Signal-with-start (USE_EXISTING) means the probe never needs to know whether the workflow exists yet: the
first signal of a new instance starts it, later ones land on the running one.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Protocol

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from contract import names
from contract.health import HealthInput
from contract.ids import health_workflow_id, liveness_workflow_id
from contract.liveness import LivenessInput, LivenessReport
from contract.probe import GpuFinding, Heartbeat

log = logging.getLogger(__name__)


class ReporterProtocol(Protocol):
    """What the probe needs; tests pass a recording fake."""

    async def send_finding(self, finding: GpuFinding, task_queue: str) -> None: ...

    async def send_heartbeat(self, heartbeat: Heartbeat, task_queue: str) -> None: ...


class Reporter:
    """Wraps a client made with `data_converter=pydantic_data_converter`. Raises when delivery fails; the
    probe keeps the finding spooled and retries."""

    def __init__(self, client: Client, rpc_timeout: timedelta = timedelta(seconds=10)) -> None:
        self._client = client
        self._rpc_timeout = rpc_timeout

    async def send_finding(self, finding: GpuFinding, task_queue: str) -> None:
        await self._signal_with_start(finding.instance_id, finding.group, task_queue, names.SIGNAL_GPU_FINDING, finding)

    async def send_heartbeat(self, heartbeat: Heartbeat, task_queue: str) -> None:
        await self._signal_with_start(
            heartbeat.instance_id, heartbeat.group, task_queue, names.SIGNAL_HEARTBEAT, heartbeat
        )

    async def send_liveness(self, report: LivenessReport, task_queue: str) -> None:
        """A batch to the group's liveness tracker (shard), starting it if it is not running."""
        call = self._client.start_workflow(
            names.LIVENESS_WORKFLOW,
            LivenessInput(group=report.group, shard=report.shard, shards=report.shards),
            id=liveness_workflow_id(report.group, report.shard, report.shards),
            task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal=names.SIGNAL_LIVENESS_REPORT,
            start_signal_args=[report],
            static_summary=f"liveness of group {report.group}"
            + (f", shard {report.shard} of {report.shards}" if report.shards > 1 else ""),
            rpc_timeout=self._rpc_timeout,
        )
        async with asyncio.timeout(2 * self._rpc_timeout.total_seconds()):
            await call

    async def _signal_with_start(
        self, instance_id: str, group: str, task_queue: str, signal: str, payload: GpuFinding | Heartbeat
    ) -> None:
        # The RPC timeout does not cover a lazy client's first connect; bound the whole call, so a black-holed
        # server cannot stall delivery (a retry after a late success is dropped by the finding id).
        call = self._client.start_workflow(
            names.HEALTH_WORKFLOW,
            HealthInput(instance_id=instance_id, group=group),
            id=health_workflow_id(instance_id),
            task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            # A completed health workflow means the instance was replaced: a late signal from its dying probe must
            # not start a second one. A failed or operator-terminated one may start again.
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
            start_signal=signal,
            start_signal_args=[payload],
            # The Web UI's one-line summary; applies only when this call starts the workflow.
            static_summary=f"health of {instance_id} in {group}",
            rpc_timeout=self._rpc_timeout,
        )
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the probe's own cancellation.
            async with asyncio.timeout(2 * self._rpc_timeout.total_seconds()):
                await call
        except WorkflowAlreadyStartedError:
            log.info("%s was retired by a repair; dropping its %s signal", instance_id, signal)
