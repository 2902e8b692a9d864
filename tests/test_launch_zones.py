"""Where a replacement launches when its AZ has no capacity (issue 13): the group's choice.

By default a repair stays in its instance's AZ and keeps trying, saying so in its events and the health view (ODCRs
and Capacity Blocks are AZ-bound). With `allow_other_azs`, repeated capacity errors move the next try to another of
the group's subnets, and the group's semaphore remembers the AZ so the next repair starts elsewhere. EC2's capacity
errors are AWS's own responses, served by the fault-injecting proxy for one subnet only; everything else is moto.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import boto3
from temporalio.client import Client

from contract.ids import health_workflow_id
from simulator.aws_proxy import FlakyAws
from tests.fleet import Fleet, assert_start_before_stop, simulated_fleet
from tests.harness import eventually
from workflows.models import InstanceHealthView


def ec2(moto: str) -> Any:
    return boto3.client("ec2", endpoint_url=moto, region_name="us-east-1")


def default_subnets(moto: str) -> dict[str, str]:
    """AZ -> its default subnet, as moto (and a default VPC) has them."""
    subnets = ec2(moto).describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]}])["Subnets"]
    return {s["AvailabilityZone"]: s["SubnetId"] for s in subnets}


def placement(fleet: Fleet, instance_id: str) -> tuple[str, str]:
    described = fleet.ec2().describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]
    return described["Placement"]["AvailabilityZone"], described["SubnetId"]


@asynccontextmanager
async def fleet_short_of_capacity_in(
    client: Client, moto: str, tmp_path: Path, zone: str, **group_settings: Any
) -> AsyncIterator[tuple[Fleet, FlakyAws, str]]:
    """Four instances over three AZs (two in us-east-1a); RunInstances in `zone`'s subnet answers
    InsufficientInstanceCapacity."""
    subnets = default_subnets(moto)
    with FlakyAws(moto) as aws:
        async with simulated_fleet(
            client,
            moto,
            tmp_path,
            instances=4,
            engine_proxy=aws,
            group_settings={"subnets": [subnets[z] for z in sorted(subnets)], **group_settings},
        ) as fleet:
            await fleet.all_healthy(4)
            # per="call": a shortage outlasts botocore's own retries, so each launch call fails as a whole.
            aws.fail("RunInstances", "InsufficientInstanceCapacity", per="call", where={"SubnetId": subnets[zone]})
            yield fleet, aws, subnets[zone]


def instances_in(fleet: Fleet, zone: str) -> list[str]:
    return [i for i in fleet.sim.live_instances() if placement(fleet, i)[0] == zone]


async def test_by_default_a_replacement_waits_for_capacity_in_its_own_az_and_says_so(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with fleet_short_of_capacity_in(client, aws_env, tmp_path, "us-east-1a") as (fleet, aws, subnet):
        faulty = instances_in(fleet, "us-east-1a")[0]
        fleet.sim.inject_fault(faulty)

        failed = await eventually(
            lambda: asyncio.sleep(0, fleet.events("ReplacementLaunchFailed", faulty)), lambda e: len(e) >= 2
        )
        for event in failed:
            assert "InsufficientInstanceCapacity" in event["detail"]["error"]
            assert event["detail"]["availability_zone"] == "us-east-1a"
            assert event["detail"]["next_try"] == "staying in us-east-1a: allow_other_azs is off"
        health = client.get_workflow_handle(health_workflow_id(faulty))
        view = await health.query("health", result_type=InstanceHealthView)
        assert view.repair is not None and "staying in us-east-1a" in (view.repair.error or "")
        assert fleet.replacements_of(faulty) == []
        # Every try was in its own subnet.
        assert {s.request.params.get("SubnetId") for s in aws.seen() if s.request.action == "RunInstances"} == {subnet}

        aws.heal()  # capacity is back
        assert await fleet.repairs_finished(1, within=120) == [faulty]
        await assert_start_before_stop(fleet, faulty, tolerating={"ReplacementLaunchFailed"})
        [replacement] = fleet.replacements_of(faulty)
        assert placement(fleet, replacement) == ("us-east-1a", subnet)


async def test_with_allow_other_azs_a_repair_moves_and_the_next_one_avoids_the_az(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with fleet_short_of_capacity_in(
        client, aws_env, tmp_path, "us-east-1a", allow_other_azs=True, capacity_errors_before_moving=2
    ) as (fleet, aws, subnet):
        faulty, second = instances_in(fleet, "us-east-1a")
        fleet.sim.inject_fault(faulty)

        assert await fleet.repairs_finished(1, within=180) == [faulty]
        assert [e["detail"]["next_try"] for e in fleet.events("ReplacementLaunchFailed", faulty)] == [
            "staying in us-east-1a (1 of 2 capacity errors before moving)",
            f"moving to {default_subnets(aws_env)['us-east-1b']} in us-east-1b",
        ]
        [replacement] = fleet.replacements_of(faulty)
        assert placement(fleet, replacement)[0] == "us-east-1b"
        assert "us-east-1a" in (await fleet.semaphore()).launch_failures

        # The group remembers: the next repair of an instance in us-east-1a starts in another AZ, with no error.
        tries_in_a = sum(1 for s in aws.seen() if s.request.params.get("SubnetId") == subnet)
        fleet.sim.inject_fault(second)
        assert set(await fleet.repairs_finished(2, within=180)) == {faulty, second}
        assert fleet.events("ReplacementLaunchFailed", second) == []
        assert sum(1 for s in aws.seen() if s.request.params.get("SubnetId") == subnet) == tries_in_a
        [moved] = fleet.replacements_of(second)
        assert placement(fleet, moved)[0] != "us-east-1a"
