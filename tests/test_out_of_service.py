"""The drain cap counts instances out of service, not only running repairs (issue 13).

An instance left DRAINING without a permit (a failed repair's, or one an operator drained by hand) is capacity that is
out as surely as one a repair holds. Three instances allow one draining at a time: with one already DRAINING, a new
repair waits until it comes back; a repair of an instance that is itself already DRAINING takes no more capacity, so
it is never blocked by the cap its own instance fills.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import boto3
from temporalio.client import Client

from tests.fleet import Fleet, assert_start_before_stop, simulated_fleet
from tests.harness import eventually


def ecs(fleet: Fleet) -> Any:
    return boto3.client("ecs", endpoint_url=fleet.moto_endpoint, region_name="us-east-1")


def set_state(fleet: Fleet, instance_id: str, status: str) -> None:
    """What an operator does in the console: drain an instance, or put it back."""
    client = ecs(fleet)
    arns = client.list_container_instances(cluster=fleet.settings.groups[0].cluster)["containerInstanceArns"]
    described = client.describe_container_instances(cluster=fleet.settings.groups[0].cluster, containerInstances=arns)
    [arn] = [ci["containerInstanceArn"] for ci in described["containerInstances"] if ci["ec2InstanceId"] == instance_id]
    client.update_container_instances_state(
        cluster=fleet.settings.groups[0].cluster, containerInstances=[arn], status=status
    )


async def test_an_instance_drained_without_a_permit_counts_against_the_cap(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        await fleet.all_healthy(3)
        drained, faulty, _ = fleet.sim.live_instances()
        set_state(fleet, drained, "DRAINING")
        fleet.sim.inject_fault(faulty)

        view = await eventually(
            fleet.semaphore, lambda v: [w.instance_id for w in v.waiters] == [faulty] and v.out_of_service == 1
        )
        assert view.capacity == 1 and view.holders == []
        # It keeps waiting while the other is out: the semaphore looks again every permit_reclaim_interval (2 s here).
        await asyncio.sleep(6)
        assert fleet.events("DrainPermitGranted") == []
        assert [w.instance_id for w in (await fleet.semaphore()).waiters] == [faulty]

        set_state(fleet, drained, "ACTIVE")
        assert await fleet.repairs_finished(1, within=120) == [faulty]
        await assert_start_before_stop(fleet, faulty)
        assert fleet.ec2_state(drained) == "running" and fleet.replacements_of(drained) == []


async def test_a_repair_of_an_instance_already_out_of_service_is_not_held_by_the_cap(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        await fleet.all_healthy(3)
        drained, faulty, _ = fleet.sim.live_instances()
        # Two out of service with a cap of one: over the cap already. The faulty one is one of them (as a failed
        # attempt's instance is when it is retried), so repairing it adds nothing to what is out.
        set_state(fleet, drained, "DRAINING")
        set_state(fleet, faulty, "DRAINING")
        fleet.sim.inject_fault(faulty)

        assert await fleet.repairs_finished(1, within=120) == [faulty]
        assert fleet.replacements_of(drained) == []
        view = await fleet.semaphore()
        assert view.max_holders_seen == 1 and view.holders == []
