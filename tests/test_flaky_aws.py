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
from typing import ClassVar

import pytest
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from contract.ids import health_workflow_id, repair_workflow_id
from contract.repair import RepairPhase
from simulator.aws_proxy import FlakyAws
from tests.fleet import Fleet, assert_start_before_stop, simulated_fleet
from tests.harness import eventually
from workflows.models import InstanceHealthView

INSTANCES = 3


@dataclass(kw_only=True)
class FlakyFleet(Fleet):
    """The simulated fleet, with the proxy the engine talks to AWS through."""

    aws: FlakyAws

    # Bounded, so a poll that gets no answer is retried by `eventually` rather than waited on.
    query_timeout: ClassVar[timedelta | None] = timedelta(seconds=5)

    async def repair_finished(self, instance_id: str) -> None:
        """Completed, and the permit handed back (the last thing a repair does)."""

        def finished() -> bool:
            return bool(self.events("RepairCompleted", instance_id) and self.events("DrainPermitReleased", instance_id))

        await eventually(lambda: asyncio.sleep(0, finished()), bool, within=180)

    async def health(self, instance_id: str) -> InstanceHealthView:
        handle = self.client.get_workflow_handle(health_workflow_id(instance_id))
        return await handle.query("health", result_type=InstanceHealthView, rpc_timeout=self.query_timeout)

    def requests_about(self, action: str, instance_id: str) -> int:
        """EC2 requests the engine sent for `action` naming `instance_id` (another repair's do not count)."""
        return sum(
            1 for s in self.aws.seen() if s.request.action == action and instance_id in s.request.params.values()
        )


async def assert_start_before_stop_as_aws_saw_it(fleet: FlakyFleet, instance_id: str) -> None:
    await assert_start_before_stop(fleet, instance_id, tolerating={"ReplacementLaunchFailed"})
    # The same order as AWS saw it: the impaired instance's termination was asked for only after its
    # replacement had been launched (the launch is tagged with the impaired id), and only once.
    about = [(s.request.action, s.status) for s in fleet.aws.seen() if instance_id in s.request.params.values()]
    launched = about.index(("RunInstances", 200))
    terminations = [i for i, (action, _) in enumerate(about) if action == "TerminateInstances"]
    assert len(terminations) == 1 and terminations[0] > launched, about


@asynccontextmanager
async def fleet_behind_flaky_aws(
    client: Client, moto_endpoint: str, tmp_path: Path, *, max_attempts: int
) -> AsyncIterator[FlakyFleet]:
    with FlakyAws(moto_endpoint) as aws:
        async with simulated_fleet(
            client,
            moto_endpoint,
            tmp_path,
            instances=INSTANCES,
            engine_proxy=aws,
            aws_max_attempts=max_attempts,
        ) as fleet:
            yield FlakyFleet(**vars(fleet), aws=aws)


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
        await fleet.all_healthy(INSTANCES)
        drain_throttle = fleet.aws.fail("UpdateContainerInstancesState", "ThrottlingException", times=4)
        # Every second DescribeInstances, for the whole repair: set_draining, the launch's idempotency look-up,
        # the wait for the replacement and the task listing all meet it.
        describe_throttle = fleet.aws.fail("DescribeInstances", "RequestLimitExceeded", every=2)
        [faulty] = fleet.sim.live_instances()[:1]
        fleet.sim.inject_fault(faulty)

        await fleet.repair_finished(faulty)
        await assert_start_before_stop_as_aws_saw_it(fleet, faulty)
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
        await fleet.all_healthy(INSTANCES)
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
        assert "InsufficientInstanceCapacity" in first_failure["detail"]["error"]
        assert "ec2:RunInstances" in first_failure["detail"]["error"]
        assert first_failure["detail"]["attempt"] == 1 and first_failure["detail"]["retry_in_seconds"] > 0
        # Backing off without a replacement: the impaired instance is drained but kept running.
        assert fleet.replacements_of(faulty) == []
        assert fleet.ec2_state(faulty) == "running"
        assert fleet.requests_about("TerminateInstances", faulty) == 0
        assert shortage.failed >= 3  # the activity's three attempts, before the workflow's backoff
        # botocore retried each 500 once (max_attempts=1) before the activity saw it.
        assert any(s.fault and s.request.attempt == 2 for s in fleet.aws.seen())

        fleet.aws.heal()
        await fleet.repair_finished(faulty)
        await assert_start_before_stop_as_aws_saw_it(fleet, faulty)
        steps = fleet.steps(faulty)
        assert steps.index("ReplacementLaunchFailed") < steps.index("ReplacementLaunched")
        assert steps.index("ReplacementReady") < steps.index("Terminated")
        assert all(
            "InsufficientInstanceCapacity" in e["detail"]["error"] for e in fleet.events("ReplacementLaunchFailed")
        )
        done = await fleet.health(faulty)
        assert done.repair is not None and done.repair.phase is RepairPhase.COMPLETED and done.repair.error is None


async def test_permanent_launch_error_fails_at_once_names_the_call_and_keeps_the_instance(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    # botocore's default budget: a 403 must not be retried by it any more than by Temporal.
    async with fleet_behind_flaky_aws(client, aws_env, tmp_path, max_attempts=5) as fleet:
        await fleet.all_healthy(INSTANCES)
        fleet.aws.fail("RunInstances", "UnauthorizedOperation")
        [faulty] = fleet.sim.live_instances()[:1]
        fleet.sim.inject_fault(faulty)

        [failed] = await eventually(lambda: asyncio.sleep(0, fleet.events("RepairFailed", faulty)), bool)
        assert "ec2:RunInstances" in failed["detail"]["error"] and "UnauthorizedOperation" in failed["detail"]["error"]
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
