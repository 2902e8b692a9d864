"""The two ways to launch a replacement: from the group's launch template (RunInstances with a client token), or
by detaching the impaired instance from the group's Auto Scaling group, which then launches one itself."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from temporalio.exceptions import ApplicationError

from activities.aws import AwsClients
from activities.ec2 import DETACHED_AT_TAG, LIVE_EC2_STATES, REPLACES_TAG, Ec2, tags_of
from activities.models import LaunchRequest, LaunchResult
from contract.groups import CapacityGroup
from contract.names import GROUP_TAG

if TYPE_CHECKING:
    from mypy_boto3_ec2.type_defs import LaunchTemplateSpecificationTypeDef

# A name may start with "lt-" too; an id is exactly this shape.
LAUNCH_TEMPLATE_ID = re.compile(r"^lt-[0-9a-f]{17}$")
# The launch's client token, on the replacement: tells one replacement attempt's instance from an earlier one's.
LAUNCH_TOKEN_TAG = "gpu-autorepair:launch-token"

# Asks the group's arbiter (its drain semaphore) which of these new instances, likeliest first, is this impaired
# instance's replacement; None: all belong to other repairs.
ClaimReplacement = Callable[[CapacityGroup, str, list[str]], Awaitable[str | None]]


class Launcher:
    """Launches one replacement for an impaired instance; FleetActivities.launch_replacement has already checked
    that none exists yet (the `replaces` tag), where one could."""

    def __init__(self, aws: AwsClients, ec2: Ec2, claim: ClaimReplacement) -> None:
        self._aws = aws
        self._ec2 = ec2
        self._claim = claim

    async def existing(self, request: LaunchRequest) -> str | None:
        """The live replacement this launch request already made (or claimed), if any: the idempotency key.

        One launched by a worker that did not tag its token yet counts too: a second one would be a duplicate. One
        with another token is an earlier attempt's, on its way out: never handed back for this attempt."""
        impaired = request.impaired_instance_id
        resp = await self._aws.call(
            f"replacement of EC2 instance {impaired}",
            self._aws.ec2.describe_instances,
            Filters=[
                {"Name": f"tag:{REPLACES_TAG}", "Values": [impaired]},
                {"Name": "instance-state-name", "Values": LIVE_EC2_STATES},
            ],
        )
        instances = [
            i
            for r in resp.get("Reservations", [])
            for i in r.get("Instances", [])
            if tags_of(i.get("Tags")).get(LAUNCH_TOKEN_TAG, request.client_token) == request.client_token
        ]
        if not instances:
            return None
        return min(instances, key=lambda i: (i["LaunchTime"], i["InstanceId"]))["InstanceId"]

    async def from_template(self, group: CapacityGroup, request: LaunchRequest) -> LaunchResult:
        kwargs: dict[str, Any] = {}
        # Same subnet (hence AZ) as the impaired instance: its tasks' placement constraints stay valid.
        if request.subnet_id:
            kwargs["SubnetId"] = request.subnet_id
        elif request.availability_zone:
            kwargs["Placement"] = {"AvailabilityZone": request.availability_zone}
        try:
            resp = await self._aws.call(
                _template_resource(group),
                self._aws.ec2.run_instances,
                LaunchTemplate=_template_spec(group),
                MinCount=1,
                MaxCount=1,
                # AWS returns the first launch for a repeated token; the `replaces` tag covers moto (ignores it).
                ClientToken=request.client_token,
                TagSpecifications=[
                    {
                        "ResourceType": "instance",
                        "Tags": [
                            {"Key": GROUP_TAG, "Value": group.name},
                            {"Key": REPLACES_TAG, "Value": request.impaired_instance_id},
                            {"Key": LAUNCH_TOKEN_TAG, "Value": request.client_token},
                            {"Key": "Name", "Value": f"{group.name} (replaces {request.impaired_instance_id})"},
                        ],
                    }
                ],
                **kwargs,
            )
        except Exception:
            # Whatever the launch's error (moto's is not even an AWS error), a missing template says it best.
            await self._check_template(group)
            raise
        return LaunchResult(replacement_instance_id=resp["Instances"][0]["InstanceId"])

    async def _check_template(self, group: CapacityGroup) -> None:
        """After a failed launch: a missing template is a configuration error that no retry fixes, and
        DescribeLaunchTemplates names it plainly (moto answers RunInstances with a 500 for it). Looked up only then:
        on the way to a launch it would be one more serial call."""
        template = group.launch_template or ""
        by_id = "LaunchTemplateId" in _template_spec(group)
        resource = _template_resource(group)
        describe = self._aws.ec2.describe_launch_templates
        try:
            found = await (
                self._aws.call(resource, describe, LaunchTemplateIds=[template])
                if by_id
                else self._aws.call(resource, describe, LaunchTemplateNames=[template])
            )
        except ApplicationError as err:
            if (err.type or "").startswith("InvalidLaunchTemplate"):
                raise  # AWS's own answer for a missing one: as plain, and permanent
            return  # the launch's own error says more than this one
        if not found.get("LaunchTemplates"):
            raise ApplicationError(
                f"ec2:DescribeLaunchTemplates on {resource} failed: no such launch template",
                type="InvalidLaunchTemplateId.NotFound" if by_id else "InvalidLaunchTemplateName.NotFoundException",
                non_retryable=True,
            )

    async def in_auto_scaling_group(self, group: CapacityGroup, request: LaunchRequest) -> LaunchResult:
        """Detach-and-replace: detach without decrementing desired capacity; the group launches a new one."""
        asg_name = group.auto_scaling_group or ""
        impaired = request.impaired_instance_id
        resource = f"EC2 instance {impaired} in Auto Scaling group {asg_name}"
        instance = await self._ec2.instance(impaired)
        tags = tags_of((instance or {}).get("Tags"))
        membership = await self._aws.call(
            resource, self._aws.autoscaling.describe_auto_scaling_instances, InstanceIds=[impaired]
        )
        in_group = any(m.get("AutoScalingGroupName") == asg_name for m in membership.get("AutoScalingInstances", []))
        if in_group:
            if DETACHED_AT_TAG not in tags:
                # Written before detaching (worker clock): a crash right after the detach leaves a cutoff.
                # The group tag keeps the detached instance counted in the group while it drains.
                now = datetime.now(UTC).isoformat()
                await self._ec2.tag(impaired, {DETACHED_AT_TAG: now, GROUP_TAG: group.name})
                tags[DETACHED_AT_TAG] = now
            detached_at = await self._detach(asg_name, impaired, resource)
            if detached_at is not None:
                # The AWS clock is the one the new instance's LaunchTime is on: prefer it to ours.
                tags[DETACHED_AT_TAG] = detached_at.isoformat()
                await self._ec2.tag(impaired, {DETACHED_AT_TAG: tags[DETACHED_AT_TAG]})
        elif DETACHED_AT_TAG not in tags:
            raise ApplicationError(
                f"autoscaling:DetachInstances: EC2 instance {impaired} is not in Auto Scaling group "
                f"{asg_name} (capacity group {group.name}), so detaching it would launch nothing",
                type="NotInAutoScalingGroup",
                non_retryable=True,
            )
        cutoff = datetime.fromisoformat(tags[DETACHED_AT_TAG]).astimezone(UTC).replace(microsecond=0)

        asg = await self._ec2.auto_scaling_group(group)
        in_service = [
            i["InstanceId"]
            for i in asg.get("Instances", [])
            if i.get("LifecycleState") == "InService" and i["InstanceId"] != impaired
        ]
        candidates = [
            inst
            for inst in (await self._ec2.instances(in_service)).values()
            if REPLACES_TAG not in tags_of(inst.get("Tags"))
            and inst.get("State", {}).get("Name") in LIVE_EC2_STATES
            # LaunchTime has whole seconds, hence the cutoff rounded down.
            and inst["LaunchTime"] >= cutoff
        ]
        if not candidates:
            raise ApplicationError(
                f"Auto Scaling group {asg_name} has not yet launched an in-service replacement for {impaired}",
                type="ReplacementNotYetLaunched",
            )
        # The first launched after the detach is most likely the one the detach caused. Two repairs in one group
        # see the same new instances: the arbiter gives each its own (tags have no compare-and-set).
        ordered = [i["InstanceId"] for i in sorted(candidates, key=lambda i: (i["LaunchTime"], i["InstanceId"]))]
        chosen = await self._claim(group, impaired, ordered)
        if chosen is None:
            raise ApplicationError(
                f"Auto Scaling group {asg_name} has not yet launched a replacement for {impaired}: its "
                f"{len(ordered)} new instances are other repairs' replacements",
                type="ReplacementNotYetLaunched",
            )
        await self._ec2.tag(
            chosen, {REPLACES_TAG: impaired, LAUNCH_TOKEN_TAG: request.client_token, GROUP_TAG: group.name}
        )
        return LaunchResult(replacement_instance_id=chosen)

    async def _detach(self, asg_name: str, instance_id: str, resource: str) -> datetime | None:
        """Detach; returns the detach activity's start time (AWS clock), or None if already detached."""
        try:
            resp = await self._aws.call(
                resource,
                self._aws.autoscaling.detach_instances,
                AutoScalingGroupName=asg_name,
                InstanceIds=[instance_id],
                ShouldDecrementDesiredCapacity=False,
            )
        except ApplicationError as err:
            if err.type == "ValidationError" and "not part of" in err.message:
                return None  # detached between our membership check and the call
            raise
        activities = resp.get("Activities", [])
        start = activities[0].get("StartTime") if activities else None
        return start.astimezone(UTC) if start is not None else None


def _template_spec(group: CapacityGroup) -> LaunchTemplateSpecificationTypeDef:
    template, version = group.launch_template or "", group.launch_template_version
    if LAUNCH_TEMPLATE_ID.match(template):
        return {"LaunchTemplateId": template, "Version": version}
    return {"LaunchTemplateName": template, "Version": version}


def _template_resource(group: CapacityGroup) -> str:
    template, version = group.launch_template, group.launch_template_version
    return f"launch template {template} version {version} (capacity group {group.name})"
