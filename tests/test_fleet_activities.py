"""Fleet activities against a real moto server over HTTP (state shared by the session: unique names)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from botocore.exceptions import ClientError
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import fleet as fleet_module
from activities.aws import AwsClients
from activities.ec2 import DETACHED_AT_TAG, REPLACES_TAG
from activities.errors import aws_errors, is_retryable
from activities.fleet import FleetActivities
from activities.models import (
    GroupCapacityRequest,
    GroupConfigRequest,
    InstanceRef,
    KnownInstance,
    LaunchRequest,
    ReplacementWait,
    StopTasksRequest,
    TasksWait,
)
from contract.config import AwsSettings
from contract.groups import CapacityGroup
from contract.names import GROUP_TAG
from simulator.aws_proxy import FlakyAws
from simulator.fleet_aws import freeze_moto_task_lifecycle

if TYPE_CHECKING:
    from mypy_boto3_ec2.type_defs import TagTypeDef

AMI = "ami-12c6146b"  # one of moto's built-in AMIs
T = TypeVar("T")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def run(fn: Callable[[Any], Awaitable[T]], arg: Any) -> T:
    """Run an activity method in an activity context (heartbeat, cancellation), as a worker would."""
    return await ActivityEnvironment().run(fn, arg)


async def retried(fn: Callable[[Any], Awaitable[T]], arg: Any) -> T:
    """`run`, as the activity's second attempt (an earlier one's answer lost with its worker)."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, attempt=2)
    return await env.run(fn, arg)


@pytest.fixture(scope="module")
def aws(aws_env: str) -> AwsClients:
    return AwsClients(AwsSettings(endpoint_url=aws_env, max_attempts=2))


@dataclass
class Fleet:
    """One capacity group of its own in moto: cluster, launch template, activities, and helpers."""

    aws: AwsClients
    group: CapacityGroup
    groups: dict[str, CapacityGroup] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.add(self.group)
        self.aws.ecs.create_cluster(clusterName=self.group.cluster)
        self.acts = FleetActivities(self.aws, self.groups.__getitem__, poll_interval=timedelta(seconds=0.05))

    def add(self, group: CapacityGroup) -> None:
        self.groups[group.name] = group

    def launch(self, count: int = 1, az: str = "us-east-1a", tagged: bool = True) -> list[str]:
        tags: list[TagTypeDef] = [{"Key": GROUP_TAG if tagged else "other", "Value": self.group.name}]
        resp = self.aws.ec2.run_instances(
            ImageId=AMI,
            InstanceType="p4d.24xlarge",
            MinCount=count,
            MaxCount=count,
            Placement={"AvailabilityZone": az},
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )
        return [i["InstanceId"] for i in resp["Instances"]]

    def register(self, instance_id: str, az: str = "us-east-1a") -> str:
        doc = json.dumps({"instanceId": instance_id, "availabilityZone": az})
        resp = self.aws.ecs.register_container_instance(cluster=self.group.cluster, instanceIdentityDocument=doc)
        return resp["containerInstance"]["containerInstanceArn"]

    def status(self, arn: str) -> str:
        resp = self.aws.ecs.describe_container_instances(cluster=self.group.cluster, containerInstances=[arn])
        return resp["containerInstances"][0]["status"]

    def replacements_of(self, impaired: str) -> list[dict[str, Any]]:
        resp = self.aws.ec2.describe_instances(
            Filters=[
                {"Name": f"tag:{REPLACES_TAG}", "Values": [impaired]},
                {"Name": "instance-state-name", "Values": ["pending", "running"]},
            ]
        )
        return [dict(i) for r in resp["Reservations"] for i in r["Instances"]]


def make_template(aws: AwsClients) -> tuple[str, str]:
    name = unique("lt")  # an "lt-" name that is not an id shape
    resp = aws.ec2.create_launch_template(
        LaunchTemplateName=name, LaunchTemplateData={"ImageId": AMI, "InstanceType": "p4d.24xlarge"}
    )
    return name, resp["LaunchTemplate"]["LaunchTemplateId"]


