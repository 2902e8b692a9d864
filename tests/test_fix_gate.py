"""The gate a fix in place must pass before work returns to the instance (issue 25, "verify before return").

Each row of workflows/fix_gate.py's GATE_CHECKS on the plain model; then end to end on the real dev server, moto over
HTTP and the simulated fleet: a reboot after which the host shows 7 of its type's 8 GPUs fails the gate and the
instance is replaced start-before-stop, never set ACTIVE.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from pydantic import ValidationError
from temporalio.client import Client

from activities.models import HealthViewExcerpt
from activities.remediation import gate_script
from contract import names
from contract.groups import CapacityGroup
from contract.ids import health_workflow_id, repair_workflow_id
from contract.probe import GpuFinding, GpuRef, Heartbeat
from contract.repair import GpuVerdict, RepairAction
from simulator.aws_proxy import FlakyAws
from tests.fleet import START_BEFORE_STOP, Fleet, simulated_fleet
from tests.harness import eventually
from tests.test_remediation_ladder import closed, container_status, reboot_first, steps_of
from workflows.fix_gate import GATE_CHECKS, failures, run_gate

SINCE = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
GPU = "0000:53:00"


def seen(reason: str, impairs: bool = False, at: datetime = SINCE + timedelta(minutes=1)) -> GpuFinding:
    return GpuFinding(
        finding_id=f"{reason}-{at.timestamp()}",
        instance_id="i-1",
        group="g",
        kind="nvml" if not impairs else "xid",
        reason=reason,
        impairs=impairs,
        gpu=GpuRef(pci=GPU),
        observed_at=at,
    )


def verdict(name: str, action: str) -> GpuVerdict:
    return GpuVerdict(verdict=name, action=action, gpu=GPU, reason="XID_154", finding_id="v", observed_at=SINCE)


@pytest.mark.parametrize(
    ("probe", "failed"),
    [
        (HealthViewExcerpt(gpu_count=8, expected_gpus=8), None),
        # Not knowing is no failure: the GPU sources were OK for the instance to be back at all.
        (HealthViewExcerpt(gpu_count=None, expected_gpus=8), None),
        (HealthViewExcerpt(gpu_count=7, expected_gpus=8), "gpus: 7 of the 8 GPUs of its type visible"),
        (
            HealthViewExcerpt(nvidia_verdicts=[verdict("recovery_action", "RESET_GPU")]),
            f"nvidia: NVIDIA still asks: recovery_action RESET_GPU on {GPU}",
        ),
        (
            HealthViewExcerpt(recent_findings=[seen("NVML_REMAP_PENDING")]),
            f"memory: NVML_REMAP_PENDING on {GPU}",
        ),
        # Pending before the fix began is what the fix dealt with.
        (HealthViewExcerpt(recent_findings=[seen("NVML_REMAP_PENDING", at=SINCE - timedelta(seconds=1))]), None),
        (
            HealthViewExcerpt(recent_findings=[seen("XID_79", impairs=True)]),
            f"faults: faulted since the fix: XID_79 on {GPU}",
        ),
        (HealthViewExcerpt(recent_findings=[seen("XID_13")]), None),  # a warning is no fault
    ],
    ids=[
        "all-there",
        "count-unknown",
        "gpu-missing",
        "verdict-held",
        "remap-pending",
        "pending-before",
        "fault",
        "warn",
    ],
)
def test_each_row_of_the_gate(probe: HealthViewExcerpt, failed: str | None) -> None:
    checks = run_gate(probe, SINCE)
    assert [c.name for c in checks] == [row.name for row in GATE_CHECKS]
    assert failures(checks) == failed
    assert all(c.detail for c in checks)  # a passed check says what it checked


async def test_a_reboot_that_leaves_a_gpu_missing_fails_the_gate_and_the_instance_is_replaced(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        reboot_first(fleet)
        await fleet.all_healthy(3)
        faulty = fleet.sim.live_instances()[0]
        node = fleet.sim.node(faulty)
        fleet.sim.inject_fault(faulty, xid=79)  # NVIDIA: RESTART_BM
        await eventually(lambda: _events(fleet, "RebootStarted", faulty), bool)
        # While it reboots, its probe counts 7 of the p5.48xlarge's 8 GPUs (NVML's count, as it would report it; the
        # simulated nodes have no NVML of their own), and nothing counts otherwise after the reboot.
        short = Heartbeat(
            instance_id=faulty, group=fleet.group, sent_at=datetime.now(UTC), gpu_count=7, boot_id=node.boot_id
        )
        await client.get_workflow_handle(health_workflow_id(faulty)).signal(names.SIGNAL_HEARTBEAT, short)

        result = await closed(fleet, repair_workflow_id(faulty, 1))

        steps = steps_of(fleet, repair_workflow_id(faulty, 1))
        # Gated, then on to the replacement steps, start-before-stop, in the same workflow.
        after = [
            "RebootCompleted",
            "FixVerified",
            "Escalated",
            *START_BEFORE_STOP[START_BEFORE_STOP.index("Draining") + 1 :],
        ]
        assert steps[steps.index("RebootCompleted") :] == after
        [verified] = fleet.events("FixVerified", faulty)
        assert verified["passed"] is False
        assert {c["name"]: c["passed"] for c in verified["checks"]} == {
            "gpus": False,
            "nvidia": True,
            "memory": True,
            "faults": True,
        }
        [escalated] = fleet.events("Escalated", faulty)
        assert (escalated["from_action"], escalated["to_action"]) == ("reboot", "replace")
        assert escalated["why"] == "the fix did not pass the gate: gpus: 7 of the 8 GPUs of its type visible"
        assert result.action is RepairAction.REPLACE and result.replacement_instance_id is not None
        assert container_status(fleet, faulty) != "ACTIVE"  # never back in service
        assert fleet.ec2_state(faulty) == "terminated"


async def _events(fleet: Fleet, type: str, instance_id: str) -> list[dict[str, Any]]:
    return fleet.events(type, instance_id)


async def test_a_replacement_that_fails_the_gate_is_abandoned_and_another_launched(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        await fleet.all_healthy(3)
        faulty = fleet.sim.live_instances()[0]
        fleet.sim.inject_fault(faulty, xid=79)
        [launched] = await eventually(lambda: _events(fleet, "ReplacementLaunched", faulty), bool)
        bad = launched["replacement_instance_id"]
        # The new host faults as it comes up: ACTIVE in ECS, but not fit to take the work.
        await eventually(lambda: _has_node(fleet, bad), bool)
        fleet.sim.inject_fault(bad, xid=79)

        result = await closed(fleet, repair_workflow_id(faulty, 1))

        [abandoned] = fleet.events("ReplacementAbandoned", faulty)
        assert abandoned["replacement_instance_id"] == bad and abandoned["attempt"] == 1
        assert abandoned["why"].startswith("failed the gate: faults: faulted since the fix: XID_79 on ")
        ready = fleet.events("ReplacementReady", faulty)
        assert [r["attempt"] for r in ready] == [2]
        assert all(c["passed"] for c in ready[0]["checks"]) and len(ready[0]["checks"]) == len(GATE_CHECKS)
        assert result.replacement_instance_id == ready[0]["replacement_instance_id"] != bad
        assert fleet.ec2_state(bad) == "terminated" and fleet.ec2_state(faulty) == "terminated"
        assert fleet.ec2_state(ready[0]["replacement_instance_id"]) == "running"


async def _has_node(fleet: Fleet, instance_id: str) -> bool:
    return instance_id in fleet.sim.live_instances()


NCCL_SAYS = "all_reduce_perf: busbw 12.3 GB/s, below the 300 GB/s floor"


async def test_a_reboot_whose_host_fails_the_operator_s_gate_command_is_replaced(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    with FlakyAws(aws_env) as proxy:
        async with simulated_fleet(client, aws_env, tmp_path, instances=3, engine_endpoint=proxy.url) as fleet:
            reboot_first(fleet, gate_command="/opt/nccl-tests/check.sh")
            await fleet.all_healthy(3)
            faulty = fleet.sim.live_instances()[0]
            # moto runs no command: the proxy answers the gate's one look as the host would have.
            failed = {"Status": "Failed", "StatusDetails": "Failed", "ResponseCode": 1}
            proxy.answer(
                "GetCommandInvocation",
                {**failed, "InstanceId": faulty, "StandardOutputContent": NCCL_SAYS, "StandardErrorContent": ""},
                times=1,
                service="ssm",
            )
            fleet.sim.inject_fault(faulty, xid=79)  # NVIDIA: RESTART_BM

            result = await closed(fleet, repair_workflow_id(faulty, 1))

            [verified] = fleet.events("FixVerified", faulty)
            assert verified["passed"] is False
            [host] = [c for c in verified["checks"] if c["name"] == "host"]
            assert host["passed"] is False and host["detail"].endswith(f"Failed, exit status 1: {NCCL_SAYS}")
            [escalated] = fleet.events("Escalated", faulty)
            assert escalated["why"].startswith("the fix did not pass the gate: host: SSM command ")
            assert result.action is RepairAction.REPLACE and fleet.ec2_state(faulty) == "terminated"
            # What was sent: DCGM's diagnostic where installed, then the operator's command, as root through SSM.
            ssm = boto3.client("ssm", endpoint_url=aws_env, region_name="us-east-1")
            [command] = ssm.list_commands(InstanceId=faulty)["Commands"]
            assert command["Comment"].startswith(names.GATE_COMMENT)
            assert command["Parameters"]["commands"] == [
                "set -e",
                "if command -v dcgmi >/dev/null 2>&1; then dcgmi diag -r 1; "
                "else echo 'dcgmi not installed: no DCGM diagnostic'; fi",
                "/opt/nccl-tests/check.sh",
            ]


def test_the_host_s_part_of_the_gate_runs_only_what_the_group_asks() -> None:
    def group(**fields: object) -> CapacityGroup:
        return CapacityGroup.model_validate({"name": "g", "cluster": "c", **fields})

    assert not group(gate_diag_level=0).gates_on_host and gate_script(group(gate_diag_level=0)) == []
    assert gate_script(group(gate_diag_level=3))[1].startswith(
        "if command -v dcgmi >/dev/null 2>&1; then dcgmi diag -r 3;"
    )
    assert gate_script(group(gate_diag_level=0, gate_command="nccl-check")) == ["set -e", "nccl-check"]
    with pytest.raises(ValidationError):
        group(gate_diag_level=5)  # DCGM's levels are 1 to 4
