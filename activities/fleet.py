"""Fleet activities: the ECS and EC2 steps of a start-before-stop repair.

Every activity is idempotent, because Temporal may run it again after a timeout or a worker crash: each one
first looks at what AWS already has (the instance already DRAINING, a replacement already tagged for this
impaired instance, the instance already terminated) and treats "already done" as success.

The EC2 and Auto Scaling lookups are in activities/ec2.py, the two ways to launch a replacement in
activities/launch.py.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from activities.aws import AwsClients, aws_call
from activities.ec2 import GONE_EC2_STATES, Ec2, chunks
from activities.launch import Launcher
from activities.models import (
    ContainerInstanceRef,
    DrainResult,
    GoneInstance,
    GroupCapacity,
    GroupCapacityRequest,
    GroupConfigRequest,
    InstanceRef,
    InstancesGone,
    InstancesGoneRequest,
    InstanceTasks,
    LaunchRequest,
    LaunchResult,
    StopTasksRequest,
    StopTasksResult,
    TaskInfo,
    TerminateResult,
)
from activities.workflow_ops import live_group_config
from contract.groups import CapacityGroup, GroupConfigOverrides

if TYPE_CHECKING:
    from mypy_boto3_ecs.type_defs import ContainerInstanceTypeDef


REGISTERED_STATUSES = ("ACTIVE", "DRAINING")
MAX_REASON = 256
# The ECS agent's default (ECS_CONTAINER_STOP_TIMEOUT) for a container without stopTimeout, on EC2.
ECS_DEFAULT_STOP_TIMEOUT = 30
ECS_REASON_MAX = 255
# API batch limit.
ECS_DESCRIBE_BATCH = 100
# While waiting for ECS registration, look at the EC2 instance itself every this many polls (not every poll,
# to stay far from the EC2 API rate limits with many repairs waiting at once).
EC2_CHECK_EVERY_POLLS = 15

INSTANCE_ID = re.compile(r"^i-[0-9a-f]{8,17}$")


def _is_not_found(err: ApplicationError) -> bool:
    """ECS says "not found" with InvalidParameterException / ClientException; EC2 with a *.NotFound code."""
    return (err.type or "").endswith("NotFound") or "not found" in err.message.lower()


class FleetActivities:
    def __init__(
        self,
        aws: AwsClients,
        groups: Callable[[str], CapacityGroup],
        *,
        poll_interval: timedelta = timedelta(seconds=2),
        task_definition_cache_size: int = 256,
        client: Client | None = None,
    ) -> None:
        self._aws = aws
        self._ec2 = Ec2(aws)
        self._launch = Launcher(aws, self._ec2)
        self._groups = groups
        # Reads the live overrides an operator set on the group's drain semaphore; None: settings only.
        self._client = client
        self._poll_seconds = poll_interval.total_seconds()
        # Task definition revisions are immutable, so their stop timeouts never go stale; bounded (LRU)
        # because a long-running worker sees every revision ever deployed.
        self._stop_timeouts: OrderedDict[str, int] = OrderedDict()
        self._cache_size = task_definition_cache_size

    def activities(self) -> list[Callable[..., Any]]:
        """The bound activity methods, for `Worker(activities=...)`."""
        return [
            self.describe_group_capacity,
            self.get_group_config,
            self.set_draining,
            self.launch_replacement,
            self.await_container_instance_active,
            self.list_instance_tasks,
            self.stop_tasks,
            self.terminate_instance,
            self.instances_gone,
        ]

    # --- activities ---------------------------------------------------------------------------------------

    @activity.defn(name="instances_gone")
    async def instances_gone(self, request: InstancesGoneRequest) -> InstancesGone:
        """Which of these silent instances EC2 says are terminated or terminating: they left (scaled in, terminated
        by an operator, a Spot interruption), they did not fail. One call for a whole batch of losses, never a poll
        per instance."""
        found = await self._ec2.instances(request.instance_ids)
        return InstancesGone(
            gone=[
                GoneInstance(
                    instance_id=instance_id,
                    state=instance["State"]["Name"],
                    reason=instance.get("StateTransitionReason", "")[:MAX_REASON],
                )
                for instance_id, instance in sorted(found.items())
                # Left for good; stopping or stopped is not (it may start again), nor is one EC2 no longer knows.
                if instance.get("State", {}).get("Name") in GONE_EC2_STATES
            ]
        )

    @activity.defn(name="describe_group_capacity")
    async def describe_group_capacity(self, request: GroupCapacityRequest) -> GroupCapacity:
        """How many instances the group has in ECS now, and the drain cap that follows from it with the live
        overrides applied."""
        group = request.overrides.apply(self._group(request.group))
        arns: list[str] = []
        for status in REGISTERED_STATUSES:
            arns += await self._list_container_instance_arns(group.cluster, status=status)
        container_instances = await self._describe_container_instances(group.cluster, arns)
        ec2_ids = {ci["ec2InstanceId"] for ci in container_instances if ci.get("ec2InstanceId")}
        members = await self._ec2.members(group, ec2_ids)
        return GroupCapacity(
            group=group.name, instance_count=len(members), max_draining=group.max_draining(len(members))
        )

    @activity.defn(name="get_group_config")
    async def get_group_config(self, request: GroupConfigRequest) -> CapacityGroup:
        # An activity, not a workflow constant: the configuration can change between worker deploys (and live,
        # by `autorepair group update`), and the workflow must see it through history to stay deterministic.
        group = self._group(request.group)
        if not request.live_overrides:
            return group
        return (await self._live_overrides(group.name)).apply(group)

    @activity.defn(name="set_draining")
    async def set_draining(self, ref: InstanceRef) -> DrainResult:
        """Stop ECS placing tasks on the instance. Already DRAINING is success."""
        group = self._group(ref.group)
        ci = await self._find_container_instance(group, ref.instance_id)
        if ci is None:
            raise ApplicationError(
                f"ecs:ListContainerInstances: EC2 instance {ref.instance_id} is not registered in ECS "
                f"cluster {group.cluster} (capacity group {group.name})",
                type="ContainerInstanceNotFound",
                non_retryable=True,
            )
        arn = ci["containerInstanceArn"]
        if ci.get("status") != "DRAINING":
            resp = await aws_call(
                f"container instance {arn}",
                self._aws.ecs.update_container_instances_state,
                cluster=group.cluster,
                containerInstances=[arn],
                status="DRAINING",
            )
            for failure in resp.get("failures", []):
                reason = failure.get("reason", "unknown")
                missing = reason == "MISSING"
                raise ApplicationError(
                    f"ecs:UpdateContainerInstancesState on container instance {arn} failed: {reason}",
                    type="ContainerInstanceNotFound" if missing else "UpdateContainerInstancesStateFailed",
                    non_retryable=missing,
                )
        instance = await self._ec2.instance(ref.instance_id)
        return DrainResult(
            container_instance_arn=arn,
            availability_zone=(instance or {}).get("Placement", {}).get("AvailabilityZone"),
            subnet_id=(instance or {}).get("SubnetId"),
        )

    @activity.defn(name="launch_replacement")
    async def launch_replacement(self, request: LaunchRequest) -> LaunchResult:
        """Start the replacement before anything is stopped. Idempotent through the `replaces` tag."""
        group = self._group(request.group)
        _check_instance_id(request.impaired_instance_id)
        existing = await self._ec2.find_replacement(request.impaired_instance_id)
        if existing is not None:
            return LaunchResult(replacement_instance_id=existing, already_existed=True)
        if group.launch_template:
            return await self._launch.from_template(group, request)
        if group.auto_scaling_group:
            return await self._launch.in_auto_scaling_group(group, request)
        raise ApplicationError(
            f"capacity group {group.name} has neither launch_template nor auto_scaling_group: "
            "cannot launch a replacement",
            type="GroupNotLaunchable",
            non_retryable=True,
        )

    @activity.defn(name="await_container_instance_active")
    async def await_container_instance_active(self, ref: InstanceRef) -> ContainerInstanceRef:
        """Wait until the instance's ECS agent has registered it ACTIVE in the group's cluster.

        Runs under the workflow's start_to_close and heartbeat timeouts. Cancellation arrives as
        CancelledError at the next await (a heartbeat is what lets the server deliver it) and propagates.
        """
        group = self._group(ref.group)
        polls = 0
        while True:
            ci = await self._find_container_instance(group, ref.instance_id)
            status = ci.get("status", "UNKNOWN") if ci else "NOT_REGISTERED"
            if ci is not None and status == "ACTIVE":
                return ContainerInstanceRef(container_instance_arn=ci["containerInstanceArn"])
            if polls % EC2_CHECK_EVERY_POLLS == 0:
                instance = await self._ec2.instance(ref.instance_id)
                state = (instance or {}).get("State", {}).get("Name")
                # Waiting for an instance that is gone would only end at the timeout; fail now so the workflow
                # can launch another. (Not found just after launch is normal: EC2 is eventually consistent.)
                if state in GONE_EC2_STATES:
                    raise ApplicationError(
                        f"EC2 instance {ref.instance_id} is {state}: it will never register in ECS cluster "
                        f"{group.cluster}",
                        type="InstanceTerminated",
                        non_retryable=True,
                    )
            activity.heartbeat(status)
            polls += 1
            await asyncio.sleep(self._poll_seconds)

    @activity.defn(name="list_instance_tasks")
    async def list_instance_tasks(self, ref: InstanceRef) -> InstanceTasks:
        """Tasks still meant to run on the instance, each with how long ECS gives it to stop."""
        group = self._group(ref.group)
        ci = await self._find_container_instance(group, ref.instance_id)
        if ci is None:
            return InstanceTasks(tasks=[])  # deregistered: its tasks are gone with it
        instance = await self._ec2.instance(ref.instance_id)
        if instance is None or instance.get("State", {}).get("Name") in GONE_EC2_STATES:
            return InstanceTasks(tasks=[])
        arn = ci["containerInstanceArn"]
        task_arns: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"nextToken": token} if token else {}
            page = await aws_call(
                f"container instance {arn}",
                self._aws.ecs.list_tasks,
                cluster=group.cluster,
                containerInstance=arn,
                desiredStatus="RUNNING",
                **kwargs,
            )
            task_arns += page.get("taskArns", [])
            token = page.get("nextToken")
            if not token:
                break
        tasks: list[TaskInfo] = []
        for task in await self._describe_tasks(group.cluster, task_arns):
            timeout = await self._stop_timeout(task["taskDefinitionArn"])
            tasks.append(TaskInfo(task_arn=task["taskArn"], stop_timeout_seconds=timeout))
        return InstanceTasks(tasks=tasks)

    @activity.defn(name="stop_tasks")
    async def stop_tasks(self, request: StopTasksRequest) -> StopTasksResult:
        """Ask ECS to stop each task (SIGTERM, SIGKILL after its stop timeout). Already stopped is success."""
        group = self._group(request.group)
        if not request.task_arns:
            return StopTasksResult(stopped=0)
        current = {t["taskArn"]: t for t in await self._describe_tasks(group.cluster, request.task_arns)}
        stopped = 0
        for arn in request.task_arns:
            task = current.get(arn)
            # Missing (long gone) or already on its way down: nothing to ask, and it counts as stopped.
            if task is None or task.get("desiredStatus") == "STOPPED" or task.get("lastStatus") == "STOPPED":
                stopped += 1
                continue
            try:
                await aws_call(
                    f"task {arn} in cluster {group.cluster}",
                    self._aws.ecs.stop_task,
                    cluster=group.cluster,
                    task=arn,
                    reason=request.reason[:ECS_REASON_MAX],
                )
            except ApplicationError as err:
                if not _is_not_found(err):
                    raise
            stopped += 1
        return StopTasksResult(stopped=stopped)

    @activity.defn(name="terminate_instance")
    async def terminate_instance(self, ref: InstanceRef) -> TerminateResult:
        """Deregister from ECS, then terminate the EC2 instance. Already gone is success."""
        group = self._group(ref.group)
        _check_instance_id(ref.instance_id)
        ci = await self._find_container_instance(group, ref.instance_id)
        if ci is not None:
            arn = ci["containerInstanceArn"]
            try:
                # force: the tasks had their stop timeouts already; what is left must not block the repair.
                await aws_call(
                    f"container instance {arn}",
                    self._aws.ecs.deregister_container_instance,
                    cluster=group.cluster,
                    containerInstance=arn,
                    force=True,
                )
            except ApplicationError as err:
                if not _is_not_found(err):
                    raise
        try:
            resp = await aws_call(
                f"EC2 instance {ref.instance_id}",
                self._aws.ec2.terminate_instances,
                InstanceIds=[ref.instance_id],
            )
        except ApplicationError as err:
            if err.type == "InvalidInstanceID.NotFound":
                return TerminateResult(previous_state=None, already_terminated=True)
            raise
        previous = resp.get("TerminatingInstances", [{}])[0].get("PreviousState", {}).get("Name")
        return TerminateResult(previous_state=previous, already_terminated=previous in GONE_EC2_STATES)

    # --- lookups ------------------------------------------------------------------------------------------

    async def _live_overrides(self, group: str) -> GroupConfigOverrides:
        """The overrides of the group's drain semaphore, or those its last run left when none runs now (the next
        one takes them over). Any error but "no such workflow" is retried: applying the settings alone could undo
        an operator's DISABLED."""
        if self._client is None:
            return GroupConfigOverrides()
        state, _ = await live_group_config(self._client, group)
        return state.overrides if state is not None else GroupConfigOverrides()

    def _group(self, name: str) -> CapacityGroup:
        try:
            return self._groups(name)
        except KeyError as err:
            message = str(err.args[0]) if err.args else f"unknown capacity group {name!r}"
            raise ApplicationError(message, type="UnknownCapacityGroup", non_retryable=True) from err

    async def _list_container_instance_arns(
        self, cluster: str, *, status: str | None = None, query: str | None = None
    ) -> list[str]:
        arns: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"cluster": cluster}
            if status:
                kwargs["status"] = status
            if query:
                kwargs["filter"] = query
            if token:
                kwargs["nextToken"] = token
            page = await aws_call(f"ECS cluster {cluster}", self._aws.ecs.list_container_instances, **kwargs)
            arns += page.get("containerInstanceArns", [])
            token = page.get("nextToken")
            if not token:
                return arns

    async def _describe_container_instances(self, cluster: str, arns: Sequence[str]) -> list[ContainerInstanceTypeDef]:
        found: list[ContainerInstanceTypeDef] = []
        for chunk in chunks(arns, ECS_DESCRIBE_BATCH):
            resp = await aws_call(
                f"ECS cluster {cluster}",
                self._aws.ecs.describe_container_instances,
                cluster=cluster,
                containerInstances=chunk,
            )
            found += resp.get("containerInstances", [])
        return found

    async def _find_container_instance(self, group: CapacityGroup, instance_id: str) -> ContainerInstanceTypeDef | None:
        """The ACTIVE or DRAINING container instance of an EC2 instance in the group's cluster, if any."""
        _check_instance_id(instance_id)
        # Real ECS narrows the list with the cluster query; moto ignores `filter` and lists the whole cluster.
        # Matching ec2InstanceId below as well keeps one code path that is right on both.
        arns = await self._list_container_instance_arns(group.cluster, query=f"ec2InstanceId == {instance_id}")
        matches = [
            ci
            for ci in await self._describe_container_instances(group.cluster, arns)
            if ci.get("ec2InstanceId") == instance_id and ci.get("status") in REGISTERED_STATUSES
        ]
        if not matches:
            return None
        # A re-registered instance (agent state reset) has two; the newest is the live one.
        return max(matches, key=lambda ci: ci.get("registeredAt") or datetime.min.replace(tzinfo=UTC))

    async def _describe_tasks(self, cluster: str, task_arns: Sequence[str]) -> list[Any]:
        tasks: list[Any] = []
        for chunk in chunks(task_arns, ECS_DESCRIBE_BATCH):
            resp = await aws_call(
                f"tasks in ECS cluster {cluster}", self._aws.ecs.describe_tasks, cluster=cluster, tasks=chunk
            )
            tasks += resp.get("tasks", [])  # tasks ECS no longer knows come back under `failures`
        return tasks

    async def _stop_timeout(self, task_definition_arn: str) -> int:
        """Longest container stop timeout of a task definition; a container without one: agent default."""
        cached = self._stop_timeouts.get(task_definition_arn)
        if cached is not None:
            self._stop_timeouts.move_to_end(task_definition_arn)
            return cached
        resp = await aws_call(
            f"task definition {task_definition_arn}",
            self._aws.ecs.describe_task_definition,
            taskDefinition=task_definition_arn,
        )
        containers = resp.get("taskDefinition", {}).get("containerDefinitions", [])
        timeout = max(
            (c.get("stopTimeout") or ECS_DEFAULT_STOP_TIMEOUT for c in containers),
            default=ECS_DEFAULT_STOP_TIMEOUT,
        )
        self._stop_timeouts[task_definition_arn] = timeout
        while len(self._stop_timeouts) > self._cache_size:
            self._stop_timeouts.popitem(last=False)
        return timeout


def _check_instance_id(instance_id: str) -> None:
    # The id goes into a cluster query expression; anything that is not an instance id is a caller bug.
    if not INSTANCE_ID.match(instance_id):
        raise ApplicationError(
            f"{instance_id!r} is not an EC2 instance id", type="InvalidInstanceId", non_retryable=True
        )
