"""`instances_gone`: which silent instances left on purpose, and why.

Against moto over HTTP where moto can play the cause (stopped, terminated, Auto Scaling standby and scale-in, ECS
deregistration, a fulfilled Spot request), through `FlakyAws` to count the calls and refuse some, and end to end in
the simulated fleet. moto cannot play a Spot interruption notice (its requests are always `fulfilled`), an Auto
Scaling lifecycle hook or a lingering Detaching/Detached state (it terminates or detaches at once), an INACTIVE
container instance (it forgets a deregistered one), or Capacity Reservations at all (DescribeCapacityReservations
answers 500): those are checked on the verdict (`departure`) with responses in the shape the real APIs return.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import boto3
import pytest
from temporalio.client import Client

from activities.aws import AwsClients
from activities.departures import Lookups, departure
from activities.fleet import FleetActivities
from activities.models import GoneCause, GoneInstance, InstancesGone, InstancesGoneRequest
from contract import names
from contract.config import AwsSettings
from contract.groups import CapacityGroup
from contract.health import HealthState
from contract.ids import health_workflow_id
from simulator.aws_proxy import FlakyAws
from tests.fleet import TIMING, simulated_fleet
from tests.harness import eventually
from tests.test_fleet_activities import Fleet, make_template, run, unique
from workflows.models import InstanceHealthView

NOW = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def aws(aws_env: str) -> AwsClients:
    return AwsClients(AwsSettings(endpoint_url=aws_env, max_attempts=2))


@pytest.fixture
def proxy(aws_env: str) -> Iterator[FlakyAws]:
    with FlakyAws(aws_env) as flaky:
        yield flaky


@dataclass
class Scene:
    """A group in moto (set up through moto directly) and the activities, which talk to AWS through the proxy."""

    fleet: Fleet
    proxy: FlakyAws
    acts: FleetActivities
    asg: str

    async def gone(self, instance_ids: list[str], group: str | None = None) -> dict[str, GoneInstance]:
        request = InstancesGoneRequest(group=group or self.fleet.group.name, instance_ids=instance_ids)
        answer: InstancesGone = await run(self.acts.instances_gone, request)
        return {g.instance_id: g for g in answer.gone}

    def asg_members(self) -> list[str]:
        resp = self.fleet.aws.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[self.asg])
        return sorted(i["InstanceId"] for i in resp["AutoScalingGroups"][0]["Instances"])

    def spot_instance(self) -> str:
        resp = self.fleet.aws.ec2.request_spot_instances(
            SpotPrice="30", LaunchSpecification={"ImageId": "ami-12c6146b", "InstanceType": "p4d.24xlarge"}
        )
        request_id = resp["SpotInstanceRequests"][0]["SpotInstanceRequestId"]
        described = self.fleet.aws.ec2.describe_spot_instance_requests(SpotInstanceRequestIds=[request_id])
        return described["SpotInstanceRequests"][0]["InstanceId"]


@pytest.fixture
def scene(aws: AwsClients, proxy: FlakyAws) -> Scene:
    template, _ = make_template(aws)
    subnet = aws.ec2.describe_subnets(Filters=[{"Name": "availability-zone", "Values": ["us-east-1a"]}])
    asg = unique("asg")
    aws.autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=asg,
        LaunchTemplate={"LaunchTemplateName": template, "Version": "$Latest"},
        MinSize=0,
        MaxSize=5,
        DesiredCapacity=2,
        VPCZoneIdentifier=subnet["Subnets"][0]["SubnetId"],
    )
    fleet = Fleet(aws, CapacityGroup(name=unique("group"), cluster=unique("cluster"), auto_scaling_group=asg))
    engine = AwsClients(AwsSettings(endpoint_url=proxy.url, max_attempts=2))
    acts = FleetActivities(engine, fleet.groups.__getitem__, poll_interval=timedelta(seconds=0.05))
    return Scene(fleet=fleet, proxy=proxy, acts=acts, asg=asg)


# --- against moto ---------------------------------------------------------------------------------------------


async def test_running_and_registered_is_not_gone(scene: Scene) -> None:
    ids = scene.fleet.launch(2) + scene.asg_members() + [scene.spot_instance()]
    for instance_id in ids:
        scene.fleet.register(instance_id)
    assert await scene.gone(ids) == {}


async def test_stopped_by_anyone_is_gone_with_ec2s_reason(scene: Scene) -> None:
    stopped, running = scene.fleet.launch(2)
    for instance_id in (stopped, running):
        scene.fleet.register(instance_id)
    scene.fleet.aws.ec2.stop_instances(InstanceIds=[stopped])

    gone = await scene.gone([stopped, running])

    assert list(gone) == [stopped]
    assert (gone[stopped].cause, gone[stopped].state) == (GoneCause.EC2_STOPPED, "stopped")
    assert gone[stopped].reason.startswith("User initiated")


async def test_terminated_is_gone_and_an_unknown_instance_is_not(scene: Scene) -> None:
    [terminated] = scene.fleet.launch()
    scene.fleet.register(terminated)
    scene.fleet.aws.ec2.terminate_instances(InstanceIds=[terminated])

    gone = await scene.gone([terminated, "i-0123456789abcdef0"])

    assert list(gone) == [terminated]
    assert gone[terminated].cause is GoneCause.EC2_TERMINATED
    assert gone[terminated].state in ("shutting-down", "terminated")


async def test_auto_scaling_standby_is_leaving_and_in_service_is_not(scene: Scene) -> None:
    standby, in_service = scene.asg_members()
    for instance_id in (standby, in_service):
        scene.fleet.register(instance_id)
    scene.fleet.aws.autoscaling.enter_standby(
        AutoScalingGroupName=scene.asg, InstanceIds=[standby], ShouldDecrementDesiredCapacity=True
    )

    gone = await scene.gone([standby, in_service])

    assert list(gone) == [standby]
    assert (gone[standby].cause, gone[standby].state) == (GoneCause.ASG_LEAVING, "running")
    assert gone[standby].reason == f"Auto Scaling group {scene.asg} has it Standby: put in standby"


async def test_auto_scaling_scale_in_is_gone(scene: Scene) -> None:
    members = scene.asg_members()
    for instance_id in members:
        scene.fleet.register(instance_id)
    # moto terminates the instance it scales in at once (no Terminating state, no lifecycle hook): EC2 says so.
    scene.fleet.aws.autoscaling.set_desired_capacity(AutoScalingGroupName=scene.asg, DesiredCapacity=1)
    [scaled_in] = sorted(set(members) - set(scene.asg_members()))

    gone = await scene.gone(members)

    assert list(gone) == [scaled_in]
    assert gone[scaled_in].cause is GoneCause.EC2_TERMINATED


async def test_deregistered_from_ecs_is_gone(scene: Scene) -> None:
    deregistered, never_registered, registered = scene.fleet.launch(3)
    arn = scene.fleet.register(deregistered)
    scene.fleet.register(registered)
    scene.fleet.aws.ecs.deregister_container_instance(
        cluster=scene.fleet.group.cluster, containerInstance=arn, force=True
    )

    gone = await scene.gone([deregistered, never_registered, registered])

    # One that never registered counts too (a member by its tag alone): a repair could not drain it either.
    assert sorted(gone) == sorted([deregistered, never_registered])
    for instance_id in (deregistered, never_registered):
        assert (gone[instance_id].cause, gone[instance_id].state) == (GoneCause.ECS_DEREGISTERED, "running")
        assert gone[instance_id].reason == (
            f"no longer registered in ECS cluster {scene.fleet.group.cluster} (deregistered)"
        )


async def test_one_call_per_api_per_batch_chunked_by_the_apis_limits(scene: Scene) -> None:
    plain = scene.fleet.launch(57)
    members = scene.asg_members()
    spot = scene.spot_instance()
    batch = [*plain, *members, spot]  # 60 running instances
    for instance_id in batch:
        scene.fleet.register(instance_id)
    scene.fleet.aws.ec2.stop_instances(InstanceIds=[plain[0]])

    gone = await scene.gone([*batch, "i-0123456789abcdef0"])

    assert list(gone) == [plain[0]]
    calls = {
        action: scene.proxy.calls(action)
        for action in (
            "DescribeInstances",  # 200 ids a call
            "DescribeAutoScalingInstances",  # 50 a call: the 59 still running
            "ListContainerInstances",  # 50 ids per cluster query: the 59 still running
            "DescribeContainerInstances",  # 100 a call; moto ignores the query and lists all 60 per chunk
            "DescribeSpotInstanceRequests",  # only the Spot instance
            "DescribeCapacityReservations",  # none is in a reservation
        )
    }
    assert calls == {
        "DescribeInstances": 1,
        "DescribeAutoScalingInstances": 2,
        "ListContainerInstances": 2,
        "DescribeContainerInstances": 2,
        "DescribeSpotInstanceRequests": 1,
        "DescribeCapacityReservations": 0,
    }


@pytest.mark.parametrize(
    ("action", "code"),
    [
        ("DescribeAutoScalingInstances", "AccessDenied"),
        ("ListContainerInstances", "AccessDeniedException"),
        ("DescribeContainerInstances", "ThrottlingException"),  # past botocore's retries: every attempt fails
        ("DescribeSpotInstanceRequests", "UnauthorizedOperation"),
    ],
)
async def test_an_extra_read_refused_proves_nothing_and_fails_nothing(
    scene: Scene, action: str, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    standby, in_service = scene.asg_members()
    stopped, deregistered = scene.fleet.launch(2)
    spot = scene.spot_instance()
    for instance_id in (standby, in_service, stopped, spot):
        scene.fleet.register(instance_id)
    scene.fleet.aws.autoscaling.enter_standby(
        AutoScalingGroupName=scene.asg, InstanceIds=[standby], ShouldDecrementDesiredCapacity=True
    )
    scene.fleet.aws.ec2.stop_instances(InstanceIds=[stopped])
    scene.proxy.fail(action, code)

    gone = await scene.gone([standby, in_service, stopped, deregistered, spot])

    assert scene.proxy.injected(action) >= 1
    expected = {stopped: GoneCause.EC2_STOPPED}
    if action != "DescribeAutoScalingInstances":
        expected[standby] = GoneCause.ASG_LEAVING
    if action not in ("ListContainerInstances", "DescribeContainerInstances"):
        expected[deregistered] = GoneCause.ECS_DEREGISTERED
    assert {i: g.cause for i, g in gone.items()} == expected
    assert any("not read for" in r.getMessage() and code in r.getMessage() for r in caplog.records)


async def test_ec2_refused_fails_the_check(scene: Scene) -> None:
    # EC2's own read is the one the verdict stands on: the workflow retries it, then tells the losses as lost.
    [instance_id] = scene.fleet.launch()
    scene.proxy.fail("DescribeInstances", "UnauthorizedOperation")
    with pytest.raises(Exception, match="UnauthorizedOperation"):
        await scene.gone([instance_id])


async def test_unknown_group_still_answers_from_ec2(scene: Scene) -> None:
    stopped, unregistered = scene.fleet.launch(2)
    scene.fleet.aws.ec2.stop_instances(InstanceIds=[stopped])

    gone = await scene.gone([stopped, unregistered], group="no-such-group")

    assert {i: g.cause for i, g in gone.items()} == {stopped: GoneCause.EC2_STOPPED}
    assert scene.proxy.calls("ListContainerInstances") == 0


# --- the verdict, on responses shaped like the real APIs' -----------------------------------------------------

ID = "i-0a1b2c3d4e5f60718"
CLUSTER = "gpu-training"


def instance(state: str = "running", **extra: Any) -> Any:
    """An element of DescribeInstances' Reservations[].Instances[], as boto3 parses it."""
    return {
        "InstanceId": ID,
        "InstanceType": "p5.48xlarge",
        "State": {"Code": {"running": 16, "stopped": 80, "terminated": 48}.get(state, 0), "Name": state},
        "StateTransitionReason": "" if state == "running" else "User initiated (2026-12-01 09:58:02 GMT)",
        **extra,
    }


