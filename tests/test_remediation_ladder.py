"""The remediation ladder, end to end: reboot (or reset) first where NVIDIA's catalog says it clears the fault,
replace when it does not.

On the real dev server, moto over HTTP and the simulated fleet running the real probe. moto's RebootInstances
changes nothing and its SSM SendCommand runs nothing, so the fleet plays them (simulator/fleet.py): a reboot drops
the node's probe and brings it back on a new boot id; the node's scenario says whether the fault persists, the
reboot hangs, or a reset is refused. What moto cannot answer (a reset the driver refused, with its output) the
fault-injecting proxy in front of it serves (simulator/aws_proxy.py).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
from temporalio.client import Client

from contract import names
from contract.groups import Remediation
from contract.health import HealthState
from contract.ids import health_workflow_id, repair_workflow_id
from contract.probe import GpuFinding, GpuRef
from contract.repair import RepairAction
from simulator.aws_proxy import FlakyAws
from simulator.kernel_lines import P5_GPU_PCI
from tests.fleet import START_BEFORE_STOP, Fleet, assert_start_before_stop, simulated_fleet
from tests.harness import eventually
from tests.test_ops_cli import autorepair, cli_env, cli_json
from tests.test_replacement_attempts import current_details, set_group, tags
from workflows.models import RepairResult

# A simulated reboot takes the fleet's boot delay (2 s) and a heartbeat; this is room to spare, and short enough for
# the test that waits it out.
REBOOT_TIMEOUT = timedelta(seconds=12)

REBOOTED_IN_PLACE = [
    "RepairStarted",
    "DrainPermitGranted",
    "Draining",
    "TasksStopped",
    "RebootStarted",
    "RebootCompleted",
    "FixVerified",
    "RepairCompleted",
    "DrainPermitReleased",
]
ESCALATED_AT_ONCE = [*START_BEFORE_STOP[:3], "Escalated", *START_BEFORE_STOP[3:]]


def reboot_first(fleet: Fleet, **more: Any) -> None:
    set_group(fleet, remediation=Remediation.REBOOT_FIRST, **{"reboot_timeout": REBOOT_TIMEOUT, **more})


def container_status(fleet: Fleet, instance_id: str) -> str | None:
    ecs = boto3.client("ecs", endpoint_url=fleet.moto_endpoint, region_name="us-east-1")
    cluster = fleet.settings.groups[0].cluster
    arns = ecs.list_container_instances(cluster=cluster)["containerInstanceArns"]
    described = ecs.describe_container_instances(cluster=cluster, containerInstances=arns)
    return next((ci["status"] for ci in described["containerInstances"] if ci["ec2InstanceId"] == instance_id), None)


def steps_of(fleet: Fleet, workflow_id: str) -> list[str]:
    return [e["type"] for e in fleet.events() if e["workflow_id"] == workflow_id and e["type"] != "HealthChanged"]


async def closed(fleet: Fleet, workflow_id: str) -> RepairResult:
    """The repair's result, once it completed and handed its permit back."""
    await eventually(lambda: _done(fleet, workflow_id), bool, within=150)
    handle = fleet.client.get_workflow_handle(workflow_id, result_type=RepairResult)
    result = await handle.result()
    assert isinstance(result, RepairResult)
    return result


async def _done(fleet: Fleet, workflow_id: str) -> bool:
    return "DrainPermitReleased" in steps_of(fleet, workflow_id)