@pytest.fixture
def fleet(aws: AwsClients) -> Fleet:
    template, _ = make_template(aws)
    return Fleet(aws, CapacityGroup(name=unique("group"), cluster=unique("cluster"), launch_template=template))


def permanent(exc: pytest.ExceptionInfo[ApplicationError], type_: str) -> str:
    assert exc.value.type == type_, str(exc.value)
    assert exc.value.non_retryable, str(exc.value)
    return exc.value.message


# --- capacity and config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("count", "cap"), [(20, 4), (6, 1), (9, 1), (10, 2)])
async def test_capacity_counts_group_instances_and_caps_draining(fleet: Fleet, count: int, cap: int) -> None:
    for instance_id in fleet.launch(count):
        fleet.register(instance_id)
    # Not counted: an instance of another group in the same cluster, and one launched but never registered.
    fleet.register(fleet.launch(tagged=False)[0])
    fleet.launch()

    result = await run(fleet.acts.describe_group_capacity, GroupCapacityRequest(group=fleet.group.name))

    assert (result.group, result.instance_count, result.max_draining) == (fleet.group.name, count, cap)


async def test_capacity_of_a_large_group_describes_its_batches_side_by_side(fleet: Fleet, aws_env: str) -> None:
    """250 container instances are three DescribeContainerInstances batches, and ACTIVE and DRAINING two listings:
    the count waits for the slowest of each, not their sum (it is on the way to every drain permit of a surge)."""
    for instance_id in fleet.launch(250):
        fleet.register(instance_id)
    with FlakyAws(aws_env) as proxy:
        proxy.slow("DescribeContainerInstances", 0.5)
        proxy.slow("ListContainerInstances", 0.5)
        slow = FleetActivities(
            AwsClients(AwsSettings(endpoint_url=proxy.url, max_attempts=2)), fleet.groups.__getitem__
        )
        result = await run(slow.describe_group_capacity, GroupCapacityRequest(group=fleet.group.name))
        assert proxy.calls("DescribeContainerInstances") == 3
        assert proxy.peak_in_flight >= 3  # a batch beside another, and a listing beside another
    assert (result.instance_count, result.max_draining) == (250, 50)


async def test_capacity_counts_draining_and_drops_deregistered(fleet: Fleet) -> None:
    ids = fleet.launch(3)
    arns = [fleet.register(i) for i in ids]
    await run(fleet.acts.set_draining, InstanceRef(group=fleet.group.name, instance_id=ids[0]))
    fleet.aws.ecs.deregister_container_instance(cluster=fleet.group.cluster, containerInstance=arns[1], force=True)

    result = await run(fleet.acts.describe_group_capacity, GroupCapacityRequest(group=fleet.group.name))

    assert (result.instance_count, result.max_draining) == (2, 1)


async def test_get_group_config_and_unknown_group(fleet: Fleet) -> None:
    assert await run(fleet.acts.get_group_config, GroupConfigRequest(group=fleet.group.name)) == fleet.group
    with pytest.raises(ApplicationError) as exc:
        await run(fleet.acts.describe_group_capacity, GroupCapacityRequest(group="no-such-group"))
    assert "no-such-group" in permanent(exc, "UnknownCapacityGroup")


# --- draining -----------------------------------------------------------------------------------------------


async def test_set_draining_is_idempotent_and_reports_placement(fleet: Fleet) -> None:
    [instance_id] = fleet.launch(az="us-east-1b")
    arn = fleet.register(instance_id, az="us-east-1b")
    ref = InstanceRef(group=fleet.group.name, instance_id=instance_id)

    first = await run(fleet.acts.set_draining, ref)
    second = await run(fleet.acts.set_draining, ref)

    assert first == second
    assert first.container_instance_arn == arn
    assert first.availability_zone == "us-east-1b"
    assert first.subnet_id and first.subnet_id.startswith("subnet-")
    assert fleet.status(arn) == "DRAINING"