def asg_member(lifecycle: str) -> Any:
    """An element of DescribeAutoScalingInstances' AutoScalingInstances[]."""
    return {
        "InstanceId": ID,
        "InstanceType": "p5.48xlarge",
        "AutoScalingGroupName": "p5-training-asg",
        "AvailabilityZone": "us-east-1a",
        "LifecycleState": lifecycle,
        "HealthStatus": "HEALTHY",
        "LaunchTemplate": {"LaunchTemplateId": "lt-0123456789abcdef0", "Version": "7"},
        "ProtectedFromScaleIn": False,
    }


def spot_request(code: str, message: str = "") -> Any:
    """An element of DescribeSpotInstanceRequests' SpotInstanceRequests[]."""
    return {
        "SpotInstanceRequestId": "sir-7n3pgx2k",
        "InstanceId": ID,
        "State": "active",
        "Status": {"Code": code, "Message": message, "UpdateTime": NOW - timedelta(minutes=1)},
        "Type": "one-time",
        "InstanceInterruptionBehavior": "terminate",
    }


def reservation(state: str, end: datetime, kind: str = "capacity-block") -> Any:
    """An element of DescribeCapacityReservations' CapacityReservations[]."""
    return {
        "CapacityReservationId": "cr-0f1e2d3c4b5a69788",
        "InstanceType": "p5.48xlarge",
        "AvailabilityZone": "us-east-1a",
        "TotalInstanceCount": 4,
        "AvailableInstanceCount": 0,
        "State": state,
        "StartDate": end - timedelta(days=7),
        "EndDate": end,
        "EndDateType": "limited",
        "ReservationType": kind,
    }


