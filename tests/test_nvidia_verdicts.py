"""NVIDIA's standing verdicts choose a reboot-first repair's remedy, read on the plain models: no server, a fixed clock.

Each row of the decision table (docs/operations.md §13, "NVIDIA's verdict chooses the remedy") is a case here: what
the health workflow keeps of the verdicts it hears (workflows/health_ladder.py) and what the ladder does with them
(workflows/repair_ladder.py). tests/test_remediation_ladder.py runs them on the dev server with the simulated fleet.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from contract.groups import CapacityGroup
from contract.probe import (
    ACTION_DRAIN_AND_RESET,
    ACTION_DRAIN_P2P,
    ACTION_NONE,
    ACTION_REPLACE,
    ACTION_RESET_GPU,
    ACTION_RESTART_BM,
    NVIDIA_VERDICTS,
    GpuFinding,
    GpuRef,
    Heartbeat,
)
from contract.repair import MAX_VERDICTS_KEPT, GpuVerdict, InPlaceFix, RepairAction, RepairInput, RepairProgress
from workflows import health_ladder
from workflows.models import HealthCarry
from workflows.repair_ladder import RUNGS, Ladder, nvidia_says

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
GPU, OTHER_GPU = "0000:53:00", "0000:64:00"


def fault(action: str = ACTION_RESTART_BM, pci: str | None = GPU, reason: str = "XID_79") -> GpuFinding:
    return GpuFinding(
        finding_id="fault",
        instance_id="i-1",
        group="g",
        kind="xid",
        code=79,
        reason=reason,
        impairs=True,
        gpu=GpuRef(pci=pci),
        immediate_action=action,
        observed_at=NOW,
    )


def stated(verdict: str, action: str, gpu: str | None = GPU, at: datetime = NOW, finding_id: str = "v1") -> GpuFinding:
    """A finding stating one of NVIDIA's verdicts, as the probe sends it (a warning under the `ecs` policy)."""
    return GpuFinding(
        finding_id=finding_id,
        instance_id="i-1",
        group="g",
        kind="nvml",
        reason=f"NVML_{verdict.upper()}",
        impairs=False,
        gpu=GpuRef(pci=gpu),
        immediate_action=action,
        verdict=verdict,
        observed_at=at,
    )


def verdict(verdict: str, action: str, gpu: str | None = GPU, at: datetime = NOW) -> GpuVerdict:
    return GpuVerdict(
        verdict=verdict, action=action, gpu=gpu, reason=f"NVML_{verdict.upper()}", finding_id="v", observed_at=at
    )


def reboot_first(**fields: object) -> CapacityGroup:
    return CapacityGroup.model_validate(
        {"name": "g", "cluster": "c", "remediation": "reboot-first", "gpu_reset": True, **fields}
    )


def chosen(found: GpuFinding | None, *verdicts: GpuVerdict, config: CapacityGroup | None = None) -> Ladder:
    ladder = Ladder()
    given = RepairInput(instance_id="i-1", group="g", reason="XID_79", finding=found, nvidia_verdicts=list(verdicts))
    ladder.choose(given, config or reboot_first(), NOW)
    return ladder