async def test_expected_gpus_are_the_instance_types_and_unknown_is_none(fleet: Fleet) -> None:
    [instance_id] = fleet.launch()
    found = await run(fleet.acts.expected_gpus, InstanceRef(group=fleet.group.name, instance_id=instance_id))
    assert (found.instance_type, found.gpus) == ("p4d.24xlarge", 8)
    gone = await run(fleet.acts.expected_gpus, InstanceRef(group=fleet.group.name, instance_id="i-0000000000nothere"))
    assert (gone.instance_type, gone.gpus) == (None, None)


async def test_set_draining_of_unregistered_instance_is_permanent(fleet: Fleet) -> None:
    [instance_id] = fleet.launch()
    with pytest.raises(ApplicationError) as exc:
        await run(fleet.acts.set_draining, InstanceRef(group=fleet.group.name, instance_id=instance_id))
    message = permanent(exc, "ContainerInstanceNotFound")
    assert instance_id in message and fleet.group.cluster in message


# --- launching ----------------------------------------------------------------------------------------------


async def test_launch_replacement_is_idempotent_and_in_the_impaired_az(fleet: Fleet) -> None:
    [impaired] = fleet.launch(az="us-east-1c")
    fleet.register(impaired, az="us-east-1c")
    drained = await run(fleet.acts.set_draining, InstanceRef(group=fleet.group.name, instance_id=impaired))
    request = LaunchRequest(
        group=fleet.group.name,
        impaired_instance_id=impaired,
        availability_zone=drained.availability_zone,
        client_token=f"repair-{impaired}",
    )

    first = await run(fleet.acts.launch_replacement, request)
    second = await run(fleet.acts.launch_replacement, request)

    assert not first.already_existed
    assert second.already_existed
    assert second.replacement_instance_id == first.replacement_instance_id != impaired
    [replacement] = fleet.replacements_of(impaired)  # exactly one instance in moto
    assert replacement["InstanceId"] == first.replacement_instance_id
    assert replacement["Placement"]["AvailabilityZone"] == "us-east-1c"
    tags = {t["Key"]: t["Value"] for t in replacement["Tags"]}
    assert tags[GROUP_TAG] == fleet.group.name and tags[REPLACES_TAG] == impaired and tags["Name"]


async def test_launch_replacement_by_template_id_into_the_subnet(aws: AwsClients) -> None:
    _, template_id = make_template(aws)
    fleet = Fleet(aws, CapacityGroup(name=unique("group"), cluster=unique("cluster"), launch_template=template_id))
    [impaired] = fleet.launch(az="us-east-1b")
    fleet.register(impaired, az="us-east-1b")
    drained = await run(fleet.acts.set_draining, InstanceRef(group=fleet.group.name, instance_id=impaired))

    result = await run(
        fleet.acts.launch_replacement,
        LaunchRequest(
            group=fleet.group.name,
            impaired_instance_id=impaired,
            subnet_id=drained.subnet_id,
            client_token="t-1",
        ),
    )

    [replacement] = fleet.replacements_of(impaired)
    assert replacement["InstanceId"] == result.replacement_instance_id
    assert replacement["SubnetId"] == drained.subnet_id
    assert replacement["Tags"] and {"Key": "aws:ec2launchtemplate:id", "Value": template_id} in replacement["Tags"]