def verdict(inst: Any, **lookups: Any) -> GoneInstance | None:
    return departure(inst, Lookups(cluster=CLUSTER, **lookups), NOW)


@pytest.mark.parametrize(
    ("lifecycle", "meaning"),
    [
        ("Terminating", "being terminated (scale-in, instance refresh or rebalancing)"),
        ("Terminating:Wait", "being terminated, held by a termination lifecycle hook"),
        ("Terminating:Proceed", "being terminated, past its termination lifecycle hook"),
        ("Detaching", "being detached from the group"),
        ("Detached", "detached from the group"),
        ("EnteringStandby", "being put in standby"),
        ("Standby", "put in standby"),
    ],
)
def test_auto_scaling_leaving_states(lifecycle: str, meaning: str) -> None:
    gone = verdict(instance(), asg={ID: asg_member(lifecycle)})
    assert gone == GoneInstance(
        instance_id=ID,
        state="running",
        cause=GoneCause.ASG_LEAVING,
        reason=f"Auto Scaling group p5-training-asg has it {lifecycle}: {meaning}",
    )


@pytest.mark.parametrize("lifecycle", ["InService", "Pending", "Pending:Wait", "Quarantined", "Warmed:Running"])
def test_auto_scaling_staying_states(lifecycle: str) -> None:
    assert verdict(instance(), asg={ID: asg_member(lifecycle)}) is None


