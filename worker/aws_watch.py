"""What AWS says of each group's instances, read by the worker process and told to their health workflows on change.

Per group, every `aws_status_interval` (60 s by default): the container instances of the group's ECS cluster
(`agentConnected`) and, for the running ones, EC2's status checks and scheduled events, and which of the group's ECS
daemon services has no running, healthy task on each (activities/aws_status.py, activities/daemon_tasks.py).
An instance's health workflow is signalled (`aws_status`) only when this worker's picture of it changed since it
last told it; a healthy instance never is, so a healthy fleet costs no Temporal action here, only the reads.

No leader: every worker process runs the same watch. Each tells only its own changes, so N workers tell a change N
times, which the health workflow takes once (a picture it already has is no news; an older one is dropped). A
worker that restarts tells every instance that is not healthy once more, for the same reason harmlessly. One that
died between telling "impaired" and "ok" cannot leave a stale impairment behind: the health workflow reads AWS
again before acting (workflows/health_aws_checks.py).

Every member of the group is watched from the moment ECS lists it (coverage from registration): an instance this
watch has not seen yet gets a health workflow if it has none (then told what AWS says of it), so that an instance
whose probe never started is INITIALIZING, then unmonitored (first_report_timeout), and EC2's checks reach it. A
closed health workflow (its instance was replaced) is never started again. Only new instances cost a call: once
started or found running, an instance is not asked about again while the watch sees it; one of another group (a
shared cluster) is asked about again every FOREIGN_RECHECK, so a tag added later is noticed.

The group's drain semaphore is started by the watch's first round (or found running), not by the group's first
fault: a first surge's repairs then ask a semaphore that has read its settings already. Idle, it costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities.aws import AwsClients
from activities.aws_status import AwsStatusReads
from activities.semaphore_start import start_drain_semaphore
from contract import names
from contract.aws_status import AwsInstanceStatus
from contract.health import HealthInput
from contract.ids import health_workflow_id
from worker.settings import Settings

log = logging.getLogger(__name__)

# No health workflow to tell: asked again after this long (seconds), not every read.
NO_WORKFLOW_RETRY = 600.0
# An instance of the cluster that is not the group's (another group's, in a shared cluster): asked again after this
# long (seconds), so that one tagged into the group later is covered without a worker restart.
FOREIGN_RECHECK = 600.0
# Health workflows one round starts at once: a new group of thousands is covered in a burst the server takes.
START_CONCURRENCY = 32


class GroupWatch:
    """One group's reader. `round()` reads AWS once and tells what changed; `run()` does so every interval."""

    def __init__(
        self,
        client: Client,
        settings: Settings,
        group: str,
        reads: AwsStatusReads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._settings = settings  # read each round: the group's settings as they are now
        self.group = group
        self._reads = reads
        self._told: dict[str, AwsInstanceStatus] = {}
        self._down_since: dict[str, datetime] = {}
        self._no_workflow_until: dict[str, float] = {}
        self._covered: set[str] = set()  # a health workflow is running or closed: not to be started
        self._foreign: dict[str, float] = {}  # in the cluster, not the group's: when to ask again (clock)
        self._clock = clock
        self.rounds = 0
        self.signals = 0
        self.started = 0
        self.semaphore_running = False

    async def run(self) -> None:
        while True:
            try:
                await self.round()
            except Exception as exc:  # AWS or Temporal unreachable: the next read tries again
                log.warning("AWS status of group %s not read: %s", self.group, exc)
            await asyncio.sleep(self._settings.group(self.group).aws_status_interval.total_seconds())

    async def round(self) -> int:
        """Read the group's instances once and tell each health workflow whose picture changed; how many told."""
        if not self.semaphore_running:
            await self._start_semaphore()
        now = datetime.now(UTC)
        seen = await self._reads.read(self._settings.group(self.group), now=now)
        self.rounds += 1
        for instance_id, status in seen.items():
            if status.agent_connected is False:
                # ECS gives no time: from this worker's first sight, kept while it stays disconnected.
                status.agent_disconnected_since = self._down_since.setdefault(instance_id, now)
            else:
                self._down_since.pop(instance_id, None)
        for gone in set(self._told) | set(self._down_since) | set(self._no_workflow_until):
            if gone not in seen:  # left the cluster or EC2: the liveness tracker's business
                self._told.pop(gone, None)
                self._down_since.pop(gone, None)
                self._no_workflow_until.pop(gone, None)
        self._covered &= set(seen)
        self._foreign = {i: until for i, until in self._foreign.items() if i in seen and until > self._clock()}
        await self._cover(seen)
        told = 0
        for instance_id, status in sorted(seen.items()):
            last = self._told.get(instance_id)
            if (status.healthy() if last is None else status.same_as(last)) or self._waiting(instance_id):
                continue
            told += await self._tell(instance_id, status)
        self.signals += told
        return told

    async def _cover(self, seen: dict[str, AwsInstanceStatus]) -> None:
        """A health workflow for every member not seen before."""
        new = sorted(set(seen) - self._covered - set(self._foreign))
        if not new:
            return
        members = await self._reads.members(self._settings.group(self.group), new)
        recheck = self._clock() + FOREIGN_RECHECK
        self._foreign.update({i: recheck for i in set(new) - members})
        ordered = sorted(members)
        for start in range(0, len(ordered), START_CONCURRENCY):
            batch = ordered[start : start + START_CONCURRENCY]
            await asyncio.gather(*(self._start(instance_id) for instance_id in batch))

    async def _start(self, instance_id: str) -> None:
        try:
            await self._client.start_workflow(
                names.HEALTH_WORKFLOW,
                HealthInput(instance_id=instance_id, group=self.group),
                id=health_workflow_id(instance_id),
                task_queue=self._settings.temporal.task_queue,
                # A running one (its probe reported) needs nothing from us, and is not even woken (no start signal:
                # Temporal's signal-with-start always signals a running one); a completed one means the instance
                # was replaced: never started again. A failed or operator-terminated one may start again.
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
                static_summary=f"health of {instance_id} in {self.group}",
            )
        except WorkflowAlreadyStartedError:
            pass
        except RPCError as err:
            log.warning("no health workflow started for %s (the next read tries again): %s", instance_id, err)
            return
        else:
            # What AWS says of it, if anything but healthy, is told right after, as to any instance.
            self.started += 1
            self._no_workflow_until.pop(instance_id, None)
        self._covered.add(instance_id)

    async def _start_semaphore(self) -> None:
        try:
            await start_drain_semaphore(self._client, self._settings.temporal.task_queue, self.group)
        except RPCError as err:
            log.warning("drain semaphore of group %s not started (the next read tries again): %s", self.group, err)
            return
        self.semaphore_running = True

    def _waiting(self, instance_id: str) -> bool:
        until = self._no_workflow_until.get(instance_id)
        return until is not None and self._clock() < until

    async def _tell(self, instance_id: str, status: AwsInstanceStatus) -> int:
        try:
            await self._client.get_workflow_handle(health_workflow_id(instance_id)).signal(
                names.SIGNAL_AWS_STATUS, status
            )
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                log.info("%s has no running health workflow: AWS's word on it not told", instance_id)
                self._no_workflow_until[instance_id] = self._clock() + NO_WORKFLOW_RETRY
            else:
                log.warning("AWS status of %s not told (next read tries again): %s", instance_id, err)
            return 0
        self._no_workflow_until.pop(instance_id, None)
        if status.healthy():
            self._told.pop(instance_id, None)  # healthy is what an untold instance is assumed to be
        else:
            self._told[instance_id] = status
        return 1


@asynccontextmanager
async def aws_watch(settings: Settings, client: Client, aws: AwsClients) -> AsyncIterator[list[GroupWatch]]:
    """One watch per configured group, running while the context is open, its AWS calls in the worker's pool."""
    reads = AwsStatusReads(aws)
    watches = [GroupWatch(client, settings, group.name, reads) for group in settings.groups]
    tasks = [asyncio.create_task(watch.run(), name=f"aws-watch/{watch.group}") for watch in watches]
    try:
        yield watches
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