@pytest.mark.parametrize("first_try", [True, False])
@pytest.mark.parametrize(
    ("template", "code"),
    [
        ("no-such-template", "InvalidLaunchTemplateName.NotFoundException"),
        ("lt-0123456789abcdef0", "InvalidLaunchTemplateId.NotFound"),
    ],
)
async def test_launch_from_missing_template_is_permanent_with_clear_message(
    aws: AwsClients, template: str, code: str, first_try: bool
) -> None:
    fleet = Fleet(aws, CapacityGroup(name=unique("group"), cluster=unique("cluster"), launch_template=template))
    [impaired] = fleet.launch()
    request = LaunchRequest(
        group=fleet.group.name, impaired_instance_id=impaired, client_token="t-1", first_try=first_try
    )

    with pytest.raises(ApplicationError) as exc:
        await run(fleet.acts.launch_replacement, request)

    message = permanent(exc, code)
    assert "ec2:DescribeLaunchTemplates" in message and template in message and fleet.group.name in message
    assert "\n" not in message
    assert fleet.replacements_of(impaired) == []


async def test_the_first_try_launches_at_once_and_a_retry_looks_first(fleet: Fleet) -> None:
    """The workflow's first try at a token, on the activity's first attempt, cannot have launched anything: one call
    (RunInstances). A retry of it (the activity's next attempt: the worker may have died after the launch) looks for
    the instance first and hands it back instead of launching a second."""
    [impaired] = fleet.launch()
    request = LaunchRequest(group=fleet.group.name, impaired_instance_id=impaired, client_token="t-1", first_try=True)

    with api_calls(fleet.aws) as called:
        first = await run(fleet.acts.launch_replacement, request)
    assert called == ["RunInstances"]
    assert not first.already_existed

    with api_calls(fleet.aws) as called:
        again = await retried(fleet.acts.launch_replacement, request)
    assert called == ["DescribeInstances"]
    assert again.already_existed and again.replacement_instance_id == first.replacement_instance_id
    next_try = await run(fleet.acts.launch_replacement, request.model_copy(update={"first_try": False}))
    assert next_try.already_existed and next_try.replacement_instance_id == first.replacement_instance_id
    [only] = fleet.replacements_of(impaired)
    assert only["InstanceId"] == first.replacement_instance_id


async def test_a_retried_launch_finds_its_replacement_even_once_the_template_is_gone(aws: AwsClients) -> None:
    # The template is looked up beside the search for the attempt's replacement: the one found still wins.
    name, _ = make_template(aws)
    fleet = Fleet(aws, CapacityGroup(name=unique("group"), cluster=unique("cluster"), launch_template=name))
    [impaired] = fleet.launch()
    request = LaunchRequest(group=fleet.group.name, impaired_instance_id=impaired, client_token="t-1")
    first = await run(fleet.acts.launch_replacement, request)
    aws.ec2.delete_launch_template(LaunchTemplateName=name)

    again = await run(fleet.acts.launch_replacement, request)

    assert again.already_existed and again.replacement_instance_id == first.replacement_instance_id
    other = request.model_copy(update={"client_token": "t-2"})
    with pytest.raises(ApplicationError) as exc:
        await run(fleet.acts.launch_replacement, other)  # a new attempt: the template is needed, and missing
    assert name in permanent(exc, "InvalidLaunchTemplateName.NotFoundException")


@dataclass
class AsgFleet:
    fleet: Fleet
    asg: str
    original: list[str]

    def members(self) -> dict[str, Any]:
        resp = self.fleet.aws.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[self.asg])
        return dict(resp["AutoScalingGroups"][0])


@pytest.fixture
def asg_fleet(aws: AwsClients) -> AsgFleet:
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
    resp = aws.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[asg])
    original = sorted(i["InstanceId"] for i in resp["AutoScalingGroups"][0]["Instances"])
    # EC2 LaunchTime has whole seconds: let them tick so the replacement is told from the originals.
    time.sleep(1.1)
    return AsgFleet(fleet, asg, original)