def test_ec2_says_more_than_auto_scaling_about_a_stopped_instance() -> None:
    gone = verdict(instance("stopped"), asg={ID: asg_member("Standby")})
    assert gone is not None and gone.cause is GoneCause.EC2_STOPPED
    assert gone.reason == "User initiated (2026-12-01 09:58:02 GMT)"


@pytest.mark.parametrize(
    ("statuses", "reason"),
    [
        ([], f"no longer registered in ECS cluster {CLUSTER} (deregistered)"),
        (["INACTIVE"], f"deregistered from ECS cluster {CLUSTER} (INACTIVE)"),
        (["DEREGISTERING", "INACTIVE"], f"deregistered from ECS cluster {CLUSTER} (DEREGISTERING/INACTIVE)"),
        (["INACTIVE", "ACTIVE"], None),  # re-registered: the live one counts
        (["DRAINING"], None),
        (["REGISTERING"], None),
        (["REGISTRATION_FAILED"], None),  # a fault, not a departure
    ],
)
def test_ecs_registrations(statuses: list[str], reason: str | None) -> None:
    gone = verdict(instance(), registrations={ID: statuses})
    assert (gone.reason if gone else None) == reason
    if gone:
        assert gone.cause is GoneCause.ECS_DEREGISTERED


def test_ecs_not_asked_or_pending_proves_nothing() -> None:
    assert verdict(instance()) is None  # the read failed: the instance is not in the mapping
    assert verdict(instance("pending"), registrations={ID: []}) is None  # not registered yet


