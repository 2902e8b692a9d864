"""NVIDIA's verdict chooses the remedy (issue 25), end to end: on the real dev server, moto over HTTP and the
simulated fleet running the real probe, under `remediation = "reboot-first"` with GPU resets allowed.

- Xid 95 asks for a GPU reset in NVIDIA's catalog, but the driver's Xid 154 that follows it says "Node Reboot
  Required": the instance is rebooted, never reset (whether the verdict reached the health workflow before the repair
  started, or only before the GPU was touched).
- A GPU whose memory NVIDIA says cannot be repaired (NVML's unrepairable-memory flag, signalled as the probe's NVML
  would report it: the simulated nodes have no NVML of their own) has its instance replaced at once at its next
  fault, which NVIDIA's catalog alone would answer with a reboot.
The decision table row by row: tests/test_nvidia_verdicts.py.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from temporalio.client import Client

from contract import names
from contract.ids import health_workflow_id, repair_workflow_id
from contract.probe import ACTION_REPLACE, GpuFinding, GpuRef
from contract.repair import RepairAction
from tests.fleet import simulated_fleet
from tests.harness import eventually
from tests.test_remediation_ladder import ESCALATED_AT_ONCE, closed, reboot_first, steps_of
from tests.test_replacement_attempts import current_details

NODE_REBOOT_REQUIRED = 2  # NVML field 230's code; Xid 154 names it "Node Reboot Required"


async def test_the_recovery_action_xid_154_states_chooses_a_reboot_over_the_catalog_s_reset(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        reboot_first(fleet, gpu_reset=True)
        await fleet.all_healthy(3)
        faulty = fleet.sim.live_instances()[0]
        fleet.sim.inject_fault(faulty, xid=95, recovery_action=NODE_REBOOT_REQUIRED)  # catalog: RESET_GPU

        result = await closed(fleet, repair_workflow_id(faulty, 1))

        assert (result.action, result.replacement_instance_id) == (RepairAction.REBOOT, None)
        steps = steps_of(fleet, repair_workflow_id(faulty, 1))
        assert "GpuResetStarted" not in steps and "RebootCompleted" in steps
        [rebooted] = fleet.events("RebootStarted", faulty)
        assert (rebooted["detail"]["reason"], rebooted["detail"]["nvidia_action"]) == ("XID_95", "RESTART_BM")
        details = await current_details(client, repair_workflow_id(faulty, 1))
        # Either the verdict was there when the repair started, or it came before the GPU was touched.
        chosen = "first reboot (NVIDIA: RESTART_BM, NVIDIA's recovery action RESTART_BM (XID_154)" in details
        escalated = [e for e in fleet.events("Escalated", faulty) if e["detail"]["to_action"] == "reboot"]
        assert chosen or (len(escalated) == 1 and "NVIDIA now asks for RESTART_BM" in escalated[0]["detail"]["why"]), (
            details
        )
        assert fleet.replacements_of(faulty) == [] and fleet.ec2_state(faulty) == "running"


async def test_unrepairable_memory_replaces_at_once_what_the_catalog_would_reboot(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        reboot_first(fleet, gpu_reset=True)
        await fleet.all_healthy(3)
        faulty = fleet.sim.live_instances()[0]
        health = client.get_workflow_handle(health_workflow_id(faulty))
        flag = GpuFinding(
            finding_id="unrepairable-memory",
            instance_id=faulty,
            group=fleet.group,
            kind="nvml",
            reason="NVML_UNREPAIRABLE_MEMORY",
            impairs=False,  # the `ecs` policy: only ECS's 18 Xids impair
            gpu=GpuRef(pci="0000:53:00"),
            immediate_action=ACTION_REPLACE,
            verdict="unrepairable_memory",
            observed_at=datetime.now(UTC),
        )
        await health.signal(names.SIGNAL_GPU_FINDING, flag)
        view = await eventually(lambda: fleet.sim.health(faulty), lambda v: v is not None and bool(v.nvidia_verdicts))
        assert view is not None and [(v.verdict, v.action) for v in view.nvidia_verdicts] == [
            ("unrepairable_memory", ACTION_REPLACE)
        ]
        assert fleet.events("RepairStarted", faulty) == []  # a verdict alone is no repair under `ecs`

        fleet.sim.inject_fault(faulty, xid=79, pci="0000:64:00")  # catalog: RESTART_BM, on another GPU

        await closed(fleet, repair_workflow_id(faulty, 1))
        assert steps_of(fleet, repair_workflow_id(faulty, 1)) == ESCALATED_AT_ONCE
        [escalated] = fleet.events("Escalated", faulty)
        assert (escalated["detail"]["from_action"], escalated["detail"]["to_action"]) == ("reboot", "replace")
        assert escalated["detail"]["why"] == (
            "XID_79: NVIDIA's immediate action is REPLACE (NVIDIA's unrepairable_memory (NVML_UNREPAIRABLE_MEMORY) "
            "on GPU 0000:53:00), not a GPU reset or a reboot"
        )
        [replacement] = fleet.replacements_of(faulty)  # one launched, ACTIVE before the instance went
        assert fleet.ec2_state(faulty) == "terminated" and fleet.ec2_state(replacement) == "running"
