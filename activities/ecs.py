"""The group's ECS cluster as the activities read it: its container instances, their tasks, and the group a request
names.

Shared by the repair's fleet steps (activities/fleet.py), its in-place fixes (activities/remediation.py) and the
daemon-task reads (activities/daemon_tasks.py), so that all find an instance's container instance, and list and
describe tasks, the same way."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from temporalio.exceptions import ApplicationError

from activities.aws import AwsClients
from activities.ec2 import chunks
from contract.groups import CapacityGroup

if TYPE_CHECKING:
    from mypy_boto3_ecs.type_defs import ContainerInstanceTypeDef

REGISTERED_STATUSES = ("ACTIVE", "DRAINING")
# API batch limit.
ECS_DESCRIBE_BATCH = 100
INSTANCE_ID = re.compile(r"^i-[0-9a-f]{8,17}$")


def check_instance_id(instance_id: str) -> None:
    # The id goes into a cluster query expression; anything that is not an instance id is a caller bug.
    if not INSTANCE_ID.match(instance_id):
        raise ApplicationError(
            f"{instance_id!r} is not an EC2 instance id", type="InvalidInstanceId", non_retryable=True
        )


def resolve_group(groups: Callable[[str], CapacityGroup], name: str) -> CapacityGroup:
    """The named group of the settings; an unknown one is an error no retry fixes."""
    try:
        return groups(name)
    except KeyError as err:
        message = str(err.args[0]) if err.args else f"unknown capacity group {name!r}"
        raise ApplicationError(message, type="UnknownCapacityGroup", non_retryable=True) from err


def _registered_at(ci: ContainerInstanceTypeDef) -> datetime:
    return ci.get("registeredAt") or datetime.min.replace(tzinfo=UTC)


class Ecs:
    def __init__(self, aws: AwsClients) -> None:
        self._aws = aws

    async def container_instance_arns(
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
            page = await self._aws.call(f"ECS cluster {cluster}", self._aws.ecs.list_container_instances, **kwargs)
            arns += page.get("containerInstanceArns", [])
            token = page.get("nextToken")
            if not token:
                return arns

    async def describe_container_instances(self, cluster: str, arns: Sequence[str]) -> list[ContainerInstanceTypeDef]:
        """In batches side by side (AwsCalls bounds each API's calls in flight): a group of 1,000 is ten batches, on
        the way to every drain permit of a surge."""

        async def describe(chunk: list[str]) -> list[ContainerInstanceTypeDef]:
            resp = await self._aws.call(
                f"ECS cluster {cluster}",
                self._aws.ecs.describe_container_instances,
                cluster=cluster,
                containerInstances=chunk,
            )
            return resp.get("containerInstances", [])

        batches = await asyncio.gather(*(describe(chunk) for chunk in chunks(arns, ECS_DESCRIBE_BATCH)))
        return [ci for batch in batches for ci in batch]

    async def task_arns(self, cluster: str, **filters: str) -> list[str]:
        """The tasks ListTasks names with these filters (containerInstance, serviceName, desiredStatus), every page."""
        arns: list[str] = []
        kwargs: dict[str, Any] = {"cluster": cluster, **filters}
        while True:
            page = await self._aws.call(f"ECS cluster {cluster}", self._aws.ecs.list_tasks, **kwargs)
            arns += page.get("taskArns", [])
            if not page.get("nextToken"):
                return arns
            kwargs["nextToken"] = page["nextToken"]

    async def describe_tasks(self, cluster: str, arns: Sequence[str]) -> list[Any]:
        """Those tasks, ECS_DESCRIBE_BATCH a call; tasks ECS no longer knows come back under `failures`: left out."""
        tasks: list[Any] = []
        for chunk in chunks(list(arns), ECS_DESCRIBE_BATCH):
            resp = await self._aws.call(
                f"tasks in ECS cluster {cluster}", self._aws.ecs.describe_tasks, cluster=cluster, tasks=chunk
            )
            tasks += resp.get("tasks", [])
        return tasks

    async def find_container_instance(self, group: CapacityGroup, instance_id: str) -> ContainerInstanceTypeDef | None:
        """The ACTIVE or DRAINING container instance of an EC2 instance in the group's cluster, if any."""
        check_instance_id(instance_id)
        return (await self.registrations(group.cluster, instance_id)).get(instance_id)

    async def container_instance(
        self, group: CapacityGroup, instance_id: str, known_arn: str | None
    ) -> ContainerInstanceTypeDef | None:
        """find_container_instance, in one call where the caller knows the ARN: the one it knows, described, while it
        is still the instance's registration with its agent connected. Otherwise (deregistered, disconnected: its
        agent may have registered anew) the instance's newest registration is found, as without an ARN."""
        check_instance_id(instance_id)
        if known_arn:
            for ci in await self.describe_container_instances(group.cluster, [known_arn]):
                if (
                    ci.get("ec2InstanceId") == instance_id
                    and ci.get("status") in REGISTERED_STATUSES
                    and ci.get("agentConnected") is True
                ):
                    return ci
        return await self.find_container_instance(group, instance_id)

    async def registrations(self, cluster: str, instance_id: str | None = None) -> dict[str, ContainerInstanceTypeDef]:
        """EC2 instance id -> its ACTIVE or DRAINING container instance in the cluster (every instance's, or only
        `instance_id`'s, which the caller has checked)."""
        # Real ECS narrows the list with the cluster query; moto ignores `filter` and lists the whole cluster.
        # Matching ec2InstanceId below as well keeps one code path that is right on both.
        query = None if instance_id is None else f"ec2InstanceId == {instance_id}"
        newest: dict[str, ContainerInstanceTypeDef] = {}
        for ci in await self.describe_container_instances(
            cluster, await self.container_instance_arns(cluster, query=query)
        ):
            iid = ci.get("ec2InstanceId", "")
            if not iid or ci.get("status") not in REGISTERED_STATUSES or instance_id not in (None, iid):
                continue
            # A re-registered instance (agent state reset) has two; the newest is the live one.
            if iid not in newest or _registered_at(ci) >= _registered_at(newest[iid]):
                newest[iid] = ci
        return newest

    async def registered(self, group: CapacityGroup, instance_id: str, to_be: str) -> ContainerInstanceTypeDef:
        """The instance's container instance; not registered is an error no retry fixes."""
        ci = await self.find_container_instance(group, instance_id)
        if ci is None:
            raise ApplicationError(
                f"EC2 instance {instance_id} is not registered in ECS cluster {group.cluster} (capacity group "
                f"{group.name}): it cannot be set {to_be}",
                type="ContainerInstanceNotFound",
                non_retryable=True,
            )
        return ci

    async def set_status(
        self, cluster: str, ci: ContainerInstanceTypeDef, status: Literal["ACTIVE", "DRAINING"]
    ) -> bool:
        """Set the container instance ACTIVE or DRAINING; False when it already was (success: the step is done)."""
        if ci.get("status") == status:
            return False
        arn = ci["containerInstanceArn"]
        resp = await self._aws.call(
            f"container instance {arn}",
            self._aws.ecs.update_container_instances_state,
            cluster=cluster,
            containerInstances=[arn],
            status=status,
        )
        for failure in resp.get("failures", []):
            reason = failure.get("reason", "unknown")
            # MISSING: deregistered meanwhile, which no retry undoes; anything else may pass.
            missing = reason == "MISSING"
            raise ApplicationError(
                f"ecs:UpdateContainerInstancesState on container instance {arn} failed: {reason}",
                type="ContainerInstanceNotFound" if missing else "UpdateContainerInstancesStateFailed",
                non_retryable=missing,
            )
        return True