@pytest.mark.parametrize(
    "code",
    [
        "marked-for-termination",
        "marked-for-stop",
        "marked-for-hibernation",
        "instance-terminated-by-price",
        "instance-terminated-no-capacity",
        "instance-stopped-no-capacity",
    ],
)
def test_spot_interruption(code: str) -> None:
    message = "Spot Instance terminated due to no available capacity."
    gone = verdict(instance(InstanceLifecycle="spot"), spot={ID: spot_request(code, message)})
    assert gone is not None and (gone.cause, gone.state) == (GoneCause.SPOT_INTERRUPTION, "running")
    assert gone.reason == f"Spot interruption: {code} ({message})"


def test_spot_interruption_is_the_root_cause_of_a_termination() -> None:
    inst = instance("terminated", InstanceLifecycle="spot")
    inst["StateTransitionReason"] = "Service initiated (2026-12-01 09:58:02 GMT)"
    gone = verdict(inst, spot={ID: spot_request("instance-terminated-no-capacity")})
    assert gone is not None and (gone.cause, gone.state) == (GoneCause.SPOT_INTERRUPTION, "terminated")
    assert (
        gone.reason == "Spot interruption: instance-terminated-no-capacity; Service initiated (2026-12-01 09:58:02 GMT)"
    )


@pytest.mark.parametrize("code", ["fulfilled", "request-canceled-and-instance-running", "instance-terminated-by-user"])
def test_spot_status_that_is_no_interruption(code: str) -> None:
    assert verdict(instance(InstanceLifecycle="spot"), spot={ID: spot_request(code)}) is None


def test_a_spot_request_of_an_on_demand_instance_is_ignored() -> None:
    assert verdict(instance(), spot={ID: spot_request("marked-for-termination")}) is None


@pytest.mark.parametrize(
    ("state", "ends_in", "kind", "reason"),
    [
        ("expired", timedelta(hours=-1), "capacity-block", "Capacity Block cr-0f1e2d3c4b5a69788 expired"),
        ("cancelled", timedelta(days=2), "capacity-block", "Capacity Block cr-0f1e2d3c4b5a69788 cancelled"),
        (
            "active",
            timedelta(minutes=25),
            "capacity-block",
            "Capacity Block cr-0f1e2d3c4b5a69788 ends 2026-12-01T10:25:00+00:00",
        ),
        ("active", timedelta(minutes=45), "capacity-block", None),
        ("active", timedelta(days=3), "capacity-block", None),
        ("expired", timedelta(hours=-1), "default", None),  # an ordinary reservation's instances keep running
    ],
)
def test_capacity_block(state: str, ends_in: timedelta, kind: str, reason: str | None) -> None:
    block = reservation(state, NOW + ends_in, kind)
    inst = instance(CapacityReservationId=block["CapacityReservationId"])
    gone = verdict(inst, reservations={block["CapacityReservationId"]: block})
    assert (gone.reason if gone else None) == reason
    if gone:
        assert gone.cause is GoneCause.CAPACITY_BLOCK_ENDING


