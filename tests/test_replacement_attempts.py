"""A replacement that never becomes ACTIVE is terminated and replaced, at most max_replacement_attempts per repair.

End to end on the real dev server, moto over HTTP and the simulated fleet (whose `unregistered_replacements` makes
a replacement's ECS agent never register), and the activities that make it safe against moto alone.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from pydantic import ValidationError
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from activities.aws import AwsClients
from activities.ec2 import REPLACES_TAG
from activities.launch import LAUNCH_TOKEN_TAG
from activities.models import LaunchRequest, ReplacementRef, ReplacementWait
from contract.config import AwsSettings
from contract.groups import CapacityGroup
from contract.ids import repair_workflow_id
from contract.repair import RepairPhase
from tests.fleet import Fleet, simulated_fleet
from tests.harness import eventually
from tests.test_fleet_activities import Fleet as MotoFleet
from tests.test_fleet_activities import make_template, permanent, run, unique
from workflows.models import RepairResult
from workflows.repair_replacement import CLIENT_TOKEN_MAX, client_token

# Far above the simulated boot (2 s to ACTIVE), far below the settings' 60 s: the test waits it out once or twice.
READY_TIMEOUT = timedelta(seconds=15)

REPLACED_ON_SECOND_ATTEMPT = [
    "RepairStarted",
    "DrainPermitGranted",
    "Draining",
    "ReplacementLaunched",
    "ReplacementAbandoned",
    "ReplacementLaunched",
    "ReplacementReady",
    "TasksStopped",
    "Terminated",
    "RepairCompleted",
    "DrainPermitReleased",
]


def set_group(fleet: Fleet, **update: Any) -> None:
    """Change the group's settings under the running worker: each repair reads them when it starts."""
    fleet.settings.groups[0] = fleet.settings.groups[0].model_copy(update=update)


def tags(fleet: Fleet, instance_id: str) -> dict[str, str]:
    described = fleet.ec2().describe_instances(InstanceIds=[instance_id])
    instance = described["Reservations"][0]["Instances"][0]
    return {t["Key"]: t["Value"] for t in instance.get("Tags", [])}


def container_status(fleet: Fleet, instance_id: str) -> str | None:
    ecs = boto3.client("ecs", endpoint_url=fleet.moto_endpoint, region_name="us-east-1")
    arns = ecs.list_container_instances(cluster=fleet.settings.groups[0].cluster)["containerInstanceArns"]
    described = ecs.describe_container_instances(cluster=fleet.settings.groups[0].cluster, containerInstances=arns)
    statuses = [ci["status"] for ci in described["containerInstances"] if ci["ec2InstanceId"] == instance_id]
    return statuses[0] if statuses else None


async def current_details(client: Client, workflow_id: str) -> str:
    """What the Web UI shows as the workflow's current details."""
    handle = client.get_workflow_handle(workflow_id)
    metadata = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    return metadata.current_details


