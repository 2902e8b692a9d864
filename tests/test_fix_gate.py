"""The gate a fix in place must pass before work returns to the instance (issue 25, "verify before return").

Each row of workflows/fix_gate.py's GATE_CHECKS on the plain model; then end to end on the real dev server, moto over
HTTP and the simulated fleet: a reboot after which the host shows 7 of its type's 8 GPUs fails the gate and the
instance is replaced start-before-stop, never set ACTIVE. A replacement passes the same gate before the impaired
instance goes: the reported checks by default, and with `verify_replacement = "on_host"` the host's part too, through
SSM Run Command (moto answers Success; the fault proxy plays a failing or silent host).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from pydantic import ValidationError
from temporalio.api.enums.v1 import EventType as HistoryEventType
from temporalio.client import Client
from temporalio.converter import default as default_converter

from activities.models import HealthViewExcerpt
from activities.remediation import gate_script
from contract import names
from contract.groups import VERIFY_ON_HOST, CapacityGroup
from contract.ids import health_workflow_id, repair_workflow_id
from contract.probe import GpuFinding, GpuRef, Heartbeat
from contract.repair import GpuVerdict, RepairAction
from simulator.aws_proxy import FlakyAws
from tests.fleet import START_BEFORE_STOP, Fleet, assert_start_before_stop, simulated_fleet
from tests.harness import eventually
from tests.test_remediation_ladder import closed, container_status, reboot_first, steps_of
from tests.test_replacement_attempts import REPLACED_ON_SECOND_ATTEMPT, set_group
from worker.settings import Settings
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


def test_a_finding_sent_without_an_offset_is_read_as_utc_and_gated() -> None:
    """A host's payload with a naive observed_at: read as UTC where it is decoded, so comparing it with the fix's
    start (aware) cannot fail the repair's workflow task, and the events that carry it say their offset."""
    payload = seen("XID_79", impairs=True).model_dump(mode="json")
    payload["observed_at"] = (SINCE + timedelta(minutes=1)).replace(tzinfo=None).isoformat()
    probe = HealthViewExcerpt.model_validate({"recent_findings": [payload]})
    [finding] = probe.recent_findings
    assert finding.observed_at == SINCE + timedelta(minutes=1) and finding.observed_at.tzinfo is not None
    assert failures(run_gate(probe, SINCE)) == f"faults: faulted since the fix: XID_79 on {GPU}"


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
        assert verified["detail"]["passed"] is False
        assert {c["name"]: c["passed"] for c in verified["detail"]["checks"]} == {
            "gpus": False,
            "nvidia": True,
            "memory": True,
            "faults": True,
        }
        [escalated] = fleet.events("Escalated", faulty)
        assert (escalated["detail"]["from_action"], escalated["detail"]["to_action"]) == ("reboot", "replace")
        assert escalated["detail"]["why"] == "the fix did not pass the gate: gpus: 7 of the 8 GPUs of its type visible"
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
        # The new host faults as it comes up: ACTIVE in ECS, but not fit to take the work.
        fleet.sim.faulted_replacements = {1: 79}
        fleet.sim.inject_fault(faulty, xid=79)
        [launched] = await eventually(lambda: _events(fleet, "ReplacementLaunched", faulty), bool)
        bad = launched["detail"]["replacement_instance_id"]

        result = await closed(fleet, repair_workflow_id(faulty, 1))

        [abandoned] = fleet.events("ReplacementAbandoned", faulty)
        assert abandoned["detail"]["replacement_instance_id"] == bad and abandoned["detail"]["attempt"] == 1
        assert abandoned["detail"]["why"].startswith("failed the gate: faults: faulted since the fix: XID_79 on ")
        ready = fleet.events("ReplacementReady", faulty)
        assert [r["detail"]["attempt"] for r in ready] == [2]
        assert all(c["passed"] for c in ready[0]["detail"]["checks"]) and len(ready[0]["detail"]["checks"]) == len(
            GATE_CHECKS
        )
        assert result.replacement_instance_id == ready[0]["detail"]["replacement_instance_id"] != bad
        assert fleet.ec2_state(bad) == "terminated" and fleet.ec2_state(faulty) == "terminated"
        assert fleet.ec2_state(ready[0]["detail"]["replacement_instance_id"]) == "running"
        # verify_replacement true, the default: the reported checks alone, nothing sent to a replacement's host,
        # though the group's gate_diag_level (1) would have a fix's host run DCGM's diagnostic.
        assert fleet.settings.groups[0].verify_replacement is True and fleet.settings.groups[0].gates_on_host
        for replacement in (bad, ready[0]["detail"]["replacement_instance_id"]):
            assert _gate_commands(aws_env, replacement) == []


NCCL_SAYS = "all_reduce_perf: busbw 12.3 GB/s, below the 300 GB/s floor"