async def test_launch_in_auto_scaling_group_waits_for_the_group_to_launch(asg_fleet: AsgFleet) -> None:
    fleet = asg_fleet.fleet
    # An instance detached (by an earlier attempt) after every instance the group has was launched.
    [detached] = fleet.launch(tagged=False)
    fleet.aws.ec2.create_tags(
        Resources=[detached], Tags=[{"Key": DETACHED_AT_TAG, "Value": datetime.now(UTC).isoformat()}]
    )
    request = LaunchRequest(group=fleet.group.name, impaired_instance_id=detached, client_token="t-1")

    with pytest.raises(ApplicationError) as exc:
        await run(fleet.acts.launch_replacement, request)

    assert exc.value.type == "ReplacementNotYetLaunched" and not exc.value.non_retryable
    assert fleet.replacements_of(detached) == []


async def test_launch_in_auto_scaling_group_of_a_non_member_is_permanent(asg_fleet: AsgFleet) -> None:
    fleet = asg_fleet.fleet
    [stranger] = fleet.launch(tagged=False)
    request = LaunchRequest(group=fleet.group.name, impaired_instance_id=stranger, client_token="t-1")
    with pytest.raises(ApplicationError) as exc:
        await run(fleet.acts.launch_replacement, request)
    assert asg_fleet.asg in permanent(exc, "NotInAutoScalingGroup")


# --- waiting for the replacement ----------------------------------------------------------------------------


async def test_await_active_returns_once_registered(fleet: Fleet) -> None:
    [instance_id] = fleet.launch()
    ref = InstanceRef(group=fleet.group.name, instance_id=instance_id)
    waiting = asyncio.create_task(run(fleet.acts.await_container_instance_active, ref))
    await asyncio.sleep(0.3)
    assert not waiting.done()

    arn = fleet.register(instance_id)

    result = await asyncio.wait_for(waiting, timeout=10)
    assert result.container_instance_arn == arn


async def test_await_active_honours_cancellation(fleet: Fleet) -> None:
    [instance_id] = fleet.launch()
    env = ActivityEnvironment()
    waiting = asyncio.create_task(
        env.run(
            fleet.acts.await_container_instance_active,
            ReplacementWait(group=fleet.group.name, instance_id=instance_id),
        )
    )
    await asyncio.sleep(0.3)
    env.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, timeout=10)


async def test_await_active_of_terminated_instance_is_permanent(fleet: Fleet) -> None:
    [instance_id] = fleet.launch()
    fleet.aws.ec2.terminate_instances(InstanceIds=[instance_id])
    with pytest.raises(ApplicationError) as exc:
        await run(
            fleet.acts.await_container_instance_active,
            InstanceRef(group=fleet.group.name, instance_id=instance_id),
        )
    assert instance_id in permanent(exc, "InstanceTerminated")


# --- tasks --------------------------------------------------------------------------------------------------


def start_tasks(fleet: Fleet, container_instance_arn: str) -> dict[str, int]:
    """Two tasks: one with containers of 90 s and 10 s stop timeouts, one with none set (ECS default 30 s)."""
    family = unique("family")
    expected: dict[str, int] = {}
    for suffix, timeouts in (("slow", [90, 10]), ("default", [None, None])):
        containers: list[Any] = []
        for n, timeout in enumerate(timeouts):
            container: dict[str, Any] = {"name": f"c{n}", "image": "nvidia/cuda", "memory": 64}
            if timeout is not None:
                container["stopTimeout"] = timeout
            containers.append(container)
        fleet.aws.ecs.register_task_definition(family=f"{family}-{suffix}", containerDefinitions=containers)
        resp = fleet.aws.ecs.start_task(
            cluster=fleet.group.cluster,
            taskDefinition=f"{family}-{suffix}",
            containerInstances=[container_instance_arn],
        )
        expected[resp["tasks"][0]["taskArn"]] = 90 if suffix == "slow" else 30
    return expected


