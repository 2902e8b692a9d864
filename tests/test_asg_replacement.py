"""Auto Scaling replacements are claimed through one arbiter, the group's drain semaphore (issue 13).

Detach-and-replace leaves the Auto Scaling group to launch the new instance, so a repair must find it among the
group's new instances; two repairs in one group see the same ones, and EC2 tags have no compare-and-set. Here two
repairs are caught on purpose in the window between their detach and their claim, then both claim at once: each gets
its own. Real Temporal dev server (the semaphore workflow on an in-process worker) and moto over HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.aws import AwsClients
from activities.ec2 import DETACHED_AT_TAG, REPLACES_TAG
from activities.fleet import FleetActivities
from activities.models import GroupCapacityRequest, LaunchRequest, LaunchResult
from contract.config import AwsSettings
from contract.ids import semaphore_workflow_id
from tests.harness import make_settings, running_worker, unique
from workflows.models import Permit, SemaphoreRun, SemaphoreView

AMI = "ami-12c6146b"  # one of moto's built-in AMIs


@dataclass
class AsgGroup:
    aws: AwsClients
    asg: str
    original: list[str]
    acts: FleetActivities
    semaphore: WorkflowHandle[Any, Any]
    group: str
    cluster: str

    async def launch(self, holder: str, impaired: str) -> LaunchResult:
        """launch_replacement as the repair `holder` runs it: the activity knows its workflow."""
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, workflow_id=holder)
        request = LaunchRequest(group=self.group, impaired_instance_id=impaired, client_token=f"token-{holder}")
        return await env.run(self.acts.launch_replacement, request)

    def owner(self, instance_id: str) -> str | None:
        described = self.aws.ec2.describe_instances(InstanceIds=[instance_id])
        tags = {t["Key"]: t["Value"] for t in described["Reservations"][0]["Instances"][0].get("Tags", [])}
        return tags.get(REPLACES_TAG)

    def in_service(self) -> list[str]:
        resp = self.aws.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[self.asg])
        return sorted(i["InstanceId"] for i in resp["AutoScalingGroups"][0]["Instances"])


@pytest.fixture
async def asg_group(client: Client, aws_env: str, tmp_path: Path) -> AsyncIterator[AsgGroup]:
    aws = AwsClients(AwsSettings(endpoint_url=aws_env, max_attempts=2))
    template = unique("lt")
    aws.ec2.create_launch_template(
        LaunchTemplateName=template, LaunchTemplateData={"ImageId": AMI, "InstanceType": "p4d.24xlarge"}
    )
    subnet = aws.ec2.describe_subnets(Filters=[{"Name": "availability-zone", "Values": ["us-east-1a"]}])
    asg = unique("asg")
    aws.autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=asg,
        LaunchTemplate={"LaunchTemplateName": template, "Version": "$Latest"},
        MinSize=0,
        MaxSize=10,
        DesiredCapacity=3,
        VPCZoneIdentifier=subnet["Subnets"][0]["SubnetId"],
    )
    group = unique("g")
    settings = make_settings(client, aws_env, tmp_path / "events.jsonl", group=group, cluster=unique("cluster"))
    # The permits below are held by repairs that run only in this test: the semaphore must not reclaim them.
    settings.groups = [
        settings.groups[0].model_copy(update={"auto_scaling_group": asg, "permit_reclaim_interval": timedelta(hours=1)})
    ]
    aws.ecs.create_cluster(clusterName=settings.groups[0].cluster)
    original = sorted(
        i["InstanceId"]
        for i in aws.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[asg])["AutoScalingGroups"][0][
            "Instances"
        ]
    )
    now = datetime.now(UTC)
    holders = [
        Permit(holder_workflow_id=f"repair/{instance_id}/1", instance_id=instance_id, since=now)
        for instance_id in original
    ]
    async with running_worker(settings, client):
        semaphore = await client.start_workflow(
            "DrainSemaphoreWorkflow",
            SemaphoreRun(group=group, holders=holders),
            id=semaphore_workflow_id(group),
            task_queue=settings.temporal.task_queue,
        )
        acts = FleetActivities(aws, settings.group, poll_interval=timedelta(seconds=0.05), client=client)
        # EC2 LaunchTime has whole seconds: let them tick so the new instances are told from the originals.
        time.sleep(1.1)
        yield AsgGroup(aws, asg, original, acts, semaphore, group, settings.groups[0].cluster)
        await semaphore.terminate("test over")


async def test_launch_detaches_and_returns_the_new_instance(asg_group: AsgGroup) -> None:
    impaired, *others = asg_group.original
    for instance_id in asg_group.original:
        register(asg_group, instance_id)

    first = await asg_group.launch(f"repair/{impaired}/1", impaired)
    second = await asg_group.launch(f"repair/{impaired}/1", impaired)

    assert not first.already_existed and second.already_existed
    assert second.replacement_instance_id == first.replacement_instance_id
    assert first.replacement_instance_id not in asg_group.original
    resp = asg_group.aws.autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[asg_group.asg])
    assert resp["AutoScalingGroups"][0]["DesiredCapacity"] == 3
    assert asg_group.in_service() == sorted([*others, first.replacement_instance_id])
    assert asg_group.owner(first.replacement_instance_id) == impaired
    # The detached instance is still counted (group tag) until it is terminated; the replacement is not registered
    # in ECS yet.
    capacity = await ActivityEnvironment().run(
        asg_group.acts.describe_group_capacity, GroupCapacityRequest(group=asg_group.group)
    )
    assert capacity.instance_count == 3
    register(asg_group, first.replacement_instance_id)
    capacity = await ActivityEnvironment().run(
        asg_group.acts.describe_group_capacity, GroupCapacityRequest(group=asg_group.group)
    )
    assert capacity.instance_count == 4


def register(group: AsgGroup, instance_id: str) -> None:
    doc = json.dumps({"instanceId": instance_id, "availabilityZone": "us-east-1a"})
    group.aws.ecs.register_container_instance(cluster=group.cluster, instanceIdentityDocument=doc)


def detach_as_a_first_attempt_would(group: AsgGroup, instance_id: str, at: datetime) -> None:
    """What an attempt leaves behind when it stops after detaching and before claiming (a worker killed there)."""
    group.aws.ec2.create_tags(Resources=[instance_id], Tags=[{"Key": DETACHED_AT_TAG, "Value": at.isoformat()}])
    group.aws.autoscaling.detach_instances(
        AutoScalingGroupName=group.asg, InstanceIds=[instance_id], ShouldDecrementDesiredCapacity=False
    )


async def test_two_repairs_caught_between_detach_and_claim_each_get_their_own_replacement(
    asg_group: AsgGroup,
) -> None:
    first, second, _ = asg_group.original
    cutoff = datetime.now(UTC).replace(microsecond=0)
    detach_as_a_first_attempt_would(asg_group, first, cutoff)
    detach_as_a_first_attempt_would(asg_group, second, cutoff)
    new = sorted(set(asg_group.in_service()) - set(asg_group.original))
    assert len(new) == 2  # both new instances are candidates for both repairs: each would take the older one

    a, b = await asyncio.gather(
        asg_group.launch(f"repair/{first}/1", first), asg_group.launch(f"repair/{second}/1", second)
    )

    assert {a.replacement_instance_id, b.replacement_instance_id} == set(new)
    assert asg_group.owner(a.replacement_instance_id) == first
    assert asg_group.owner(b.replacement_instance_id) == second
    # A retry of either attempt finds its own again.
    again = await asg_group.launch(f"repair/{first}/1", first)
    assert again.replacement_instance_id == a.replacement_instance_id and again.already_existed
    view = await asg_group.semaphore.query("state", result_type=SemaphoreView)
    claims = {p.instance_id: p.replacement_instance_id for p in view.holders}
    assert claims[first] == a.replacement_instance_id and claims[second] == b.replacement_instance_id


async def test_an_instance_claimed_by_one_repair_is_never_given_to_another(asg_group: AsgGroup) -> None:
    first, second, _ = asg_group.original
    cutoff = datetime.now(UTC).replace(microsecond=0)
    detach_as_a_first_attempt_would(asg_group, first, cutoff)
    [new] = sorted(set(asg_group.in_service()) - set(asg_group.original))
    claimed = await asg_group.launch(f"repair/{first}/1", first)
    assert claimed.replacement_instance_id == new
    # Its tag lost (written by hand, or a worker killed before tagging): the instance is a candidate of the second
    # repair's again, and the older one. The arbiter remembers: the second gets the instance launched for it.
    asg_group.aws.ec2.delete_tags(Resources=[new], Tags=[{"Key": REPLACES_TAG}])
    detach_as_a_first_attempt_would(asg_group, second, cutoff)
    mine = await asg_group.launch(f"repair/{second}/1", second)
    assert mine.replacement_instance_id != new
    assert mine.replacement_instance_id in asg_group.in_service()
    assert asg_group.owner(mine.replacement_instance_id) == second


async def test_only_a_permit_holder_may_claim(asg_group: AsgGroup) -> None:
    first = asg_group.original[0]
    detach_as_a_first_attempt_would(asg_group, first, datetime.now(UTC).replace(microsecond=0))
    with pytest.raises(ApplicationError) as refused:
        await asg_group.launch("repair/i-0123456789abcdef0/1", first)
    assert refused.value.type == "ReplacementClaimRefused" and refused.value.non_retryable
    assert "holds no drain permit" in refused.value.message
