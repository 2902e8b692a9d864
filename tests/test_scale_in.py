"""A scale-in of a real Auto Scaling group is not a surge of faults (issue 12).

Six simulated instances are put in an Auto Scaling group in moto, which then scales in by four at once: their probes
fall silent together, as in a monitoring outage, which is what the breaker trips on (more than `min_impaired` 3
silences begun within 30 s). They left on purpose, so each retires (`InstanceRetired`), nothing is repaired, nothing
is held, and the two left stay watched.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import boto3
from temporalio.client import Client

from contract.health import HealthState
from contract.ids import health_workflow_id
from tests.fleet import simulated_fleet
from tests.harness import eventually, unique
from workflows.models import InstanceHealthView


async def test_a_scale_in_of_four_retires_them_without_repairs_or_a_hold(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    asg = unique("asg")
    async with simulated_fleet(
        client, aws_env, tmp_path, instances=6, group_settings={"auto_scaling_group": asg}
    ) as fleet:
        await fleet.all_healthy(6)
        asgs = boto3.client("autoscaling", endpoint_url=fleet.moto_endpoint, region_name="us-east-1")
        subnet = fleet.ec2().describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]}])["Subnets"]
        asgs.create_auto_scaling_group(
            AutoScalingGroupName=asg,
            LaunchTemplate={"LaunchTemplateName": f"{fleet.group}-lt", "Version": "$Latest"},
            MinSize=0,
            MaxSize=10,
            DesiredCapacity=0,
            VPCZoneIdentifier=",".join(s["SubnetId"] for s in subnet),
        )
        members = fleet.sim.live_instances()
        asgs.attach_instances(AutoScalingGroupName=asg, InstanceIds=members)

        asgs.set_desired_capacity(AutoScalingGroupName=asg, DesiredCapacity=2, HonorCooldown=False)

        retired = await eventually(
            lambda: asyncio.sleep(0, fleet.events("InstanceRetired")), lambda found: len(found) == 4, within=180
        )
        left = {e["instance_id"] for e in retired}
        assert left < set(members)
        for event in retired:
            assert event["detail"]["reason"].startswith(("terminated in EC2: ", "shutting-down in EC2: ")), event
        # Never counted as failures: no repair, and the breaker (which publishes RepairsHeld when it trips) held none.
        assert fleet.events("RepairStarted") == [] and fleet.events("RepairsHeld") == []
        for instance_id in set(members) - left:
            handle = client.get_workflow_handle(health_workflow_id(instance_id))
            health = await handle.query("health", result_type=InstanceHealthView)
            assert not health.retired and health.healthStatus.overallStatus is HealthState.OK