def test_nothing_said_is_not_gone_and_reasons_are_bounded() -> None:
    assert verdict(instance()) is None
    inst = instance("stopped")
    inst["StateTransitionReason"] = "x" * 1000
    gone = verdict(inst, asg={ID: asg_member("Standby")})
    assert gone is not None and len(gone.reason) == 256


def test_gone_instance_wire_is_lenient() -> None:
    old = GoneInstance.model_validate({"instance_id": ID, "state": "terminated", "reason": "User initiated"})
    assert old.cause is GoneCause.EC2_TERMINATED
    newer = GoneInstance.model_validate({"instance_id": ID, "state": "running", "cause": "reboot_migration"})
    assert newer.cause is GoneCause.OTHER
    assert InstancesGone.model_validate({"gone": [{"instance_id": ID, "state": "stopped"}]}).gone[0].state == "stopped"


# --- end to end: the simulated fleet, the real engine --------------------------------------------------------


async def retired(fleet: Any, client: Client, instance_id: str, *, may_return: bool) -> dict[str, Any]:
    [event] = await eventually(
        lambda: asyncio.sleep(0, fleet.events("InstanceRetired")), lambda found: len(found) == 1, within=120
    )
    assert event["instance_id"] == instance_id and event["detail"]["may_return"] is may_return
    handle = client.get_workflow_handle(health_workflow_id(instance_id), result_type=InstanceHealthView)
    if may_return:
        # Dormant: not a fault, never repaired, and still there for the instance's return.
        view = await handle.query(names.QUERY_HEALTH, result_type=InstanceHealthView)
        assert not view.retired and view.retired_reason == event["detail"]["reason"]
        assert view.healthStatus.overallStatus is HealthState.INSUFFICIENT_DATA
    else:
        view = await handle.result()
        assert view.retired and view.retired_reason == event["detail"]["reason"]
    assert fleet.events("RepairStarted") == [] and fleet.replacements_of(instance_id) == []
    return cast(dict[str, Any], event)


async def test_a_stopped_instance_retires_without_a_repair(client: Client, aws_env: str, tmp_path: Path) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        await fleet.all_healthy(3)
        left = fleet.sim.live_instances()[0]
        fleet.ec2().stop_instances(InstanceIds=[left])
        event = await retired(fleet, client, left, may_return=True)
        assert event["detail"]["reason"].startswith(
            ("stopped in EC2: User initiated", "stopping in EC2: User initiated")
        )


async def test_an_instance_deregistered_from_ecs_rests_without_a_repair_and_is_watched_again_when_back(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        await fleet.all_healthy(3)
        left = fleet.sim.live_instances()[0]
        arn = fleet.sim.node(left).container_instance_arn
        assert arn is not None
        # Taken out of the cluster (by an operator, or a drain-and-deregister script), and its agent with it for
        # longer than the threshold; then its agent comes back.
        ecs = boto3.client("ecs", endpoint_url=aws_env, region_name="us-east-1")
        ecs.deregister_container_instance(cluster=fleet.sim.cluster, containerInstance=arn, force=True)
        await fleet.sim.blip(left, TIMING.heartbeat_loss_threshold * 6)
        event = await retired(fleet, client, left, may_return=True)
        assert event["detail"]["reason"] == (
            f"running in EC2: no longer registered in ECS cluster {fleet.sim.cluster} (deregistered)"
        )
        [back] = await eventually(
            lambda: asyncio.sleep(0, fleet.events("InstanceReturned")), lambda found: len(found) == 1, within=120
        )
        assert back["instance_id"] == left and back["detail"]["left_because"] == event["detail"]["reason"]
        handle = client.get_workflow_handle(health_workflow_id(left))
        view = await eventually(
            lambda: handle.query(names.QUERY_HEALTH, result_type=InstanceHealthView),
            lambda v: v.healthStatus.overallStatus is HealthState.OK,
        )
        assert view.retired_reason is None and not view.retired
        assert fleet.events("RepairStarted") == []
