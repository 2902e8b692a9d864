"""The remediation ladder's decisions and a repair's runbook, read as plain models: no server, a fixed clock.

Each row of the ladder's table (docs/operations.md, "The remediation ladder") is one case here; the workflow tests
(test_remediation_ladder.py) keep what only a server shows: the steps' activities, timers and events.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from activities.models import HealthViewExcerpt, RecoveryStatus
from contract.groups import CapacityGroup, Remediation
from contract.health import HealthState
from contract.probe import GpuFinding, GpuRef, ProbeSourceHealth
from contract.repair import InPlaceFix, PhaseStep, RepairAction, RepairInput, RepairPhase
from workflows import repair_runbook
from workflows.repair_ladder import Ladder, WorldWait, missing, new_fault
from workflows.repair_record import RepairRecord

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
GPU = "0000:53:00"
OTHER_GPU = "0000:64:00"


def finding(action: str = "RESTART_VM", pci: str | None = GPU, **fields: object) -> GpuFinding:
    values: dict[str, object] = {
        "finding_id": "f1",
        "instance_id": "i-1",
        "group": "g",
        "kind": "xid",
        "code": 79,
        "reason": "XID_79",
        "impairs": True,
        "gpu": GpuRef(pci=pci),
        "immediate_action": action,
        "observed_at": NOW,
    }
    values.update(fields)
    return GpuFinding.model_validate(values)


def group(**fields: object) -> CapacityGroup:
    return CapacityGroup.model_validate({"name": "g", "cluster": "c", "remediation": "reboot-first", **fields})


def repair_input(found: GpuFinding | None = None, fix: InPlaceFix | None = None) -> RepairInput:
    return RepairInput(instance_id="i-1", group="g", reason="XID_79", finding=found, last_in_place_fix=fix)


def fixed(ago: timedelta, gpu: str | None = GPU) -> InPlaceFix:
    return InPlaceFix(workflow_id="repair/i-1/1", action=RepairAction.REBOOT, gpu=gpu, fixed_at=NOW - ago)


def chosen(input: RepairInput, config: CapacityGroup) -> Ladder:
    ladder = Ladder()
    ladder.choose(input, config, NOW)
    return ladder


# --- which rung first ------------------------------------------------------------------------------------------


def test_a_replace_group_never_takes_the_rung() -> None:
    ladder = chosen(repair_input(finding("RESET_GPU")), group(remediation="replace", gpu_reset=True))
    assert ladder.remediation is Remediation.REPLACE
    assert ladder.first is ladder.action is RepairAction.REPLACE
    assert ladder.escalations == [] and ladder.escalated is None and ladder.nvidia_action == ""


@pytest.mark.parametrize(
    ("found", "config", "first"),
    [
        (finding("RESTART_VM"), group(), RepairAction.REBOOT),
        (finding("RESTART_BM"), group(), RepairAction.REBOOT),
        (finding("RESET_GPU"), group(gpu_reset=True), RepairAction.GPU_RESET),
        # A reset is sent only where the group allows it and the finding names the GPU; else the reboot does it.
        (finding("RESET_GPU"), group(), RepairAction.REBOOT),
        (finding("RESET_GPU", pci=None), group(gpu_reset=True), RepairAction.REBOOT),
    ],
    ids=["restart-vm", "restart-bm", "reset", "reset-not-allowed", "reset-no-gpu"],
)
def test_what_nvidia_says_a_reset_or_reboot_clears_is_handled_in_place(
    found: GpuFinding, config: CapacityGroup, first: RepairAction
) -> None:
    ladder = chosen(repair_input(found), config)
    assert ladder.first is ladder.action is first
    assert ladder.nvidia_action == found.immediate_action and ladder.escalations == []


@pytest.mark.parametrize(
    ("found", "why"),
    [
        (None, "XID_79: not a GPU fault NVIDIA's catalog answers with a reset or a reboot"),
        (
            finding("CONTACT_SUPPORT"),
            "XID_79: NVIDIA's immediate action is CONTACT_SUPPORT, not a GPU reset or a reboot",
        ),
        (finding(""), "XID_79: NVIDIA's immediate action is none, not a GPU reset or a reboot"),
    ],
    ids=["heartbeat-loss", "contact-support", "no-action"],
)
def test_anything_else_is_replaced_at_once_and_says_why(found: GpuFinding | None, why: str) -> None:
    ladder = chosen(repair_input(found), group())
    assert ladder.first is ladder.action is RepairAction.REPLACE
    assert ladder.escalations == [(RepairAction.REBOOT, RepairAction.REPLACE, why)]
    assert ladder.escalated == f"reboot -> replace: {why}"


def test_the_same_gpu_faulting_again_within_the_escalation_window_is_replaced() -> None:
    ladder = chosen(repair_input(finding(), fixed(timedelta(hours=2))), group())
    assert ladder.first is RepairAction.REPLACE
    assert ladder.escalations == [
        (
            RepairAction.REBOOT,
            RepairAction.REPLACE,
            f"XID_79 on GPU {GPU} 7200s after its reboot by repair/i-1/1 (escalation_window 86400s)",
        )
    ]


@pytest.mark.parametrize(
    ("fix", "first"),
    [
        (fixed(timedelta(hours=25)), RepairAction.REBOOT),  # outside the window: a first reboot again
        (fixed(timedelta(hours=2), gpu=OTHER_GPU), RepairAction.REBOOT),  # another GPU: its own first reboot
        (fixed(timedelta(hours=2), gpu=None), RepairAction.REPLACE),  # the instance as a whole was fixed
    ],
    ids=["outside-window", "other-gpu", "instance-fix"],
)
def test_an_earlier_fix_counts_only_within_the_window_and_for_the_same_gpu(
    fix: InPlaceFix, first: RepairAction
) -> None:
    ladder = chosen(repair_input(finding(), fix), group())
    assert ladder.first is first
    if first is RepairAction.REPLACE:
        assert "the instance" in ladder.escalations[0][2]


def fixes(*ago_hours: float, gpu: str | None = OTHER_GPU) -> list[InPlaceFix]:
    return [
        InPlaceFix(
            workflow_id=f"repair/i-1/{n}", action=RepairAction.REBOOT, gpu=gpu, fixed_at=NOW - timedelta(hours=h)
        )
        for n, h in enumerate(ago_hours, start=1)
    ]


@pytest.mark.parametrize(
    ("recent", "config", "first"),
    [
        (fixes(100, 50, 2), group(), RepairAction.REPLACE),  # three within the default 7 days: the fourth replaces
        (fixes(200, 50, 2), group(), RepairAction.REBOOT),  # one of them older than the window
        (fixes(50, 2), group(), RepairAction.REBOOT),  # two: room for a third
        (fixes(2), group(max_fixes_in_place=1), RepairAction.REPLACE),
        (fixes(30, 2), group(max_fixes_in_place=2, fix_window="P1D"), RepairAction.REBOOT),
    ],
    ids=["three-in-a-week", "one-too-old", "two", "max-one", "short-window"],
)
def test_an_instance_fixed_in_place_too_often_is_replaced_whichever_gpu(
    recent: list[InPlaceFix], config: CapacityGroup, first: RepairAction
) -> None:
    ladder = chosen(repair_input(finding()).model_copy(update={"in_place_fixes": recent}), config)
    assert ladder.first is first
    if first is RepairAction.REPLACE:
        [(_, _, why)] = ladder.escalations
        count = len(recent)
        assert why == (
            f"XID_79: the instance was fixed in place {count} time{'s' if count > 1 else ''} within fix_window "
            f"{int(config.fix_window.total_seconds())}s, the last by repair/i-1/{count} "
            f"(max_fixes_in_place {config.max_fixes_in_place})"
        )


def test_an_escalation_is_recorded_once_and_moves_the_action() -> None:
    ladder = chosen(repair_input(finding("RESET_GPU")), group(gpu_reset=True))
    ladder.escalate(RepairAction.GPU_RESET, RepairAction.REBOOT, "refused")
    ladder.escalate(RepairAction.GPU_RESET, RepairAction.REBOOT, "refused")
    assert ladder.action is RepairAction.REBOOT and ladder.first is RepairAction.GPU_RESET
    assert ladder.escalated == "gpu-reset -> reboot: refused"


# --- is it back ---------------------------------------------------------------------------------------------------


def excerpt(
    boot: str | None = "b2", sources: list[ProbeSourceHealth] | None = None, **fields: object
) -> HealthViewExcerpt:
    ok = [ProbeSourceHealth(name="nvml", state=HealthState.OK), ProbeSourceHealth(name="kmsg", state=HealthState.OK)]
    return HealthViewExcerpt.model_validate(
        {"boot_id": boot, "probe_sources": ok if sources is None else sources, **fields}
    )


@pytest.mark.parametrize(
    ("look", "rebooted", "lacking"),
    [
        (RecoveryStatus(probe=None, probe_error="timeout"), True, "its health workflow (timeout)"),
        (RecoveryStatus(probe=excerpt(boot="b1"), agent_connected=True), True, "a heartbeat from a new boot"),
        (RecoveryStatus(probe=excerpt(boot=None), agent_connected=True), True, "a heartbeat from a new boot"),
        (RecoveryStatus(probe=excerpt(sources=[]), agent_connected=True), True, "the probe's GPU sources"),
        (
            RecoveryStatus(
                probe=excerpt(
                    sources=[ProbeSourceHealth(name="nvml", state=HealthState.INSUFFICIENT_DATA, reason="no driver")]
                ),
                agent_connected=True,
            ),
            True,
            "GPU sources OK (no driver)",
        ),
        (RecoveryStatus(probe=excerpt(), agent_connected=False), True, "the ECS agent to connect (disconnected)"),
        (RecoveryStatus(probe=excerpt(), agent_connected=None), True, "the ECS agent to connect (not registered)"),
        (RecoveryStatus(probe=excerpt(), agent_connected=True), True, None),
        # After a reset the boot is the same one: only the GPUs and the agent count.
        (RecoveryStatus(probe=excerpt(boot="b1"), agent_connected=True), False, None),
    ],
    ids=[
        "no-answer",
        "same-boot",
        "no-boot",
        "no-gpu-source",
        "source-down",
        "agent-down",
        "unregistered",
        "back",
        "reset-back",
    ],
)
def test_an_instance_is_back_only_with_a_new_boot_its_gpus_ok_and_its_agent_connected(
    look: RecoveryStatus, rebooted: bool, lacking: str | None
) -> None:
    said = missing(look, "b1" if rebooted else None, rebooted)
    assert (said is None) == (lacking is None)
    if lacking is not None:
        assert said is not None and said.startswith(lacking)


def test_a_daemons_check_down_says_nothing_about_the_gpus() -> None:
    sources = [
        ProbeSourceHealth(name="nvml", state=HealthState.OK),
        ProbeSourceHealth(name="daemons", state=HealthState.IMPAIRED, gpu_source=False),
    ]
    assert missing(RecoveryStatus(probe=excerpt(sources=sources), agent_connected=True), "b1", True) is None


def test_a_wait_on_the_world_ends_at_its_deadline_unless_our_own_query_went_unanswered() -> None:
    wait = WorldWait(NOW, patience=timedelta(minutes=10))
    answered = RecoveryStatus(probe=excerpt(), agent_connected=True)
    # A look recorded before probe_unanswered existed: a replay decides it as it was decided then.
    recorded_before = RecoveryStatus(probe_error="health workflow did not answer: query timed out")
    busy = RecoveryStatus(probe_error="health workflow did not answer: query timed out", probe_unanswered=True)
    before = NOW - timedelta(seconds=1)
    assert not any(wait.over(before, look) for look in (answered, recorded_before, busy))
    # At the deadline the instance's answer ends the wait (and a look recorded before the field)...
    assert wait.over(NOW, answered) and wait.over(NOW, recorded_before)
    # ...our own unanswered query does not, until the patience is spent too.
    assert not wait.over(NOW, busy)
    assert not wait.over(NOW + timedelta(minutes=10) - timedelta(seconds=1), busy)
    assert wait.over(NOW + timedelta(minutes=10), busy)
    # An answer that comes while it waits on decides at once.
    assert wait.over(NOW + timedelta(minutes=3), answered)


def test_only_a_new_impairing_fault_since_the_start_counts_as_faulting_again() -> None:
    started = NOW
    old = finding(finding_id="old", observed_at=started - timedelta(minutes=1))
    known = finding(finding_id="known", observed_at=started + timedelta(seconds=5))
    mild = finding(finding_id="mild", impairs=False, observed_at=started + timedelta(seconds=5))
    transition = finding(finding_id="t", kind="daemon_recovered", observed_at=started + timedelta(seconds=5))
    fresh = finding(finding_id="new", code=48, reason="XID_48", observed_at=started + timedelta(seconds=9))
    quiet = excerpt(recent_findings=[old, known, mild, transition])
    assert new_fault(None, set(), started) is None
    assert new_fault(quiet, {"known"}, started) is None
    assert new_fault(
        quiet.model_copy(update={"recent_findings": [*quiet.recent_findings, fresh]}), {"known"}, started
    ) == (f"XID_48 on GPU {GPU}")


# --- what the Web UI shows ----------------------------------------------------------------------------------------


def record(config: CapacityGroup, found: GpuFinding | None = None) -> RepairRecord:
    made = RepairRecord(
        input=repair_input(found), started_at=NOW, permit_token="t", runbook=repair_runbook.for_group(config)
    )
    made.ladder.choose(made.input, config, NOW)
    made.evidence_step = config.evidence_bucket is not None
    return made


def steps_of(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if re.match(r"\d+\. \[", line)]


def test_the_plain_runbook_marks_each_step_and_the_group_adds_evidence_and_quarantine() -> None:
    plain = record(group(remediation="replace"))
    plain.enter(RepairPhase.DRAINING, NOW)
    plain.notes[RepairPhase.DRAINING] = "abc123"
    assert steps_of(repair_runbook.markdown(plain)) == [
        "1. [done] Acquire a drain permit",
        "2. [**now**] Set the container instance DRAINING — abc123",
        "3. [next] Launch a replacement in the same AZ",
        "4. [next] Wait for the replacement to be ACTIVE",
        "5. [next] Let tasks stop within their stop timeouts",
        "6. [next] Terminate the impaired instance",
    ]
    kept = record(group(remediation="replace", evidence_bucket="evidence-bucket", quarantine=True))
    assert [line.split("] ")[1] for line in steps_of(repair_runbook.markdown(kept))][-2:] == [
        repair_runbook.EVIDENCE_STEP,
        repair_runbook.QUARANTINE_STEP,
    ]


def test_a_finished_repair_shows_its_outcome_and_the_signals_it_dropped() -> None:
    done = record(group(remediation="replace"))
    done.error = "cancelled by an operator"
    done.enter(RepairPhase.CANCELLED, NOW)
    done.rejected, done.forged = 2, 1
    shown = repair_runbook.markdown(done)
    assert done.finished
    assert "Outcome: **Cancelled** — cancelled by an operator" in shown
    assert "2 malformed signals dropped" in shown and "**1 forged permit grants dropped**" in shown
    assert steps_of(shown)[:2] == [
        "1. [**cancelled**] Acquire a drain permit",
        "2. [not done] Set the container instance DRAINING",
    ]
    assert all("[not done]" in line for line in steps_of(shown)[1:])


def test_a_repair_that_failed_while_launching_marks_that_step_failed_and_the_rest_not_done() -> None:
    failed = record(group(remediation="replace"))
    for phase in (RepairPhase.DRAINING, RepairPhase.LAUNCHING_REPLACEMENT, RepairPhase.FAILED):
        failed.enter(phase, NOW)
    assert [line.split("]")[0] for line in steps_of(repair_runbook.markdown(failed))] == [
        "1. [done",
        "2. [done",
        "3. [**failed**",
        "4. [not done",
        "5. [not done",
        "6. [not done",
    ]


def test_a_completed_repair_that_adopted_an_earlier_replacement_shows_every_step_done() -> None:
    adopted = record(group(remediation="replace"))
    for phase in (RepairPhase.DRAINING, RepairPhase.WAITING_FOR_REPLACEMENT, RepairPhase.STOPPING_TASKS):
        adopted.enter(phase, NOW)
    assert "3. [done] Launch a replacement" in repair_runbook.markdown(adopted)
    for phase in (RepairPhase.TERMINATING, RepairPhase.COMPLETED):
        adopted.enter(phase, NOW)
    assert all("[done]" in line for line in steps_of(repair_runbook.markdown(adopted)))


def test_a_reset_that_escalated_to_a_reboot_then_a_replacement_shows_every_rung_in_order() -> None:
    made = record(group(gpu_reset=True), finding("RESET_GPU"))
    for phase in (RepairPhase.DRAINING, RepairPhase.STOPPING_TASKS, RepairPhase.RESETTING_GPU):
        made.enter(phase, NOW)
    made.ladder.escalate(RepairAction.GPU_RESET, RepairAction.REBOOT, "refused")
    for phase in (RepairPhase.REBOOTING, RepairPhase.AWAITING_RECOVERY):
        made.enter(phase, NOW)
    made.ladder.escalate(RepairAction.REBOOT, RepairAction.REPLACE, "not back")
    made.enter(RepairPhase.LAUNCHING_REPLACEMENT, NOW)
    shown = repair_runbook.markdown(made)
    assert "Remediation **reboot-first**: first gpu-reset (NVIDIA: RESET_GPU)" in shown
    assert "- escalated gpu-reset → **reboot**: refused" in shown
    assert "- escalated reboot → **replace**: not back" in shown
    assert steps_of(shown) == [
        "1. [done] Acquire a drain permit",
        "2. [done] Set the container instance DRAINING",
        "3. [done] Let tasks stop within their stop timeouts",
        f"4. [done] Reset GPU {GPU} (nvidia-smi -r through SSM)",
        "5. [done] Reboot the instance (EC2 RebootInstances)",
        "6. [done] Wait for it to come back: GPUs OK, ECS agent connected; then the fix's gate",
        "7. [**now**] Launch a replacement in the same AZ",
        "8. [next] Wait for the replacement to be ACTIVE",
        "9. [next] Stop what is left of the tasks",
        "10. [next] Terminate the impaired instance",
    ]


def test_the_timeline_starts_waiting_for_a_permit() -> None:
    made = record(group())
    assert made.timeline == [PhaseStep(phase=RepairPhase.WAITING_FOR_PERMIT, started_at=NOW)]
    assert made.steps() == [{"phase": "WaitingForPermit", "started_at": "2026-12-05T12:00:00Z"}]
