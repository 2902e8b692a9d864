"""The demo's judge on constructed snapshots and events: a replacement a repair abandoned (terminated by the repair,
named by a ReplacementAbandoned event) is expected, never "repaired without a fault"; anything else terminated without
a fault still fails the run."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from contract import event_types as ev
from contract.events import Event
from contract.groups import AutoRepair
from contract.health import HealthState
from contract.repair import RepairAction
from simulator.demo_judge import ABANDONED_EVENT_GRACE_S, Judge
from simulator.demo_summary import EventLog
from simulator.fleet import FleetSnapshot

INITIAL = [f"i-{n:017x}" for n in range(1, 7)]  # six instances; the first two faulted
FAULTED = set(INITIAL[:2])
KEPT = [f"i-{n:017x}" for n in range(101, 103)]  # the two replacements that serve on
ABANDONED = "i-" + "a" * 17  # launched for the first repair, not ACTIVE in time, terminated by it


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def snapshot(*, terminated: list[str], running: list[str], impaired: tuple[str, ...] = ()) -> FleetSnapshot:
    return FleetSnapshot(
        taken_at=datetime.now(UTC),
        ec2_states={"running": len(running), "terminated": len(terminated)},
        container_active=len(running),
        container_draining=0,
        running_tasks=len(running),
        health={i: HealthState.IMPAIRED if i in impaired else HealthState.OK for i in running},
        repair_phase={},
        retired=[],
        initial_instances=INITIAL,
        replacements_running=[i for i in running if i not in INITIAL],
        terminated=terminated,
        booting=[],
        probe_errors={},
    )


def judge(clock: Clock | None = None) -> Judge:
    return Judge(
        instances=len(INITIAL),
        auto_repair=AutoRepair.ENABLED,
        targets=set(FAULTED),
        blipped={INITIAL[5]},
        group="gpu-a",
        clock=clock or Clock(),
    )


HEALED = snapshot(terminated=[*sorted(FAULTED), ABANDONED], running=[*INITIAL[2:], *KEPT])
COMPLETED = Counter({"RepairStarted": 2, "RepairCompleted": 2, "ReplacementAbandoned": 1})


def test_a_replacement_the_repair_abandoned_is_not_a_repair_without_a_fault() -> None:
    outcome = judge().judge(HEALED, COMPLETED, set(), {ABANDONED})
    assert outcome.done and not outcome.failed, outcome
    assert outcome.message == "all 2 impaired instances replaced; 6/6 instances healthy"


def test_the_abandoned_replacement_is_read_from_the_events_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    now = datetime(2026, 12, 5, 6, 0, tzinfo=UTC)

    def completed(replacement: str) -> ev.RepairCompleted:
        return ev.RepairCompleted(
            replacement_instance_id=replacement, reason="XID_79", action=RepairAction.REPLACE, timeline=[]
        )

    abandoned = ev.ReplacementAbandoned(
        attempt=1, replacement_instance_id=ABANDONED, why="not ACTIVE in ECS within 15s", error="", attempts_left=1
    )
    events = [
        (INITIAL[0], ev.RepairStarted(reason="XID_79")),
        (INITIAL[0], ev.ReplacementLaunched(replacement_instance_id=ABANDONED, attempt=1)),
        (INITIAL[0], abandoned),
        (INITIAL[0], ev.ReplacementLaunched(replacement_instance_id=KEPT[0], attempt=2)),
        (INITIAL[0], completed(KEPT[0])),
        (INITIAL[1], ev.RepairStarted(reason="XID_79")),
        (INITIAL[1], completed(KEPT[1])),
    ]
    path.write_text(
        "".join(
            json.dumps(Event.of(d, event_id=f"e{n}", time=now, group="g", instance_id=i, workflow_id="w").line()) + "\n"
            for n, (i, d) in enumerate(events)
        )
    )
    log = EventLog(path)
    log.read_new()
    assert log.abandoned_replacements == {ABANDONED}
    assert log.counts["RepairCompleted"] == 2
    outcome = judge().judge(HEALED, log.counts, log.fixed_in_place, log.abandoned_replacements)
    assert outcome.done, outcome


def test_an_initial_instance_terminated_without_a_fault_fails_at_once_even_if_abandoned_ids_are_known() -> None:
    healthy_one = INITIAL[2]
    snap = snapshot(
        terminated=[*sorted(FAULTED), ABANDONED, healthy_one], running=[*INITIAL[3:], *KEPT, "i-" + "b" * 17]
    )
    outcome = judge().judge(snap, COMPLETED, set(), {ABANDONED})
    assert outcome.failed and not outcome.done
    assert outcome.message == f"repaired instances that had no fault: {healthy_one}"
    assert ABANDONED not in outcome.message


def test_a_blipped_instance_terminated_still_fails_and_is_named_a_blip() -> None:
    blipped = INITIAL[5]
    snap = snapshot(terminated=[*sorted(FAULTED), blipped], running=[*INITIAL[2:5], *KEPT, "i-" + "b" * 17])
    outcome = judge().judge(snap, COMPLETED, set(), {ABANDONED})
    assert outcome.failed and outcome.message == f"repaired instances that had no fault: {blipped} (blip)"


def test_a_terminated_replacement_waits_for_its_abandoned_event_then_is_expected() -> None:
    # The repair terminates the replacement before it publishes ReplacementAbandoned: for a moment the snapshot has
    # it terminated and the events do not explain it yet. Neither done nor failed then.
    clock = Clock()
    j = judge(clock)
    early = Counter({"RepairStarted": 2, "RepairCompleted": 1})
    outcome = j.judge(HEALED, early, set(), set())
    assert not outcome.done and not outcome.failed, outcome
    clock.now += ABANDONED_EVENT_GRACE_S / 2
    outcome = j.judge(HEALED, early, set(), set())
    assert not outcome.done and not outcome.failed, outcome
    # Even with every repair completed, not done while a termination is unexplained.
    outcome = j.judge(HEALED, COMPLETED, set(), set())
    assert not outcome.done and not outcome.failed, outcome
    # The event arrives: the run is done.
    clock.now += 1
    outcome = j.judge(HEALED, COMPLETED, set(), {ABANDONED})
    assert outcome.done, outcome


def test_a_terminated_replacement_no_event_explains_fails_after_the_grace() -> None:
    clock = Clock()
    j = judge(clock)
    assert not j.judge(HEALED, COMPLETED, set(), set()).failed
    clock.now += ABANDONED_EVENT_GRACE_S
    outcome = j.judge(HEALED, COMPLETED, set(), set())
    assert outcome.failed and not outcome.done
    assert outcome.message == (
        f"repaired instances that had no fault: {ABANDONED} (a replacement, no ReplacementAbandoned event names it)"
    )


def test_the_breaker_held_counts_replaced_instances_not_abandoned_replacements() -> None:
    # One faulted instance replaced (its first replacement abandoned) before the breaker tripped, the other held.
    snap = snapshot(terminated=[INITIAL[0], ABANDONED], running=[*INITIAL[1:], KEPT[0]], impaired=(INITIAL[1],))
    events = Counter({"RepairStarted": 1, "RepairCompleted": 1, "ReplacementAbandoned": 1, "RepairsHeld": 1})
    outcome = judge().judge(snap, events, set(), {ABANDONED})
    assert outcome.done and not outcome.failed, outcome
    assert "2 instances impaired at once, 1 replaced before it tripped, 1 held" in outcome.message


def test_disabled_still_fails_on_any_termination() -> None:
    j = Judge(instances=len(INITIAL), auto_repair=AutoRepair.DISABLED, targets=set(FAULTED), blipped=set())
    snap = snapshot(terminated=[ABANDONED], running=INITIAL)
    outcome = j.judge(snap, Counter(), set(), {ABANDONED})
    assert outcome.failed and "DISABLED" in outcome.message