# --- the decision table ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("catalog", "verdicts", "first", "nvidia"),
    [
        # No verdict: the Xid catalog's action for the fault, as before.
        (ACTION_RESTART_BM, [], RepairAction.REBOOT, ACTION_RESTART_BM),
        (ACTION_RESET_GPU, [], RepairAction.GPU_RESET, ACTION_RESET_GPU),
        # The recovery action overrides the Xids around it, asking less...
        (ACTION_RESTART_BM, [verdict("recovery_action", ACTION_RESET_GPU)], RepairAction.GPU_RESET, ACTION_RESET_GPU),
        # ... or more.
        (ACTION_RESET_GPU, [verdict("recovery_action", ACTION_RESTART_BM)], RepairAction.REBOOT, ACTION_RESTART_BM),
        # Drain and reset, and drain P2P: the rung drains before every reset.
        (
            ACTION_RESTART_BM,
            [verdict("recovery_action", ACTION_DRAIN_AND_RESET)],
            RepairAction.GPU_RESET,
            ACTION_DRAIN_AND_RESET,
        ),
        (ACTION_RESET_GPU, [verdict("recovery_action", ACTION_DRAIN_P2P)], RepairAction.GPU_RESET, ACTION_DRAIN_P2P),
        # A recovery action we take no step for (Recover IMEX Domain): the catalog's action stands.
        (ACTION_RESTART_BM, [verdict("recovery_action", "")], RepairAction.REBOOT, ACTION_RESTART_BM),
        # A repair pending asks for a reset: a reboot gives it too, so it never lowers the catalog's reboot...
        (ACTION_RESTART_BM, [verdict("channel_repair_pending", ACTION_RESET_GPU)], RepairAction.REBOOT, "RESTART_BM"),
        # ... and a recovery action on another GPU says nothing of this fault.
        (
            ACTION_RESTART_BM,
            [verdict("recovery_action", ACTION_RESET_GPU, gpu=OTHER_GPU)],
            RepairAction.REBOOT,
            ACTION_RESTART_BM,
        ),
    ],
    ids=[
        "catalog-reboot",
        "catalog-reset",
        "recovery-asks-less",
        "recovery-asks-more",
        "drain-and-reset",
        "drain-p2p",
        "recovery-not-ours",
        "pending-never-lowers",
        "recovery-other-gpu",
    ],
)
def test_nvidia_s_verdict_chooses_the_rung(
    catalog: str, verdicts: list[GpuVerdict], first: RepairAction, nvidia: str
) -> None:
    ladder = chosen(fault(catalog), *verdicts)
    assert (ladder.first, ladder.nvidia_action, ladder.escalations) == (first, nvidia, [])


@pytest.mark.parametrize("name", ["unrepairable_memory", "sram_threshold_exceeded", "row_remap_failure"])
@pytest.mark.parametrize("on", [GPU, OTHER_GPU], ids=["its-gpu", "another-gpu"])
def test_memory_nvidia_says_cannot_be_repaired_in_place_replaces_at_once(name: str, on: str) -> None:
    ladder = chosen(fault(ACTION_RESET_GPU), verdict("recovery_action", ACTION_RESET_GPU), verdict(name, "REPLACE", on))
    assert ladder.first is ladder.action is RepairAction.REPLACE
    why = (
        f"XID_79: NVIDIA's immediate action is REPLACE (NVIDIA's {name} (NVML_{name.upper()}) on GPU {on}), "
        "not a GPU reset or a reboot"
    )
    assert ladder.escalations == [(RepairAction.REBOOT, RepairAction.REPLACE, why)]


def test_a_reset_the_group_does_not_allow_or_that_names_no_gpu_is_a_reboot() -> None:
    reset = verdict("recovery_action", ACTION_DRAIN_AND_RESET, gpu=None)
    assert chosen(fault(), reset, config=reboot_first(gpu_reset=False)).first is RepairAction.REBOOT
    assert chosen(fault(pci=None), reset).first is RepairAction.REBOOT


def test_the_runbook_says_which_verdict_chose() -> None:
    says = nvidia_says(fault(), [verdict("recovery_action", ACTION_RESET_GPU)])
    assert says.action == ACTION_RESET_GPU
    assert says.why == f"NVIDIA's recovery action RESET_GPU (NVML_RECOVERY_ACTION) on GPU {GPU}"
    assert nvidia_says(fault(), []).why == ""  # the fault's own action: nothing more to say


def test_the_newest_recovery_action_wins() -> None:
    older = verdict("recovery_action", ACTION_RESTART_BM, at=NOW - timedelta(minutes=5))
    newer = verdict("recovery_action", ACTION_RESET_GPU, gpu=None)
    assert nvidia_says(fault(), [newer, older]).action == ACTION_RESET_GPU