async def test_a_replacement_that_never_registers_is_terminated_and_replaced(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        set_group(fleet, replacement_ready_timeout=READY_TIMEOUT)
        fleet.sim.unregistered_replacements = {1}
        await fleet.all_healthy(3)
        faulty, *others = fleet.sim.live_instances()
        fleet.sim.inject_fault(faulty)

        assert await fleet.repairs_finished(1, within=300) == [faulty]

        # Start before stop across attempts: the impaired instance is terminated once, after a ready replacement.
        assert fleet.steps(faulty) == REPLACED_ON_SECOND_ATTEMPT
        first, second = [e["detail"]["replacement_instance_id"] for e in fleet.events("ReplacementLaunched", faulty)]
        assert first != second
        assert [e["detail"]["attempt"] for e in fleet.events("ReplacementLaunched", faulty)] == [1, 2]
        [abandoned] = fleet.events("ReplacementAbandoned", faulty)
        assert abandoned["detail"]["attempt"] == 1 and abandoned["detail"]["attempts_left"] == 2
        assert abandoned["detail"]["replacement_instance_id"] == first
        assert abandoned["detail"]["why"] == "not ACTIVE in ECS within 15s"
        assert (
            abandoned["detail"]["error"].startswith("ReplacementNotReady: ")
            and "NOT_REGISTERED" in abandoned["detail"]["error"]
        )
        [ready] = fleet.events("ReplacementReady", faulty)
        assert (ready["detail"]["replacement_instance_id"], ready["detail"]["attempt"]) == (second, 2)
        [completed] = fleet.events("RepairCompleted")
        assert completed["detail"]["replacement_instance_id"] == second
        assert len(fleet.events("Terminated")) == 1

        # AWS: the impaired instance and the abandoned replacement terminated, nothing else.
        assert sorted(fleet.replacements_of(faulty)) == sorted([first, second])
        assert fleet.ec2_state(faulty) == "terminated"
        assert fleet.ec2_state(first) == "terminated"
        assert fleet.ec2_state(second) == "running"
        assert all(fleet.ec2_state(other) == "running" for other in others)
        # Each attempt launched with a token of its own: a repeated token would have brought the dead one back. The
        # repair is the instance's first attempt (repair/<instance>/1), which is in the token too.
        assert tags(fleet, first)[LAUNCH_TOKEN_TAG] == f"autorepair-{faulty}-1.1"
        assert tags(fleet, second)[LAUNCH_TOKEN_TAG] == f"autorepair-{faulty}-1.2"

        # The attempts in what `history` and the Web UI show.
        handle = client.get_workflow_handle(repair_workflow_id(faulty, 1), result_type=RepairResult)
        result = await handle.result()
        assert result.replacement_instance_id == second
        phases = [step.phase for step in result.timeline]
        assert phases.count(RepairPhase.LAUNCHING_REPLACEMENT) == 2
        assert phases.count(RepairPhase.WAITING_FOR_REPLACEMENT) == 2
        details = await current_details(client, repair_workflow_id(faulty, 1))
        assert f"{second} (attempt 2 of 3)" in details, details
        assert f"attempt 1: {first} not ACTIVE in ECS within 15s, terminated" in details, details

        semaphore = await fleet.semaphore()
        assert semaphore.holders == [] and semaphore.waiters == []
        await fleet.all_healthy(3)


async def test_when_no_replacement_becomes_active_the_repair_fails_and_keeps_the_instance(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        set_group(fleet, replacement_ready_timeout=READY_TIMEOUT, max_replacement_attempts=1)
        fleet.sim.unregistered_replacements = {1}
        await fleet.all_healthy(3)
        faulty = fleet.sim.live_instances()[0]
        fleet.sim.inject_fault(faulty)

        [failed] = await eventually(
            lambda: asyncio.sleep(0, fleet.events("RepairFailed")), lambda e: len(e) == 1, within=180
        )
        assert failed["detail"]["error"].startswith("no replacement became ACTIVE in ECS in 1 attempt ")
        assert f"{faulty} is left DRAINING and running, not terminated" in failed["detail"]["error"]
        handle = client.get_workflow_handle(repair_workflow_id(faulty, 1))
        await eventually(handle.describe, lambda d: d.status == WorkflowExecutionStatus.FAILED)
        with pytest.raises(WorkflowFailureError) as caught:
            await handle.result()
        assert isinstance(caught.value.cause, ApplicationError) and caught.value.cause.type == "RepairFailed"
        assert "left DRAINING" in caught.value.cause.message

        [launched] = fleet.events("ReplacementLaunched", faulty)
        [abandoned] = fleet.events("ReplacementAbandoned", faulty)
        replacement = launched["detail"]["replacement_instance_id"]
        assert (
            abandoned["detail"]["replacement_instance_id"] == replacement and abandoned["detail"]["attempts_left"] == 0
        )
        # Never stop before start: the impaired instance stays, drained but running; its replacement is gone.
        assert fleet.ec2_state(faulty) == "running"
        assert container_status(fleet, faulty) == "DRAINING"
        assert fleet.ec2_state(replacement) == "terminated"
        assert fleet.events("Terminated") == []
        await eventually(lambda: asyncio.sleep(0, fleet.events("DrainPermitReleased")), lambda e: len(e) == 1)
        assert fleet.steps(faulty) == [
            "RepairStarted",
            "DrainPermitGranted",
            "Draining",
            "ReplacementLaunched",
            "ReplacementAbandoned",
            "RepairFailed",
            "DrainPermitReleased",
        ]
        semaphore = await fleet.semaphore()
        assert semaphore.holders == [] and semaphore.waiters == []


# --- the pieces, against moto alone ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def aws_clients(aws_env: str) -> AwsClients:
    return AwsClients(AwsSettings(endpoint_url=aws_env, max_attempts=2))


@pytest.fixture
def moto_fleet(aws_clients: AwsClients) -> MotoFleet:
    template, _ = make_template(aws_clients)
    group = CapacityGroup(name=unique("group"), cluster=unique("cluster"), launch_template=template)
    return MotoFleet(aws_clients, group)


def test_each_attempt_has_its_own_client_token_within_ec2s_limit() -> None:
    instance_id = "i-" + "0123456789abcdef0"
    tokens = [client_token(instance_id, attempt) for attempt in range(1, 11)]
    assert tokens[0] == f"autorepair-{instance_id}-1"
    assert len(set(tokens)) == 10 and all(len(t) <= CLIENT_TOKEN_MAX for t in tokens)
    long = client_token("x" * 100, 10)
    assert len(long) == CLIENT_TOKEN_MAX and long.endswith("-10")
    # A later repair of the same instance never reuses an earlier one's tokens (EC2 would answer with its dead
    # replacement); a repair started before repairs had attempts (attempt 0) keeps the tokens it began with.
    by_repair = {client_token(instance_id, n, repair) for repair in (0, 1, 2, 10) for n in range(1, 11)}
    assert len(by_repair) == 40
    assert client_token(instance_id, 1, 0) == tokens[0] and client_token(instance_id, 2, 3) == f"{tokens[0][:-2]}-3.2"
    longest = client_token("x" * 100, 10, 10)
    assert len(longest) == CLIENT_TOKEN_MAX and longest.endswith("-10.10")


@pytest.mark.parametrize("attempts", [0, 11])
def test_max_replacement_attempts_is_bounded(attempts: int) -> None:
    assert CapacityGroup(name="g", cluster="c").max_replacement_attempts == 3
    with pytest.raises(ValidationError, match="max_replacement_attempts"):
        CapacityGroup(name="g", cluster="c", max_replacement_attempts=attempts)


async def test_a_retried_attempt_gets_its_instance_and_the_next_attempt_a_new_one(moto_fleet: MotoFleet) -> None:
    fleet = moto_fleet
    [impaired] = fleet.launch()

    def attempt(n: int) -> LaunchRequest:
        return LaunchRequest(
            group=fleet.group.name, impaired_instance_id=impaired, client_token=client_token(impaired, n)
        )

    first = await run(fleet.acts.launch_replacement, attempt(1))
    again = await run(fleet.acts.launch_replacement, attempt(1))
    assert again.already_existed and again.replacement_instance_id == first.replacement_instance_id

    abandon = ReplacementRef(
        group=fleet.group.name, instance_id=first.replacement_instance_id, impaired_instance_id=impaired
    )
    terminated = await run(fleet.acts.terminate_replacement, abandon)
    assert not terminated.already_terminated
    assert (await run(fleet.acts.terminate_replacement, abandon)).already_terminated

    second = await run(fleet.acts.launch_replacement, attempt(2))
    assert not second.already_existed and second.replacement_instance_id != first.replacement_instance_id
    [live] = fleet.replacements_of(impaired)
    assert live["InstanceId"] == second.replacement_instance_id


async def test_terminate_replacement_refuses_an_instance_that_is_not_one(moto_fleet: MotoFleet) -> None:
    fleet = moto_fleet
    impaired, serving = fleet.launch(2)
    fleet.aws.ec2.create_tags(Resources=[serving], Tags=[{"Key": REPLACES_TAG, "Value": "i-0000000000000000f"}])
    with pytest.raises(ApplicationError) as exc:
        await run(
            fleet.acts.terminate_replacement,
            ReplacementRef(group=fleet.group.name, instance_id=serving, impaired_instance_id=impaired),
        )
    assert serving in permanent(exc, "NotAReplacement")
    described = fleet.aws.ec2.describe_instances(InstanceIds=[serving])
    assert described["Reservations"][0]["Instances"][0]["State"]["Name"] == "running"


async def test_the_wait_ends_at_its_deadline_with_a_clear_permanent_error(moto_fleet: MotoFleet) -> None:
    fleet = moto_fleet
    [instance_id] = fleet.launch()
    wait = ReplacementWait(
        group=fleet.group.name, instance_id=instance_id, ready_by=datetime.now(UTC) + timedelta(seconds=0.3)
    )
    with pytest.raises(ApplicationError) as exc:
        await asyncio.wait_for(run(fleet.acts.await_container_instance_active, wait), timeout=10)
    message = permanent(exc, "ReplacementNotReady")
    assert instance_id in message and fleet.group.cluster in message and "NOT_REGISTERED" in message