async def test_list_tasks_stop_timeouts_and_stop_tasks_twice(fleet: Fleet) -> None:
    [instance_id] = fleet.launch()
    arn = fleet.register(instance_id)
    expected = start_tasks(fleet, arn)
    ref = KnownInstance(group=fleet.group.name, instance_id=instance_id)

    listed = await run(fleet.acts.list_instance_tasks, ref)
    assert {t.task_arn: t.stop_timeout_seconds for t in listed.tasks} == expected

    stop = StopTasksRequest(group=fleet.group.name, task_arns=sorted(expected), reason="gpu-autorepair: XID_79")
    assert (await run(fleet.acts.stop_tasks, stop)).stopped == 2
    assert (await run(fleet.acts.stop_tasks, stop)).stopped == 2
    assert (await run(fleet.acts.list_instance_tasks, ref)).tasks == []
    for task in fleet.aws.ecs.describe_tasks(cluster=fleet.group.cluster, tasks=sorted(expected))["tasks"]:
        assert task["lastStatus"] == "STOPPED"


async def test_the_drain_wait_answers_when_tasks_are_gone_at_its_deadline_or_on_a_new_task(
    fleet: Fleet, aws_env: str
) -> None:
    freeze_moto_task_lifecycle(aws_env)
    [instance_id] = fleet.launch()
    arn = fleet.register(instance_id)
    expected = start_tasks(fleet, arn)
    known = sorted(expected)
    heartbeats: list[Any] = []
    env = ActivityEnvironment()
    env.on_heartbeat = heartbeats.append

    def wait(until: datetime, known: list[str]) -> Awaitable[Any]:
        request = TasksWait(group=fleet.group.name, instance_id=instance_id, until=until, known=known, poll_seconds=0.2)
        return env.run(fleet.acts.wait_for_tasks_to_stop, request)

    # Nothing changes: it looks until its deadline, heartbeating each look, and answers what still runs.
    began = time.monotonic()
    still = await wait(datetime.now(UTC) + timedelta(seconds=1), known)
    assert time.monotonic() - began >= 1.0
    assert sorted(t.task_arn for t in still.tasks) == known
    assert len(heartbeats) >= 3

    # A task it was not told of: answered at once, far from its deadline, so the workflow gives it its timeout.
    began = time.monotonic()
    seen = await wait(datetime.now(UTC) + timedelta(minutes=5), known[:1])
    assert time.monotonic() - began < 30
    assert sorted(t.task_arn for t in seen.tasks) == known

    # The tasks stop while it waits: answered with none left, long before its deadline.
    async def stop_soon() -> None:
        await asyncio.sleep(0.5)
        stop = StopTasksRequest(group=fleet.group.name, task_arns=known, reason="gpu-autorepair: drained")
        assert (await run(fleet.acts.stop_tasks, stop)).stopped == 2

    began = time.monotonic()
    stopper = asyncio.create_task(stop_soon())
    gone = await wait(datetime.now(UTC) + timedelta(minutes=5), known)
    await stopper
    assert gone.tasks == []
    assert time.monotonic() - began < 30