def test_a_replace_group_and_a_fault_without_a_finding_are_unchanged_by_verdicts() -> None:
    replace = CapacityGroup(name="g", cluster="c")
    ladder = chosen(fault(), verdict("recovery_action", ACTION_RESET_GPU), config=replace)
    assert (ladder.first, ladder.nvidia_action) == (RepairAction.REPLACE, "")
    assert chosen(None, verdict("recovery_action", ACTION_RESET_GPU)).first is RepairAction.REPLACE


def test_every_action_the_table_names_is_contract_s() -> None:
    assert set(RUNGS) <= {ACTION_RESET_GPU, ACTION_DRAIN_AND_RESET, ACTION_DRAIN_P2P, "RESTART_VM", ACTION_RESTART_BM}
    assert ACTION_REPLACE not in RUNGS and ACTION_NONE not in RUNGS


# --- what the health workflow keeps -------------------------------------------------------------------------------


def test_a_verdict_is_kept_per_gpu_and_verdict_the_newest_in_place_of_the_older() -> None:
    state = HealthCarry()
    assert health_ladder.note_verdict(state, stated("recovery_action", ACTION_RESTART_BM))
    assert health_ladder.note_verdict(state, stated("recovery_action", ACTION_RESET_GPU, at=NOW + timedelta(1)))
    assert health_ladder.note_verdict(state, stated("recovery_action", ACTION_RESTART_BM, gpu=OTHER_GPU))
    assert health_ladder.note_verdict(state, stated("unrepairable_memory", ACTION_REPLACE))
    held = {(v.gpu, v.verdict): v.action for v in state.nvidia_verdicts}
    assert held == {
        (GPU, "recovery_action"): ACTION_RESET_GPU,
        (OTHER_GPU, "recovery_action"): ACTION_RESTART_BM,
        (GPU, "unrepairable_memory"): ACTION_REPLACE,
    }


def test_none_withdraws_a_verdict_and_a_late_older_one_changes_nothing() -> None:
    state = HealthCarry()
    health_ladder.note_verdict(state, stated("recovery_action", ACTION_RESET_GPU, at=NOW))
    assert health_ladder.note_verdict(state, stated("recovery_action", ACTION_NONE, at=NOW + timedelta(seconds=5)))
    assert state.nvidia_verdicts == []
    health_ladder.note_verdict(state, stated("recovery_action", ACTION_RESTART_BM, at=NOW + timedelta(seconds=9)))
    late = stated("recovery_action", ACTION_NONE, at=NOW + timedelta(seconds=1))  # spooled, delivered last
    assert not health_ladder.note_verdict(state, late)
    assert [v.action for v in state.nvidia_verdicts] == [ACTION_RESTART_BM]


@pytest.mark.parametrize("name", ["", "a_verdict_from_a_newer_probe"])
def test_a_finding_that_states_no_verdict_we_know_is_not_one(name: str) -> None:
    state = HealthCarry()
    assert not health_ladder.note_verdict(state, stated(name, ACTION_RESET_GPU))
    assert state.nvidia_verdicts == []


def test_the_verdicts_kept_are_bounded_and_what_is_let_go_is_counted() -> None:
    state = HealthCarry()
    for n in range(MAX_VERDICTS_KEPT + 5):
        health_ladder.note_verdict(state, stated("recovery_action", ACTION_RESET_GPU, gpu=f"0000:{n:02x}:00"))
    assert len(state.nvidia_verdicts) == MAX_VERDICTS_KEPT
    assert state.nvidia_verdicts[-1].gpu == f"0000:{MAX_VERDICTS_KEPT + 4:02x}:00"
    assert state.dropped_entries == 5
    assert set(NVIDIA_VERDICTS) >= {v.verdict for v in state.nvidia_verdicts}