async def test_reboot_clears_in_place_and_the_same_gpu_faulting_again_is_replaced(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        reboot_first(fleet)
        await fleet.all_healthy(3)
        faulty, *others = fleet.sim.live_instances()
        node = fleet.sim.node(faulty)
        first_boot = node.boot_id
        fleet.sim.inject_fault(faulty, xid=79)  # NVIDIA: RESTART_BM
        assert node.last_fault is not None
        pci = node.last_fault[1]

        first = await closed(fleet, repair_workflow_id(faulty, 1))

        # Rebooted, not replaced: nothing launched, nothing terminated, the instance back in service.
        assert steps_of(fleet, repair_workflow_id(faulty, 1)) == REBOOTED_IN_PLACE
        assert (first.action, first.replacement_instance_id, first.escalated) == (RepairAction.REBOOT, None, None)
        assert fleet.replacements_of(faulty) == []
        assert fleet.ec2_state(faulty) == "running"
        assert container_status(fleet, faulty) == "ACTIVE"
        assert all(fleet.ec2_state(other) == "running" for other in others)
        assert node.reboots == 1 and node.boot_id != first_boot
        [started] = fleet.events("RebootStarted", faulty)
        assert (started["detail"]["reason"], started["detail"]["gpu"], started["detail"]["nvidia_action"]) == (
            "XID_79",
            pci,
            "RESTART_BM",
        )
        assert started["detail"]["boot_id_before"] == first_boot
        assert tags(fleet, faulty)[names.REBOOT_TAG] == started["detail"]["token"]
        [completed] = fleet.events("RepairCompleted", faulty)
        assert completed["detail"]["action"] == "reboot" and completed["detail"]["replacement_instance_id"] is None

        # Its health workflow stays, healthy again, and knows the boot and the fix.
        view = await eventually(
            lambda: fleet.sim.health(faulty),
            lambda v: v is not None and v.healthStatus.overallStatus is HealthState.OK,
        )
        assert view is not None and not view.retired
        assert view.boot_id == node.boot_id
        assert view.last_in_place_fix is not None
        assert (view.last_in_place_fix.action, view.last_in_place_fix.gpu) == (RepairAction.REBOOT, pci)
        assert not [f for f in view.recent_findings if f.impairs]
        assert view.last_in_place_fix.started_at is not None
        assert view.last_in_place_fix.started_at <= datetime.fromisoformat(started["time"])

        # The probe saw the fault again just before the reboot, and could deliver it only after (spooled through the
        # outage): the fault the reboot dealt with, kept as a warning, never the fault coming back.
        stale = GpuFinding(
            finding_id="seen-before-the-reboot",
            instance_id=faulty,
            group=fleet.settings.groups[0].name,
            kind="xid",
            code=79,
            reason="XID_79",
            impairs=True,
            gpu=GpuRef(pci=pci),
            immediate_action="RESTART_BM",
            observed_at=view.last_in_place_fix.started_at - timedelta(seconds=1),
        )
        await client.get_workflow_handle(health_workflow_id(faulty)).signal(names.SIGNAL_GPU_FINDING, stale)
        view = await eventually(
            lambda: fleet.sim.health(faulty),
            lambda v: v is not None and any(f.finding_id == stale.finding_id for f in v.recent_findings),
        )
        assert view is not None and view.healthStatus.overallStatus is HealthState.OK
        [kept] = [f for f in view.recent_findings if f.finding_id == stale.finding_id]
        assert (kept.impairs, kept.rule) == (False, "before-in-place-fix")

        # The Web UI's runbook and `autorepair history` say which rung was taken.
        details = await current_details(client, repair_workflow_id(faulty, 1))
        assert "Remediation **reboot-first**: first reboot (NVIDIA: RESTART_BM)" in details
        assert "[done] Reboot the instance (EC2 RebootInstances)" in details
        assert "[done] Set the container instance ACTIVE" in details
        assert "fixed in place by **reboot**" in details
        [record] = [r for r in await cli_json(fleet.settings, "history", "--instance", faulty) if r["attempt"] == 1]
        assert (record["action"], record["replacementInstanceId"], record["outcome"]) == ("reboot", None, "Completed")

        # The same GPU faults again within the escalation window: replaced, start-before-stop, and said why.
        fleet.sim.inject_fault(faulty, xid=79, pci=pci)
        second = await closed(fleet, repair_workflow_id(faulty, 2))
        assert steps_of(fleet, repair_workflow_id(faulty, 2)) == ESCALATED_AT_ONCE
        [escalated] = fleet.events("Escalated", faulty)
        assert (escalated["detail"]["from_action"], escalated["detail"]["to_action"]) == ("reboot", "replace")
        assert escalated["detail"]["why"].startswith(f"XID_79 on GPU {pci} ")
        assert (
            f"after its reboot by {repair_workflow_id(faulty, 1)} (escalation_window 86400s)"
            in escalated["detail"]["why"]
        )
        assert second.action is RepairAction.REPLACE and second.replacement_instance_id is not None
        assert fleet.replacements_of(faulty) == [second.replacement_instance_id]
        assert fleet.ec2_state(faulty) == "terminated"
        assert node.reboots == 1
        details = await current_details(client, repair_workflow_id(faulty, 2))
        assert "- escalated reboot → **replace**: XID_79 on GPU" in details


async def test_an_instance_fixed_in_place_max_fixes_in_place_times_is_replaced_at_its_next_fault(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        reboot_first(fleet, max_fixes_in_place=1)
        await fleet.all_healthy(3)
        faulty = fleet.sim.live_instances()[0]
        first_gpu, other_gpu = P5_GPU_PCI[0], P5_GPU_PCI[1]
        fleet.sim.inject_fault(faulty, xid=79, pci=first_gpu)
        await closed(fleet, repair_workflow_id(faulty, 1))
        assert steps_of(fleet, repair_workflow_id(faulty, 1)) == REBOOTED_IN_PLACE
        view = await eventually(
            lambda: fleet.sim.health(faulty),
            lambda v: v is not None and v.healthStatus.overallStatus is HealthState.OK and len(v.in_place_fixes) == 1,
        )
        assert view is not None and view.in_place_fixes[0].workflow_id == repair_workflow_id(faulty, 1)

        # Another GPU: not the escalation_window's rule (that is the same GPU's), but the instance's second fault
        # after max_fixes_in_place = 1 fix: replaced at once, start-before-stop, and said why.
        fleet.sim.inject_fault(faulty, xid=79, pci=other_gpu)
        second = await closed(fleet, repair_workflow_id(faulty, 2))
        assert steps_of(fleet, repair_workflow_id(faulty, 2)) == ESCALATED_AT_ONCE
        [escalated] = fleet.events("Escalated", faulty)
        assert escalated["detail"]["why"] == (
            f"XID_79: the instance was fixed in place 1 time within fix_window 604800s, the last by "
            f"{repair_workflow_id(faulty, 1)} (max_fixes_in_place 1)"
        )
        assert second.action is RepairAction.REPLACE and fleet.replacements_of(faulty) == [
            second.replacement_instance_id
        ]
        assert fleet.sim.node(faulty).reboots == 1


async def test_a_reboot_that_does_not_clear_the_fault_is_replaced(client: Client, aws_env: str, tmp_path: Path) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=4) as fleet:
        reboot_first(fleet)
        await fleet.all_healthy(4)
        hangs, persists, *_ = fleet.sim.live_instances()
        fleet.sim.node(hangs).reboot_hangs = True
        fleet.sim.node(persists).fault_persists = True
        fleet.sim.inject_fault(hangs, xid=62)  # NVIDIA: RESET_GPU; the group does not reset GPUs: reboot
        fleet.sim.inject_fault(persists, xid=79)
        hangs_repair, persists_repair = repair_workflow_id(hangs, 1), repair_workflow_id(persists, 1)
        results = {hangs: await closed(fleet, hangs_repair), persists: await closed(fleet, persists_repair)}

        # Each went as far as its reboot, then on to a replacement, start-before-stop, in the same workflow.
        for instance_id, result in results.items():
            assert steps_of(fleet, repair_workflow_id(instance_id, 1)) == [
                *REBOOTED_IN_PLACE[:5],  # up to RebootStarted
                "Escalated",
                "ReplacementLaunched",
                "ReplacementReady",
                "TasksStopped",  # what is left: nothing, the tasks stopped before the reboot
                "Terminated",
                "RepairCompleted",
                "DrainPermitReleased",
            ], instance_id
            assert result.action is RepairAction.REPLACE and result.escalated is not None
            assert result.replacement_instance_id is not None
            assert fleet.ec2_state(instance_id) == "terminated"
            assert fleet.ec2_state(result.replacement_instance_id) == "running"
            assert fleet.sim.node(instance_id).reboots == 1

        # Not back within reboot_timeout: the probe never heartbeat from a new boot.
        [escalated] = fleet.events("Escalated", hangs)
        assert (escalated["detail"]["from_action"], escalated["detail"]["to_action"]) == ("reboot", "replace")
        assert escalated["detail"]["why"].startswith(
            "not back within reboot_timeout 12s: still waiting for a heartbeat from a"
        )
        details = await current_details(client, hangs_repair)
        assert "[done] Reboot the instance" in details and "[done] Terminate the impaired instance" in details
        # Back on a new boot, but the same GPU faulted again: replaced without waiting out the timeout.
        [escalated] = fleet.events("Escalated", persists)
        fault = fleet.sim.node(persists).last_fault
        assert fault is not None
        assert escalated["detail"]["why"] == f"faulted again after the reboot: XID_79 on GPU {fault[1]}"


REFUSED_OUTPUT = (
    "GPU 00000000:53:00.0 is currently in use by another process.\n\n1 device is currently being used by one or "
    "more other processes (e.g., Fabric Manager, CUDA application, graphics application such as an X server, or a "
    "monitoring application such as another instance of nvidia-smi). Please first kill all processes using this "
    "device and all compute applications running in the system."
)


async def test_a_gpu_reset_and_a_refused_one_that_falls_back_to_a_reboot(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    with FlakyAws(aws_env) as proxy:
        async with simulated_fleet(client, aws_env, tmp_path, instances=3, engine_proxy=proxy) as fleet:
            reboot_first(fleet, gpu_reset=True)
            await fleet.all_healthy(3)
            faulty, resettable, _ = fleet.sim.live_instances()
            node = fleet.sim.node(faulty)
            node.reset_refused = True
            proxy.answer(
                "GetCommandInvocation",
                {
                    "CommandId": "refused",
                    "InstanceId": faulty,
                    "Status": "Failed",
                    "StatusDetails": "Failed",
                    "ResponseCode": 255,
                    "StandardOutputContent": REFUSED_OUTPUT,
                    "StandardErrorContent": "",
                },
                times=1,  # the refused reset's one look; later resets get moto's own answer, Success
                service="ssm",
            )
            fleet.sim.inject_fault(faulty, xid=95)  # NVIDIA: RESET_GPU
            assert node.last_fault is not None
            pci = node.last_fault[1]

            result = await closed(fleet, repair_workflow_id(faulty, 1))

            assert steps_of(fleet, repair_workflow_id(faulty, 1)) == [
                *REBOOTED_IN_PLACE[:4],
                "GpuResetStarted",
                "Escalated",
                *REBOOTED_IN_PLACE[4:],
            ]
            [escalated] = fleet.events("Escalated", faulty)
            assert (escalated["detail"]["from_action"], escalated["detail"]["to_action"]) == ("gpu-reset", "reboot")
            assert escalated["detail"]["why"].startswith(
                f"reset of GPU {pci} refused (Failed, exit status 255): GPU 00000000"
            )
            assert "currently in use by another process" in escalated["detail"]["why"]
            # The reset was sent for the finding's GPU, through SSM; then the reboot, then the fix's gate on the host
            # (DCGM's diagnostic where installed, through SSM too); nothing launched or killed.
            assert proxy.calls("SendCommand") == 2 and proxy.canned_served("GetCommandInvocation") >= 1
            assert proxy.calls("RebootInstances") == 1
            assert proxy.calls("RunInstances") == 0 and proxy.calls("TerminateInstances") == 0
            ssm = boto3.client("ssm", endpoint_url=aws_env, region_name="us-east-1")
            reset, gate = sorted(ssm.list_commands(InstanceId=faulty)["Commands"], key=lambda c: c["RequestedDateTime"])
            assert (
                gate["Comment"].startswith(names.GATE_COMMENT)
                and "dcgmi diag -r 1" in gate["Parameters"]["commands"][1]
            )
            command = reset
            assert command["Parameters"]["commands"] == [f"nvidia-smi -r -i {pci}.0"]
            assert node.resets == 0 and node.reboots == 1
            assert (result.action, result.replacement_instance_id) == (RepairAction.REBOOT, None)
            assert container_status(fleet, faulty) == "ACTIVE"
            details = await current_details(client, repair_workflow_id(faulty, 1))
            assert f"[done] Reset GPU {pci} (nvidia-smi -r through SSM)" in details
            assert "- escalated gpu-reset → **reboot**: reset of GPU" in details

            # A reset that works: the same boot, the GPU left alone by the fleet, nothing rebooted or replaced.
            boot = fleet.sim.node(resettable).boot_id
            fleet.sim.inject_fault(resettable, xid=95)
            result = await closed(fleet, repair_workflow_id(resettable, 1))
            assert steps_of(fleet, repair_workflow_id(resettable, 1)) == [
                *REBOOTED_IN_PLACE[:4],
                "GpuResetStarted",
                "GpuResetCompleted",
                *REBOOTED_IN_PLACE[6:],
            ]
            assert (result.action, result.replacement_instance_id) == (RepairAction.GPU_RESET, None)
            assert fleet.sim.node(resettable).resets == 1 and fleet.sim.node(resettable).reboots == 0
            assert fleet.sim.node(resettable).boot_id == boot
            assert proxy.calls("SendCommand") == 4 and proxy.calls("RebootInstances") == 1  # a reset and a gate each
            assert container_status(fleet, resettable) == "ACTIVE"
            view = await fleet.sim.health(resettable)
            assert view is not None and not view.retired and view.last_in_place_fix is not None
            assert view.last_in_place_fix.action is RepairAction.GPU_RESET


async def test_replace_still_replaces_and_reboot_first_is_set_live(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        await fleet.all_healthy(3)
        first, second, _ = fleet.sim.live_instances()
        # The default, ECS's behaviour: a fault a reboot would clear is replaced all the same, nothing rebooted.
        fleet.sim.inject_fault(first, xid=79)
        await closed(fleet, repair_workflow_id(first, 1))
        await assert_start_before_stop(fleet, first)
        assert fleet.sim.node(first).reboots == 0
        details = await current_details(client, repair_workflow_id(first, 1))
        assert "Remediation" not in details and "Reboot" not in details

        # Changed live, through the semaphore's update: the next repair reads it. An Xid NVIDIA sends to its
        # double-bit ECC workflow is no reboot's to clear: replaced at once, and the event says why.
        code, out, err = await autorepair(
            cli_env(fleet.settings), "group", "update", "--name", fleet.group, "--remediation", "reboot-first"
        )
        assert code == 0, err
        assert "remediation=reboot-first" in out
        fleet.sim.inject_fault(second, xid=48)
        await closed(fleet, repair_workflow_id(second, 1))
        assert steps_of(fleet, repair_workflow_id(second, 1)) == ESCALATED_AT_ONCE
        [escalated] = fleet.events("Escalated", second)
        assert (
            escalated["detail"]["why"]
            == "XID_48: NVIDIA's immediate action is WORKFLOW_XID_48, not a GPU reset or a reboot"
        )
        assert fleet.sim.node(second).reboots == 0
        details = await current_details(client, repair_workflow_id(second, 1))
        assert "Remediation **reboot-first**: replaced at once (NVIDIA: WORKFLOW_XID_48)" in details
        assert "[done] Launch a replacement in the same AZ" in details
        [changed] = fleet.events("GroupConfigChanged")
        assert changed["detail"]["changes"]["remediation"] == {"old": "replace", "new": "reboot-first"}
        view = await fleet.sim.health(second)
        assert view is not None and view.retired and view.last_in_place_fix is None
