"""A GPU missing from the host (issue 25): the probe counts the GPUs NVML enumerates, the health workflow reads once
how many the instance's type has (EC2 DescribeInstanceTypes), and fewer impairs ACCELERATED_COMPUTE, whose repair
replaces the instance start-before-stop.

On the real dev server, moto over HTTP and the simulated fleet; the heartbeat that counts 7 of a p5.48xlarge's 8
GPUs is signalled as the probe's NVML would report it (the simulated nodes have no NVML of their own).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from temporalio.client import Client

from contract import names
from contract.health import HealthState
from contract.ids import health_workflow_id, repair_workflow_id
from contract.probe import Heartbeat
from tests.fleet import assert_start_before_stop, simulated_fleet
from tests.harness import eventually

REASON = "GPU_COUNT_MISMATCH: 7 of the 8 GPUs of a p5.48xlarge visible"


async def test_a_host_showing_fewer_gpus_than_its_type_is_impaired_and_replaced(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=2) as fleet:
        await fleet.all_healthy(2)
        short, whole = fleet.sim.live_instances()
        health = client.get_workflow_handle(health_workflow_id(short))
        beat = Heartbeat(instance_id=short, group=fleet.group, sent_at=datetime.now(UTC), gpu_count=7)
        await health.signal(names.SIGNAL_HEARTBEAT, beat)
        await client.get_workflow_handle(health_workflow_id(whole)).signal(
            names.SIGNAL_HEARTBEAT, beat.model_copy(update={"instance_id": whole, "gpu_count": 8})
        )

        await fleet.repairs_finished(1)
        [changed] = [
            e
            for e in fleet.events("HealthChanged", short)
            if e["detail"]["overall_status"] == HealthState.IMPAIRED.value
        ]
        [accelerated] = [d for d in changed["detail"]["details"] if d["type"] == "ACCELERATED_COMPUTE"]
        assert (accelerated["status"], accelerated["statusReason"]) == ("IMPAIRED", REASON)
        [started] = fleet.events("RepairStarted", short)
        assert (started["workflow_id"], started["detail"]["reason"]) == (repair_workflow_id(short, 1), REASON)
        await assert_start_before_stop(fleet, short)  # the steps in order, one replacement
        assert fleet.ec2_state(short) == "terminated"

        # All eight there: nothing to repair. Both workflows read their type's count once.
        view = await eventually(lambda: fleet.sim.health(whole), lambda v: v is not None and v.expected_gpus == 8)
        assert view is not None and view.healthStatus.overallStatus is HealthState.OK and view.gpu_count == 8
        assert fleet.events("RepairStarted", whole) == []