async def test_a_reboot_whose_host_fails_the_operator_s_gate_command_is_replaced(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    with FlakyAws(aws_env) as proxy:
        async with simulated_fleet(client, aws_env, tmp_path, instances=3, engine_proxy=proxy) as fleet:
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
            assert verified["detail"]["passed"] is False
            [host] = [c for c in verified["detail"]["checks"] if c["name"] == "host"]
            assert host["passed"] is False and host["detail"].endswith(f"Failed, exit status 1: {NCCL_SAYS}")
            [escalated] = fleet.events("Escalated", faulty)
            assert escalated["detail"]["why"].startswith("the fix did not pass the gate: host: SSM command ")
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


def test_verify_replacement_reads_true_false_and_on_host() -> None:
    def read(value: object) -> CapacityGroup:
        return Settings(groups=[{"name": "g", "cluster": "c", "verify_replacement": value}]).groups[0]

    assert read(True).verify_replacement is True and not read(True).gates_replacement_on_host
    assert read(False).verify_replacement is False and not read(False).gates_replacement_on_host
    assert read("on_host").verify_replacement == VERIFY_ON_HOST and read("on_host").gates_replacement_on_host
    assert Settings(groups=[{"name": "g", "cluster": "c"}]).groups[0].verify_replacement is True
    with pytest.raises(ValidationError, match="verify_replacement"):
        read("onhost")
    # Nothing to run on the host: "on_host" adds nothing, as a fix's gate runs nothing there either.
    nothing = Settings(groups=[{"name": "g", "cluster": "c", "verify_replacement": "on_host", "gate_diag_level": 0}])
    assert not nothing.groups[0].gates_replacement_on_host


async def _scheduled(client: Client, workflow_id: str) -> list[tuple[str, datetime, str]]:
    """Each activity the workflow scheduled: its name, when, and its summary (the step the Web UI shows)."""
    converter = default_converter().payload_converter
    steps = []
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.event_type == HistoryEventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            summary = event.user_metadata.summary
            said = str(converter.from_payload(summary, str)) if event.user_metadata.HasField("summary") else ""
            steps.append((name, event.event_time.ToDatetime(tzinfo=UTC), said))
    return steps


def _gate_commands(aws_env: str, instance_id: str) -> list[dict[str, Any]]:
    """The gate commands sent to the instance, by their comment: moto lists a command sent to one instance under
    every instance of the region (it adds the instances its empty Targets match), so only the comment tells."""
    ssm = boto3.client("ssm", endpoint_url=aws_env, region_name="us-east-1")
    commands: list[Any] = ssm.list_commands(InstanceId=instance_id)["Commands"]
    return [c for c in commands if c["Comment"].startswith(f"{names.GATE_COMMENT} {instance_id} ")]


async def test_a_replacement_that_passes_the_gate_on_its_host_takes_over(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        set_group(fleet, verify_replacement=VERIFY_ON_HOST)
        await fleet.all_healthy(3)
        faulty = fleet.sim.live_instances()[0]
        fleet.sim.inject_fault(faulty, xid=79)

        result = await closed(fleet, repair_workflow_id(faulty, 1))

        await assert_start_before_stop(fleet, faulty)
        [ready] = fleet.events("ReplacementReady", faulty)
        replacement = ready["detail"]["replacement_instance_id"]
        assert result.replacement_instance_id == replacement
        # The reported checks, then the host's: DCGM's diagnostic at the group's level, sent to the replacement.
        assert [c["name"] for c in ready["detail"]["checks"]] == [*(row.name for row in GATE_CHECKS), "host"]
        assert all(c["passed"] for c in ready["detail"]["checks"]), ready["detail"]["checks"]
        [command] = _gate_commands(aws_env, replacement)
        assert ready["detail"]["checks"][-1]["detail"].startswith(f"SSM command {command['CommandId']} Success")
        assert "dcgmi diag -r 1" in command["Parameters"]["commands"][1]
        assert _gate_commands(aws_env, faulty) == []  # the old instance's host is not asked anything
        assert fleet.ec2_state(faulty) == "terminated" and fleet.ec2_state(replacement) == "running"
        # A step of its own in the Web UI, before the impaired instance is terminated.
        steps = await _scheduled(client, repair_workflow_id(faulty, 1))
        summaries = [summary for _, _, summary in steps]
        gate = f"run the gate on {replacement}: dcgmi diag -r 1 through SSM Run Command"
        assert gate in summaries, summaries
        names_in_order = [name for name, _, _ in steps]
        assert names_in_order.index("send_gate_command") < names_in_order.index("terminate_instance"), names_in_order


async def test_a_replacement_whose_gate_command_fails_is_abandoned_and_another_launched(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    with FlakyAws(aws_env) as proxy:
        async with simulated_fleet(client, aws_env, tmp_path, instances=3, engine_proxy=proxy) as fleet:
            set_group(fleet, verify_replacement=VERIFY_ON_HOST, gate_command="/opt/nccl-tests/check.sh")
            await fleet.all_healthy(3)
            faulty = fleet.sim.live_instances()[0]
            # moto runs no command: the proxy answers the first replacement's one look as its host would have; the
            # second replacement gets moto's own answer, Success.
            failed = {"Status": "Failed", "StatusDetails": "Failed", "ResponseCode": 1}
            proxy.answer(
                "GetCommandInvocation",
                {**failed, "StandardOutputContent": NCCL_SAYS, "StandardErrorContent": ""},
                times=1,
                service="ssm",
            )
            fleet.sim.inject_fault(faulty, xid=79)

            result = await closed(fleet, repair_workflow_id(faulty, 1))

            assert fleet.steps(faulty) == REPLACED_ON_SECOND_ATTEMPT
            [abandoned] = fleet.events("ReplacementAbandoned", faulty)
            bad = abandoned["detail"]["replacement_instance_id"]
            assert abandoned["detail"]["attempt"] == 1 and abandoned["detail"]["attempts_left"] == 2
            assert abandoned["detail"]["why"].startswith("failed the gate: host: SSM command "), abandoned["detail"][
                "why"
            ]
            assert abandoned["detail"]["why"].endswith(f"Failed, exit status 1: {NCCL_SAYS}"), abandoned["detail"][
                "why"
            ]
            [ready] = fleet.events("ReplacementReady", faulty)
            good = ready["detail"]["replacement_instance_id"]
            assert ready["detail"]["attempt"] == 2 and good != bad and result.replacement_instance_id == good
            assert [(c["name"], c["passed"]) for c in ready["detail"]["checks"]][-1] == ("host", True)
            # Each replacement was sent the same gate: DCGM's diagnostic where installed, then the operator's command.
            for replacement in (bad, good):
                [command] = _gate_commands(aws_env, replacement)
                assert command["Parameters"]["commands"][2:] == ["/opt/nccl-tests/check.sh"]
            assert proxy.canned_served("GetCommandInvocation") == 1
            assert fleet.ec2_state(bad) == "terminated" and fleet.ec2_state(faulty) == "terminated"
            assert fleet.ec2_state(good) == "running"


# Under SendCommand's least TimeoutSeconds (30 s): the command is still sent (activities/ssm.py raises its delivery
# timeout to that), and the gate still ends at gate_timeout.
GATE_TIMEOUT = timedelta(seconds=8)
# A look at the command, one poll interval (the compressed heartbeat, 1 s) and the step's own calls, on a shared
# machine.
GATE_SLACK = timedelta(seconds=20)


async def test_a_replacement_whose_host_never_answers_fails_within_gate_timeout(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    with FlakyAws(aws_env) as proxy:
        async with simulated_fleet(client, aws_env, tmp_path, instances=3, engine_proxy=proxy) as fleet:
            set_group(fleet, verify_replacement=VERIFY_ON_HOST, gate_timeout=GATE_TIMEOUT, max_replacement_attempts=1)
            await fleet.all_healthy(3)
            faulty = fleet.sim.live_instances()[0]
            # SSM took the command, and the host never says how it went.
            proxy.answer("GetCommandInvocation", {"Status": "InProgress", "StatusDetails": "InProgress"}, service="ssm")
            fleet.sim.inject_fault(faulty, xid=79)

            await eventually(lambda: _events(fleet, "RepairFailed", faulty), bool, within=180)

            [abandoned] = fleet.events("ReplacementAbandoned", faulty)
            replacement = abandoned["detail"]["replacement_instance_id"]
            assert abandoned["detail"]["why"] == "failed the gate: host: no answer within gate_timeout 8s (InProgress)"
            assert len(_gate_commands(aws_env, replacement)) == 1
            # Given up at gate_timeout after the command was sent, not before and not at replacement_ready_timeout.
            steps = await _scheduled(client, repair_workflow_id(faulty, 1))
            [sent_at] = [at for name, at, _ in steps if name == "send_gate_command"]
            [given_up_at] = [at for name, at, _ in steps if name == "terminate_replacement"]
            assert GATE_TIMEOUT <= given_up_at - sent_at <= GATE_TIMEOUT + GATE_SLACK, given_up_at - sent_at
            assert proxy.canned_served("GetCommandInvocation") >= 2  # looked again until the deadline
            # Never stop before start: the impaired instance stays, drained and running; the silent one is gone.
            assert fleet.ec2_state(replacement) == "terminated"
            assert fleet.ec2_state(faulty) == "running" and container_status(fleet, faulty) == "DRAINING"
