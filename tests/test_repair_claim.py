"""The run loop's claim on an instance's impairment (HealthCarry.repair_claim), on the plain model with a fake clock:
taken for repair, withheld (the group DISABLED, or excluded) and why, released; each transition is a row here. Carried
state from runs before the claim (two flags) decodes to it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter

from contract.groups import AutoRepair
from contract.health import CheckType, HealthState
from contract.instances import Exclusion
from contract.probe import KIND_DAEMON, KIND_DAEMON_RECOVERED
from contract.repair import InPlaceFix, RepairAction, RepairPhase
from tests.test_instance_health import (
    GROUP,
    INSTANCE,
    START,
    FakeHost,
    finding,
    healthy,
    progress,
    repairing,
    signal,
    status,
)
from workflows.instance_health import InstanceHealth
from workflows.models import ClaimKind, HealthCarry, HealthRun, RepairClaim, RepairDecision, RepairStance


def fresh() -> tuple[InstanceHealth, FakeHost]:
    host = FakeHost()
    return InstanceHealth(INSTANCE, GROUP, None, host), host


RMA = Exclusion(by="ana", reason="RMA", since=START)
DAEMON_DOWN = {"kind": KIND_DAEMON, "reason": "DAEMON_a", "code": None}


def impaired_by_daemon(health: InstanceHealth) -> None:
    signal(health, health.on_finding, finding("d1", **DAEMON_DOWN))


def taken(health: InstanceHealth) -> None:
    impaired_by_daemon(health)
    health.take_for_repair()


def healthy_and_taken(health: InstanceHealth) -> None:
    healthy(health)
    health.take_for_repair()


def withheld_by_disabled(health: InstanceHealth) -> None:
    taken(health)
    health.withhold_unless_allowed(AutoRepair.DISABLED)


def withheld_by_exclusion(health: InstanceHealth) -> None:
    taken(health)
    health.state.excluded = RMA
    health.withhold_unless_allowed(AutoRepair.ENABLED)


def taken_and_excluded(health: InstanceHealth) -> None:
    taken(health)
    health.on_exclude(RMA, took_back=False)  # a repair past its permit is left to finish


def taken_and_asked(health: InstanceHealth) -> None:
    taken(health)
    health.state.operator_repair = "operator ana: flaky NVLink"


def back_to_healthy(health: InstanceHealth) -> None:
    signal(health, health.on_finding, finding("d2", **{**DAEMON_DOWN, "kind": KIND_DAEMON_RECOVERED, "impairs": False}))


def fixed_in_place(health: InstanceHealth) -> None:
    fix = InPlaceFix(workflow_id="repair/i-0abc/1", action=RepairAction.REBOOT, fixed_at=START)
    repairing(health).on_repair_progress(progress(RepairPhase.COMPLETED, finished=True, in_place_fix=fix))


def take(health: InstanceHealth) -> None:
    health.take_for_repair()


def in_enabled_group(health: InstanceHealth) -> None:
    health.withhold_unless_allowed(AutoRepair.ENABLED)


def in_disabled_group(health: InstanceHealth) -> None:
    health.withhold_unless_allowed(AutoRepair.DISABLED)


def exclude(health: InstanceHealth) -> None:
    health.on_exclude(RMA, took_back=False)


def exclude_taking_back(health: InstanceHealth) -> None:
    health.on_exclude(RMA, took_back=True)  # its repair was withdrawn from the drain queue


def include(health: InstanceHealth) -> None:
    health.on_include()


def clear(health: InstanceHealth) -> None:
    health.on_clear("ana", "false alarm", repair_running=False)


def clear_while_repairing(health: InstanceHealth) -> None:
    health.on_clear("ana", "false alarm", repair_running=True)


def discarded(health: InstanceHealth) -> None:
    health.prove_again("held repair discarded")


def operator_repair(health: InstanceHealth) -> None:
    health.on_repair_asked("operator ana: now")


def release(health: InstanceHealth) -> None:
    health.release_claim()  # a start that failed, a failed repair counted, the group ENABLED again (health.py)


DISABLED_WHY = "auto repair DISABLED for group g at 2026-12-05T12:01:00Z"
RMA_WHY = "excluded by ana: RMA"
TAKEN, WITHHELD = ClaimKind.TAKEN, ClaimKind.WITHHELD
Act = Callable[[InstanceHealth], None]

# One row per transition: the state it starts from, what happens a minute later, and the claim after it (its kind,
# its why, and whether this step set it: its `since` is then the step's time, else the earlier one's).
CLAIM_TRANSITIONS: list[tuple[str, Act, Act, ClaimKind | None, str, bool]] = [
    ("taken", impaired_by_daemon, take, TAKEN, "", True),
    ("allowed-in-an-enabled-group", taken, in_enabled_group, TAKEN, "", False),
    ("withheld-by-disabled", taken, in_disabled_group, WITHHELD, DISABLED_WHY, True),
    ("an-operator-repair-runs-in-a-disabled-group", taken_and_asked, in_disabled_group, TAKEN, "", False),
    ("withheld-by-exclusion", taken_and_excluded, in_enabled_group, WITHHELD, RMA_WHY, True),
    ("exclude-withholds-one-withheld-by-disabled", withheld_by_disabled, exclude, WITHHELD, RMA_WHY, True),
    ("exclude-withholds-a-repair-taken-back", taken, exclude_taking_back, WITHHELD, RMA_WHY, True),
    ("exclude-leaves-a-running-repair-taken", taken, exclude, TAKEN, "", False),
    ("exclude-releases-a-healthy-one-taken-back", healthy_and_taken, exclude_taking_back, None, "", True),
    ("released-on-healthy", withheld_by_disabled, back_to_healthy, None, "", True),
    ("a-running-repair-stays-taken-on-healthy", taken, back_to_healthy, TAKEN, "", False),
    ("released-by-include", withheld_by_exclusion, include, None, "", True),
    ("include-leaves-a-running-repair-taken", taken_and_excluded, include, TAKEN, "", False),
    ("released-by-clear", withheld_by_disabled, clear, None, "", True),
    ("clear-leaves-a-running-repair-taken", taken, clear_while_repairing, TAKEN, "", False),
    ("released-by-prove-again", withheld_by_disabled, discarded, None, "", True),
    ("released-by-an-operator-repair", withheld_by_disabled, operator_repair, None, "", True),
    ("released-by-a-fix-in-place", taken, fixed_in_place, None, "", True),
    ("released", withheld_by_disabled, release, None, "", True),
]


@pytest.mark.parametrize(
    ("given", "step", "kind", "why", "set_now"),
    [row[1:] for row in CLAIM_TRANSITIONS],
    ids=[row[0] for row in CLAIM_TRANSITIONS],
)
def test_each_transition_of_the_repair_claim(
    given: Act, step: Act, kind: ClaimKind | None, why: str, set_now: bool
) -> None:
    health, host = fresh()
    given(health)
    before = health.state.repair_claim
    host.tick(60)
    step(health)
    claim = health.state.repair_claim
    if kind is None:
        assert claim is None
        return
    assert claim is not None and (claim.kind, claim.why) == (kind, why)
    if set_now:
        assert claim.since == host.now()
    else:
        assert before is not None and claim.since == before.since
    # While claimed, no other start is due; the view shows the claim, and why when withheld.
    assert not health.repair_due()
    assert health.withheld_why == (why if kind is ClaimKind.WITHHELD else None)
    view = health.view()
    assert (view.repair_claim, view.repair_withheld) == (claim, health.withheld_why)


def test_a_withheld_repair_says_why_and_since_when() -> None:
    health, host = fresh()
    impaired_by_daemon(health)
    assert health.repair_due()
    host.tick(60)
    health.take_for_repair()
    assert health.repair_decision() == RepairDecision(stance=RepairStance.STARTING, why="DAEMON_a", since=host.now())
    assert not health.withhold_unless_allowed(AutoRepair.DISABLED)
    assert "instance impaired; auto repair DISABLED for group g, monitoring only" in host.log.lines
    made = health.repair_decision()
    assert made == RepairDecision(stance=RepairStance.WITHHELD, why=DISABLED_WHY, since=START + timedelta(seconds=60))
    assert health.withheld_for_group and health.wake_in(host.now()) is None
    assert f"Not repaired: {DISABLED_WHY}" in health.details_markdown()
    # Excluded, it waits for `include`, not for the group's switch.
    health.on_exclude(RMA, took_back=False)
    assert health.withheld_why == RMA_WHY and not health.withheld_for_group
    assert health.repair_decision().stance is RepairStance.EXCLUDED and health.repair_decision().since == START
    assert health.on_include() and health.repair_due()


def test_exclude_drops_a_repair_an_operator_asked_and_that_ask_releases_the_claim() -> None:
    health, _ = fresh()
    withheld_by_disabled(health)
    health.state.repair_retry.exhausted = True
    health.on_repair_asked("operator ana: flaky NVLink")
    assert health.state.repair_claim is None and not health.state.repair_retry.exhausted and health.repair_due()
    assert health.on_exclude(RMA, took_back=False) == "operator ana: flaky NVLink"
    assert health.state.operator_repair is None and health.state.excluded == RMA


def test_clear_puts_the_checks_back_and_counts_failures_afresh_unless_a_repair_runs() -> None:
    health, _ = fresh()
    withheld_by_disabled(health)
    health.state.repair_retry.failed = 2
    [cleared] = health.on_clear("ana", "false alarm", repair_running=False)
    assert (cleared.finding_id, cleared.cleared_by, cleared.reason) == ("d1", "ana", "false alarm")
    assert status(health, CheckType.DAEMON) == (HealthState.OK, None)
    assert health.state.repair_retry.failed == 0 and health.state.repair_claim is None


# --- carried state from runs before the claim ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "claim"),
    [
        ({}, None),
        ({"repair_requested": False}, None),
        ({"repair_requested": False, "repair_withheld": None}, None),
        ({"repair_requested": True}, RepairClaim(kind=ClaimKind.TAKEN)),
        (
            {"repair_requested": True, "repair_withheld": "auto repair DISABLED for group g at T"},
            RepairClaim(kind=ClaimKind.WITHHELD, why="auto repair DISABLED for group g at T"),
        ),
        ({"repair_requested": True, "repair_withheld": RMA_WHY}, RepairClaim(kind=ClaimKind.WITHHELD, why=RMA_WHY)),
    ],
    ids=["none", "not-requested", "neither", "requested", "withheld-disabled", "withheld-excluded"],
)
def test_a_carry_with_the_old_flags_decodes_to_its_claim(flags: dict[str, object], claim: RepairClaim | None) -> None:
    old = {**HealthCarry(operator_repair="operator ana: x").model_dump(mode="json", exclude={"repair_claim"}), **flags}
    # As a run that continued-as-new before the claim hands it over: its input, through the workers' converter.
    [payload] = pydantic_data_converter.payload_converter.to_payloads(
        [{"instance_id": INSTANCE, "group": GROUP, "carry": old}]
    )
    [run] = pydantic_data_converter.payload_converter.from_payloads([payload], [HealthRun])
    assert isinstance(run, HealthRun) and run.carry is not None
    assert run.carry.repair_claim == claim and run.carry.operator_repair == "operator ana: x"
    assert "repair_requested" not in run.carry.model_dump() and "repair_withheld" not in run.carry.model_dump()


def test_a_carry_with_the_claim_round_trips_and_the_claim_wins_over_stale_flags() -> None:
    health, _ = fresh()
    withheld_by_disabled(health)
    carried = health.state.model_dump(mode="json")
    assert HealthCarry.model_validate(carried) == health.state
    stale = {**carried, "repair_requested": False, "repair_withheld": None}
    assert HealthCarry.model_validate(stale).repair_claim == health.state.repair_claim
