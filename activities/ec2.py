"""EC2 and Auto Scaling lookups shared by the fleet activities and the launch strategies.

Instances belong to a capacity group when their EC2 tag `gpu-autorepair:group` names the group, or when they are
members of the group's Auto Scaling group. A replacement carries a `replaces` tag naming the instance it replaces:
that tag is the idempotency key of every launch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from temporalio.exceptions import ApplicationError

from activities.aws import AwsClients
from contract.groups import CapacityGroup
from contract.names import GROUP_TAG

if TYPE_CHECKING:
    from mypy_boto3_autoscaling.type_defs import AutoScalingGroupTypeDef
    from mypy_boto3_ec2.type_defs import InstanceTypeDef, TagTypeDef

REPLACES_TAG = "gpu-autorepair:replaces"
# Auto Scaling mode: when the impaired instance was detached (AWS clock), so the instance the group launched
# after it can be told from the ones it already had, even on a retry that lost everything in memory.
DETACHED_AT_TAG = "gpu-autorepair:detached-at"

LIVE_EC2_STATES = ["pending", "running", "stopping", "stopped"]
GONE_EC2_STATES = frozenset({"shutting-down", "terminated"})
# API batch limit.
EC2_FILTER_VALUES_MAX = 200

T = TypeVar("T")


def chunks(items: Sequence[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def tags_of(tags: Iterable[TagTypeDef] | None) -> dict[str, str]:
    return {t.get("Key", ""): t.get("Value", "") for t in tags or ()}


class Ec2:
    """Reads and tags EC2 instances and Auto Scaling groups, batching and paging as the APIs require."""

    def __init__(self, aws: AwsClients) -> None:
        self._aws = aws
        # An instance type's GPUs never change: read once per type a worker meets (a few dozen at most).
        self._gpus_of_type: dict[str, int | None] = {}

    async def instances(self, instance_ids: Iterable[str]) -> dict[str, InstanceTypeDef]:
        """Instances by id. A filter, not InstanceIds=, so an id that no longer exists is skipped."""
        ids = sorted(set(instance_ids))
        found: dict[str, InstanceTypeDef] = {}

        async def describe(chunk: list[str]) -> None:
            token: str | None = None
            while True:
                kwargs: dict[str, Any] = {"NextToken": token} if token else {}
                page = await self._aws.call(
                    f"EC2 instances {', '.join(chunk[:3])}{'...' if len(chunk) > 3 else ''}",
                    self._aws.ec2.describe_instances,
                    Filters=[{"Name": "instance-id", "Values": chunk}],
                    **kwargs,
                )
                for reservation in page.get("Reservations", []):
                    for inst in reservation.get("Instances", []):
                        found[inst["InstanceId"]] = inst
                token = page.get("NextToken")
                if not token:
                    break

        # The chunks side by side (AwsCalls bounds each API's calls in flight), each one's pages in turn.
        await asyncio.gather(*(describe(chunk) for chunk in chunks(ids, EC2_FILTER_VALUES_MAX)))
        return found

    async def instance(self, instance_id: str) -> InstanceTypeDef | None:
        return (await self.instances([instance_id])).get(instance_id)

    async def gpus_of_type(self, instance_type: str) -> int | None:
        """The GPUs an instance type has (None: EC2 gives no GPU information for it)."""
        if instance_type not in self._gpus_of_type:
            resp = await self._aws.call(
                f"instance type {instance_type}",
                self._aws.ec2.describe_instance_types,
                InstanceTypes=[instance_type],  # type: ignore[list-item]
            )
            types = resp.get("InstanceTypes", [])
            gpus = types[0].get("GpuInfo", {}).get("Gpus") if types else None
            self._gpus_of_type[instance_type] = sum(g.get("Count", 0) for g in gpus) if gpus else None
        return self._gpus_of_type[instance_type]

    async def auto_scaling_group(self, group: CapacityGroup) -> AutoScalingGroupTypeDef:
        name = group.auto_scaling_group or ""
        resp = await self._aws.call(
            f"Auto Scaling group {name}",
            self._aws.autoscaling.describe_auto_scaling_groups,
            AutoScalingGroupNames=[name],
        )
        groups = resp.get("AutoScalingGroups", [])
        if not groups:
            raise ApplicationError(
                f"autoscaling:DescribeAutoScalingGroups: Auto Scaling group {name} of capacity group "
                f"{group.name} does not exist",
                type="AutoScalingGroupNotFound",
                non_retryable=True,
            )
        return groups[0]

    async def members(self, group: CapacityGroup, instance_ids: Iterable[str]) -> set[str]:
        """The live instances among `instance_ids` in the group (by tag or Auto Scaling membership)."""
        asg_ids: set[str] = set()

        async def asg_members() -> None:
            if group.auto_scaling_group:
                asg = await self.auto_scaling_group(group)
                asg_ids.update(i["InstanceId"] for i in asg.get("Instances", []))

        _, instances = await asyncio.gather(asg_members(), self.instances(instance_ids))
        return {
            iid
            for iid, inst in instances.items()
            if inst.get("State", {}).get("Name") in LIVE_EC2_STATES
            and (tags_of(inst.get("Tags")).get(GROUP_TAG) == group.name or iid in asg_ids)
        }

    async def tag(self, instance_id: str, tags: dict[str, str]) -> None:
        await self._aws.call(
            f"EC2 instance {instance_id}",
            self._aws.ec2.create_tags,
            Resources=[instance_id],
            Tags=[{"Key": k, "Value": v} for k, v in tags.items()],
        )