def test_a_fix_in_place_withdraws_what_asked_for_it_and_keeps_what_asks_for_a_replacement() -> None:
    state = HealthCarry()
    health_ladder.note_verdict(state, stated("recovery_action", ACTION_RESET_GPU))
    health_ladder.note_verdict(state, stated("channel_repair_pending", ACTION_RESET_GPU))
    health_ladder.note_verdict(state, stated("unrepairable_memory", ACTION_REPLACE, gpu=OTHER_GPU))
    fix = InPlaceFix(workflow_id="repair/i-1/1", action=RepairAction.GPU_RESET, gpu=GPU, fixed_at=NOW)
    progress = RepairProgress.model_validate(
        {"workflow_id": "repair/i-1/1", "phase": "Completed", "in_place_fix": fix.model_dump()}
    )
    assert health_ladder.fixed_in_place(state, progress, NOW)
    assert [(v.gpu, v.verdict) for v in state.nvidia_verdicts] == [(OTHER_GPU, "unrepairable_memory")]


# --- a verdict stated after the repair began ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("catalog", "now_held", "change"),
    [
        # Xid 154 follows the Xid it is about: the repair may have started between them.
        (
            ACTION_RESET_GPU,
            [verdict("recovery_action", ACTION_RESTART_BM)],
            (RepairAction.GPU_RESET, RepairAction.REBOOT, "XID_79: NVIDIA now asks for RESTART_BM"),
        ),
        (
            ACTION_RESTART_BM,
            [verdict("unrepairable_memory", ACTION_REPLACE, gpu=OTHER_GPU)],
            (RepairAction.REBOOT, RepairAction.REPLACE, "XID_79: NVIDIA now asks for REPLACE"),
        ),
        # Never less than the rung chosen: a reboot resets every GPU.
        (ACTION_RESTART_BM, [verdict("recovery_action", ACTION_RESET_GPU)], None),
        (ACTION_RESET_GPU, [verdict("recovery_action", ACTION_DRAIN_AND_RESET)], None),
        (ACTION_RESET_GPU, [], None),
    ],
    ids=["reset-becomes-reboot", "reboot-becomes-replace", "never-less", "same-rung", "nothing-new"],
)
def test_right_before_the_gpu_is_touched_a_newer_verdict_may_only_escalate(
    catalog: str, now_held: list[GpuVerdict], change: tuple[RepairAction, RepairAction, str] | None
) -> None:
    found = fault(catalog)
    ladder = chosen(found)
    asked = ladder.reconsider(found, now_held, reboot_first())
    if change is None:
        assert asked is None
    else:
        assert asked is not None and asked[:2] == change[:2] and asked[2].startswith(change[2])


def test_a_reset_asked_of_a_group_that_resets_nothing_is_the_reboot_it_already_takes() -> None:
    config = reboot_first(gpu_reset=False)
    found = fault(ACTION_RESET_GPU)
    ladder = chosen(found, config=config)
    assert ladder.first is RepairAction.REBOOT
    assert ladder.reconsider(found, [verdict("recovery_action", ACTION_DRAIN_AND_RESET)], config) is None
    # A repair without a finding (a heartbeat loss) replaces at once: nothing to reconsider.
    assert ladder.reconsider(None, [verdict("unrepairable_memory", ACTION_REPLACE)], config) is None


def test_a_new_boot_withdraws_every_verdict_for_the_probe_to_state_again() -> None:
    state = HealthCarry(boot_id="boot-1")
    health_ladder.note_verdict(state, stated("recovery_action", ACTION_RESTART_BM))
    health_ladder.note_verdict(state, stated("unrepairable_memory", ACTION_REPLACE))
    beat = Heartbeat(instance_id="i-1", group="g", sent_at=NOW, boot_id="boot-1")
    health_ladder.heard(state, beat)
    assert len(state.nvidia_verdicts) == 2  # the same boot: nothing changed
    health_ladder.heard(state, beat.model_copy(update={"boot_id": "boot-2"}))
    assert state.nvidia_verdicts == [] and state.boot_id == "boot-2"