async def test_the_drain_wait_ends_when_the_instance_is_terminated_under_it(
    fleet: Fleet, aws_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look lists the tasks alone; whether the instance is still there is asked every EC2_CHECK_EVERY (shortened
    here), so one terminated meanwhile ends the wait with nothing left to stop, long before its deadline."""
    monkeypatch.setattr(fleet_module, "EC2_CHECK_EVERY", timedelta(seconds=0.5))
    freeze_moto_task_lifecycle(aws_env)
    [instance_id] = fleet.launch()
    known = sorted(start_tasks(fleet, fleet.register(instance_id)))
    request = TasksWait(
        group=fleet.group.name,
        instance_id=instance_id,
        until=datetime.now(UTC) + timedelta(minutes=5),
        known=known,
        poll_seconds=0.1,
    )

    async def terminate_soon() -> None:
        await asyncio.sleep(0.5)
        await asyncio.to_thread(fleet.aws.ec2.terminate_instances, InstanceIds=[instance_id])

    began = time.monotonic()
    terminator = asyncio.create_task(terminate_soon())
    left = await ActivityEnvironment().run(fleet.acts.wait_for_tasks_to_stop, request)
    await terminator
    assert left.tasks == []
    assert time.monotonic() - began < 30


async def test_stop_tasks_of_unknown_task_is_success(fleet: Fleet) -> None:
    gone = f"arn:aws:ecs:us-east-1:123456789012:task/{fleet.group.cluster}/{uuid.uuid4().hex}"
    stop = StopTasksRequest(group=fleet.group.name, task_arns=[gone], reason="r")
    assert (await run(fleet.acts.stop_tasks, stop)).stopped == 1


async def test_list_tasks_of_deregistered_or_terminated_instance_is_empty(fleet: Fleet) -> None:
    deregistered, terminated = fleet.launch(2)
    arn = fleet.register(deregistered)
    start_tasks(fleet, arn)
    fleet.aws.ecs.deregister_container_instance(cluster=fleet.group.cluster, containerInstance=arn, force=True)
    start_tasks(fleet, fleet.register(terminated))
    fleet.aws.ec2.terminate_instances(InstanceIds=[terminated])

    for instance_id, known in ((deregistered, arn), (terminated, None)):
        ref = KnownInstance(group=fleet.group.name, instance_id=instance_id, container_instance_arn=known)
        assert (await run(fleet.acts.list_instance_tasks, ref)).tasks == []


# --- terminating --------------------------------------------------------------------------------------------


async def test_terminate_twice(fleet: Fleet) -> None:
    [instance_id] = fleet.launch()
    arn = fleet.register(instance_id)
    ref = KnownInstance(group=fleet.group.name, instance_id=instance_id)

    first = await run(fleet.acts.terminate_instance, ref)
    second = await run(fleet.acts.terminate_instance, ref)

    assert (first.previous_state, first.already_terminated) == ("running", False)
    assert second.already_terminated
    assert arn not in fleet.aws.ecs.list_container_instances(cluster=fleet.group.cluster)["containerInstanceArns"]


async def test_terminate_unknown_instance_is_already_terminated(fleet: Fleet) -> None:
    ref = KnownInstance(group=fleet.group.name, instance_id="i-0123456789abcdef0")
    result = await run(fleet.acts.terminate_instance, ref)
    assert result.already_terminated and result.previous_state is None


@contextmanager
def api_calls(aws: AwsClients) -> Iterator[list[str]]:
    """The EC2 and ECS operations called meanwhile, by name (botocore's retries of one call count once)."""
    called: list[str] = []

    def record(model: Any, **_: Any) -> None:
        called.append(model.name)

    clients = (aws.ec2, aws.ecs)
    for client in clients:
        client.meta.events.register("before-call", record)
    try:
        yield called
    finally:
        for client in clients:
            client.meta.events.unregister("before-call", record)


async def test_a_known_container_instance_is_described_not_looked_for(fleet: Fleet) -> None:
    """The repair passes on the container instance set_draining found: its tasks are listed beside one look at it,
    and the termination deregisters it without finding it again (and without looking at EC2 first)."""
    [instance_id] = fleet.launch()
    arn = fleet.register(instance_id)
    expected = start_tasks(fleet, arn)
    ref = KnownInstance(group=fleet.group.name, instance_id=instance_id, container_instance_arn=arn)

    with api_calls(fleet.aws) as called:
        listed = await run(fleet.acts.list_instance_tasks, ref)
    assert {t.task_arn: t.stop_timeout_seconds for t in listed.tasks} == expected
    assert "ListContainerInstances" not in called
    assert called.count("DescribeContainerInstances") == called.count("ListTasks") == 1

    with api_calls(fleet.aws) as called:
        terminated = await run(fleet.acts.terminate_instance, ref)
    assert (terminated.previous_state, terminated.already_terminated) == ("running", False)
    assert sorted(called) == ["DeregisterContainerInstance", "DescribeContainerInstances", "TerminateInstances"]
    assert arn not in fleet.aws.ecs.list_container_instances(cluster=fleet.group.cluster)["containerInstanceArns"]
    # Asked again by a later step (a first attempt): EC2 answers that it was already terminated.
    assert (await run(fleet.acts.terminate_instance, ref)).already_terminated
    # A retry of the activity (its answer may have been lost) looks first and does not ask EC2 again.
    with api_calls(fleet.aws) as called:
        again = await retried(fleet.acts.terminate_instance, ref)
    assert again.already_terminated and "TerminateInstances" not in called and "DescribeInstances" in called


async def test_a_known_container_instance_no_longer_registered_is_found_again(fleet: Fleet) -> None:
    """The ARN the repair knows was deregistered and the instance registered anew: the tasks listed and the
    registration deregistered are the new one's."""
    [instance_id] = fleet.launch()
    old = fleet.register(instance_id)
    fleet.aws.ecs.deregister_container_instance(cluster=fleet.group.cluster, containerInstance=old, force=True)
    new = fleet.register(instance_id)
    expected = start_tasks(fleet, new)
    ref = KnownInstance(group=fleet.group.name, instance_id=instance_id, container_instance_arn=old)

    with api_calls(fleet.aws) as called:
        listed = await run(fleet.acts.list_instance_tasks, ref)
    assert {t.task_arn: t.stop_timeout_seconds for t in listed.tasks} == expected
    assert "ListContainerInstances" in called

    await run(fleet.acts.terminate_instance, ref)
    assert new not in fleet.aws.ecs.list_container_instances(cluster=fleet.group.cluster)["containerInstanceArns"]


async def test_malformed_instance_id_is_permanent(fleet: Fleet) -> None:
    ref = KnownInstance(group=fleet.group.name, instance_id="i-1 or ec2InstanceId exists")
    with pytest.raises(ApplicationError) as exc:
        await run(fleet.acts.terminate_instance, ref)
    permanent(exc, "InvalidInstanceId")


# --- error classification -----------------------------------------------------------------------------------


def client_error(code: str, status: int = 400) -> ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": f"{code} happened\nsecond line"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "RunInstances")


@pytest.mark.parametrize(
    ("code", "status", "retryable"),
    [
        ("Throttling", 400, True),
        ("ThrottlingException", 400, True),
        ("RequestLimitExceeded", 503, True),
        ("TooManyRequestsException", 429, True),
        ("InsufficientInstanceCapacity", 500, True),
        ("InsufficientCapacity", 400, True),
        ("ServerInternal", 500, True),
        ("ServiceUnavailable", 503, True),
        ("Unavailable", 503, True),
        ("SomethingNew", 500, True),
        ("ValidationError", 400, False),
        ("AccessDenied", 403, False),
        ("UnauthorizedOperation", 403, False),
        ("InvalidParameterValue", 400, False),
        ("InvalidParameterException", 400, False),
        ("InvalidLaunchTemplateName.NotFoundException", 400, False),
        ("SomethingElseNew", 400, False),
    ],
)
def test_classification(code: str, status: int, retryable: bool) -> None:
    assert is_retryable(code, status) is retryable
    with pytest.raises(ApplicationError) as exc, aws_errors("ec2:RunInstances", "launch template lt-1"):
        raise client_error(code, status)
    assert exc.value.type == code
    assert exc.value.non_retryable is not retryable
    assert exc.value.message == f"ec2:RunInstances on launch template lt-1 failed: {code}: {code} happened second line"


async def test_an_aws_call_names_the_operation(aws: AwsClients) -> None:
    with pytest.raises(ApplicationError) as exc:
        await aws.call("EC2 instance i-0123456789abcdef0", aws.ec2.stop_instances, InstanceIds=["i-0123456789abcdef0"])
    message = permanent(exc, "InvalidInstanceID.NotFound")
    assert message.startswith("ec2:StopInstances on EC2 instance i-0123456789abcdef0 failed:")
