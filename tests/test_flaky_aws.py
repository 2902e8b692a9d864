"""The repair engine against an AWS that throttles, runs out of capacity and refuses: real Temporal, moto behind
`FlakyAws`, the simulated fleet running the real probe.

Only the engine talks to AWS through the proxy; the simulated fleet and the checks below talk to moto directly,
so they neither see the faults nor use up a rule's count. Every wait is a poll (no timing assertions).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from tests.flaky_aws import FlakyAws
from tests.harness import eventually, make_settings, read_events, running_worker, unique
from tests.test_repair_engine import START_BEFORE_STOP, TIMING
from worker.fleet_sim import SimulatedFleet
from worker.settings import Settings
from workflows.ids import health_workflow_id, repair_workflow_id, semaphore_workflow_id
from workflows.models import InstanceHealthView, RepairPhase, SemaphoreView

INSTANCES = 3


@dataclass
class FlakyFleet:
    sim: SimulatedFleet
    settings: Settings
    events_path: Path
    client: Client
    aws: FlakyAws
    moto_endpoint: str

    @property
    def group(self) -> str:
        return self.settings.groups[0].name

    def events(self, type: str | None = None, instance_id: str | None = None) -> list[dict[str, Any]]:
        # Delivery is at least once: a retried publish repeats an event_id, which counts once.
        unique_events = {e["event_id"]: e for e in read_events(self.events_path) if e["group"] == self.group}
        return [
            e for e in unique_events.values() if type in (None, e["type"]) and instance_id in (None, e["instance_id"])
        ]

    async def all_healthy(self) -> None:
        await eventually(self.sim.snapshot, lambda s: s.healthy == INSTANCES and s.running == INSTANCES, within=90)

    async def repair_finished(self, instance_id: str) -> None:
        """Completed, and the permit handed back (the last thing a repair does)."""

        def finished() -> bool:
            return bool(self.events("RepairCompleted", instance_id) and self.events("DrainPermitReleased", instance_id))

        await eventually(lambda: asyncio.sleep(0, finished()), bool, within=180)

    async def health(self, instance_id: str) -> InstanceHealthView:
        handle = self.client.get_workflow_handle(health_workflow_id(instance_id))
        # Bounded, so a poll that gets no answer is retried by `eventually` rather than waited on.
        return await handle.query("health", result_type=InstanceHealthView, rpc_timeout=timedelta(seconds=5))

    async def semaphore(self) -> SemaphoreView:
        handle = self.client.get_workflow_handle(semaphore_workflow_id(self.group))
        return await handle.query("state", result_type=SemaphoreView, rpc_timeout=timedelta(seconds=5))

    def ec2(self) -> Any:
        # moto itself, not the proxy: the test's own look must not be throttled nor counted.
        return boto3.client("ec2", endpoint_url=self.moto_endpoint, region_name="us-east-1")

    def replacements_of(self, instance_id: str) -> list[str]:
        pages = self.ec2().describe_instances(
            Filters=[{"Name": "tag:gpu-autorepair:replaces", "Values": [instance_id]}]
        )
        return [i["InstanceId"] for r in pages["Reservations"] for i in r["Instances"]]

    def ec2_state(self, instance_id: str) -> str:
        described = self.ec2().describe_instances(InstanceIds=[instance_id])
        return str(described["Reservations"][0]["Instances"][0]["State"]["Name"])

    def steps(self, instance_id: str) -> list[str]:
        return [e["type"] for e in self.events(instance_id=instance_id) if e["type"] != "HealthChanged"]

    def requests_about(self, action: str, instance_id: str) -> int:
        """EC2 requests the engine sent for `action` naming `instance_id` (another repair's do not count)."""
        return sum(
            1 for s in self.aws.seen() if s.request.action == action and instance_id in s.request.params.values()
        )

    def assert_start_before_stop(self, instance_id: str) -> None:
        steps = [s for s in self.steps(instance_id) if s != "ReplacementLaunchFailed"]
        assert steps == START_BEFORE_STOP, f"{instance_id}: {steps}"
        replacements = self.replacements_of(instance_id)
        assert len(replacements) == 1, f"{instance_id} has replacements {replacements}"
        assert self.ec2_state(instance_id) == "terminated"
        assert self.ec2_state(replacements[0]) == "running"
        # The same order as AWS saw it: the impaired instance's termination was asked for only after its
        # replacement had been launched (the launch is tagged with the impaired id), and only once.
        about = [(s.request.action, s.status) for s in self.aws.seen() if instance_id in s.request.params.values()]
        launched = about.index(("RunInstances", 200))
        terminations = [i for i, (action, _) in enumerate(about) if action == "TerminateInstances"]
        assert len(terminations) == 1 and terminations[0] > launched, about


@asynccontextmanager
async def fleet_behind_flaky_aws(
    client: Client, moto_endpoint: str, tmp_path: Path, *, max_attempts: int
) -> AsyncIterator[FlakyFleet]:
    group = unique("gpu")
    events_path = tmp_path / "events.jsonl"
    with FlakyAws(moto_endpoint) as aws:
        settings = make_settings(
            client,
            aws.url,
            events_path,
            group=group,
            cluster=group,
            launch_template=f"{group}-lt",
            heartbeat_loss_threshold=TIMING.heartbeat_loss_threshold,
        )
        settings.aws = settings.aws.model_copy(update={"max_attempts": max_attempts})
        sim = SimulatedFleet(
            group=group,
            cluster=group,
            state_dir=tmp_path / "fleet",
            instances=INSTANCES,
            seed=11,
            launch_template=f"{group}-lt",
            endpoint_url=moto_endpoint,
            client=client,
            task_queue=settings.temporal.task_queue,
            timing=TIMING,
        )
        async with running_worker(settings, client):
            await sim.setup()
            try:
                yield FlakyFleet(
                    sim=sim,
                    settings=settings,
                    events_path=events_path,
                    client=client,
                    aws=aws,
                    moto_endpoint=moto_endpoint,
                )
            finally:
                await sim.close()


def final_attempts(history: Sequence[HistoryEvent], activity: str) -> list[int]:
    """The attempt each run of `activity` ended on (history records only an activity's last attempt)."""
    scheduled = {
        e.event_id
        for e in history
        if e.HasField("activity_task_scheduled_event_attributes")
        and e.activity_task_scheduled_event_attributes.activity_type.name == activity
    }
    return [
        e.activity_task_started_event_attributes.attempt
        for e in history
        if e.HasField("activity_task_started_event_attributes")
        and e.activity_task_started_event_attributes.scheduled_event_id in scheduled
    ]


async def test_throttled_drain_and_describes_still_repair_start_before_stop(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    # max_attempts=1: botocore tries each call twice, so four throttled requests fail two activity attempts and
    # both layers of retries (botocore's, then Temporal's) are exercised.
    async with fleet_behind_flaky_aws(client, aws_env, tmp_path, max_attempts=1) as fleet:
        await fleet.all_healthy()
        drain_throttle = fleet.aws.fail("UpdateContainerInstancesState", "ThrottlingException", times=4)
        # Every second DescribeInstances, for the whole repair: set_draining, the launch's idempotency look-up,
        # the wait for the replacement and the task listing all meet it.
        describe_throttle = fleet.aws.fail("DescribeInstances", "RequestLimitExceeded", every=2)
        [faulty] = fleet.sim.live_instances()[:1]
        fleet.sim.inject_fault(faulty)

        await fleet.repair_finished(faulty)
        fleet.assert_start_before_stop(faulty)
        assert drain_throttle.failed == 4
        # Four throttled requests, then the one that was accepted: the instance was set DRAINING once.
        assert fleet.aws.calls("UpdateContainerInstancesState") == 5
        assert describe_throttle.failed >= 2
        assert fleet.requests_about("RunInstances", faulty) == 1
        assert any(s.request.attempt > 1 and s.fault is None for s in fleet.aws.seen()), "botocore never retried"
        history = (await client.get_workflow_handle(repair_workflow_id(faulty)).fetch_history()).events
        assert max(final_attempts(history, "set_draining")) >= 3, "Temporal never retried set_draining"
        assert fleet.steps(faulty).count("ReplacementLaunched") == 1


async def test_capacity_shortage_backs_off_keeps_the_instance_and_completes_when_capacity_returns(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with fleet_behind_flaky_aws(client, aws_env, tmp_path, max_attempts=1) as fleet:
        await fleet.all_healthy()
        # Per call: a shortage outlasts botocore's backoff, so each call fails on every one of its attempts.
        # No `times`: capacity returns when the test says so, after it has looked at the repair backing off
        # (a fixed count would race that look against the next launch attempt).
        shortage = fleet.aws.fail("RunInstances", "InsufficientInstanceCapacity", per="call")
        [faulty] = fleet.sim.live_instances()[:1]
        fleet.sim.inject_fault(faulty)

        view = await eventually(
            lambda: fleet.health(faulty),
            lambda v: v.repair is not None and "InsufficientInstanceCapacity" in (v.repair.error or ""),
            every=0.2,
        )
        assert view.repair is not None and view.repair.phase is RepairPhase.LAUNCHING_REPLACEMENT
        [first_failure, *_] = await eventually(
            lambda: asyncio.sleep(0, fleet.events("ReplacementLaunchFailed", faulty)), bool
        )
        assert "InsufficientInstanceCapacity" in first_failure["error"]
        assert "ec2:RunInstances" in first_failure["error"]
        assert first_failure["attempt"] == 1 and first_failure["retry_in_seconds"] > 0
        # Backing off without a replacement: the impaired instance is drained but kept running.
        assert fleet.replacements_of(faulty) == []
        assert fleet.ec2_state(faulty) == "running"
        assert fleet.requests_about("TerminateInstances", faulty) == 0
        assert shortage.failed >= 3  # the activity's three attempts, before the workflow's backoff
        # botocore retried each 500 once (max_attempts=1) before the activity saw it.
        assert any(s.fault and s.request.attempt == 2 for s in fleet.aws.seen())

        fleet.aws.heal()
        await fleet.repair_finished(faulty)
        fleet.assert_start_before_stop(faulty)
        steps = fleet.steps(faulty)
        assert steps.index("ReplacementLaunchFailed") < steps.index("ReplacementLaunched")
        assert steps.index("ReplacementReady") < steps.index("Terminated")
        assert all("InsufficientInstanceCapacity" in e["error"] for e in fleet.events("ReplacementLaunchFailed"))
        done = await fleet.health(faulty)
        assert done.repair is not None and done.repair.phase is RepairPhase.COMPLETED and done.repair.error is None


async def test_permanent_launch_error_fails_at_once_names_the_call_and_keeps_the_instance(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    # botocore's default budget: a 403 must not be retried by it any more than by Temporal.
    async with fleet_behind_flaky_aws(client, aws_env, tmp_path, max_attempts=5) as fleet:
        await fleet.all_healthy()
        fleet.aws.fail("RunInstances", "UnauthorizedOperation")
        [faulty] = fleet.sim.live_instances()[:1]
        fleet.sim.inject_fault(faulty)

        [failed] = await eventually(lambda: asyncio.sleep(0, fleet.events("RepairFailed", faulty)), bool)
        assert "ec2:RunInstances" in failed["error"] and "UnauthorizedOperation" in failed["error"]
        handle = client.get_workflow_handle(repair_workflow_id(faulty))
        with pytest.raises(WorkflowFailureError) as raised:
            await asyncio.wait_for(handle.result(), timeout=60)
        cause = raised.value.cause
        assert isinstance(cause, ApplicationError) and cause.non_retryable and cause.type == "RepairFailed"
        assert "ec2:RunInstances" in cause.message and "UnauthorizedOperation" in cause.message
        assert (await handle.describe()).status == WorkflowExecutionStatus.FAILED

        # One request: neither botocore nor Temporal retried an error that no retry fixes, nor backed off.
        assert fleet.requests_about("RunInstances", faulty) == 1
        assert fleet.events("ReplacementLaunchFailed", faulty) == []
        # Never stop before start: without a replacement the impaired instance stays, drained but running.
        assert fleet.ec2_state(faulty) == "running"
        assert fleet.replacements_of(faulty) == []
        assert fleet.requests_about("TerminateInstances", faulty) == 0
        await eventually(lambda: asyncio.sleep(0, fleet.events("DrainPermitReleased", faulty)), bool)
        semaphore = await fleet.semaphore()
        assert semaphore.holders == [] and semaphore.waiters == []
        view = await eventually(
            lambda: fleet.health(faulty), lambda v: v.repair is not None and v.repair.error is not None
        )
        assert view.repair is not None and view.repair.phase is RepairPhase.FAILED
        assert view.repair.error is not None and "UnauthorizedOperation" in view.repair.error
