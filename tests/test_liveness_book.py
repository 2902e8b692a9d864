"""The liveness tracker's decisions on the plain model (LivenessBook), with a fixed clock: who is lost when, a silent
pipeline, a late timer, game days, rechecks, a new threshold, bounds. The workflow tests (test_liveness*.py) keep what
only a server shows: batches on the wire, the one timer, EC2's answer, the health workflows told."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from activities.models import GoneCause, GoneInstance
from contract.formats import iso
from contract.groups import CapacityGroup
from contract.liveness import MAX_INSTANCES_PER_SHARD, IgnoreHeartbeats, LivenessReport, RecheckLoss
from tests.test_instance_health import FakeLog
from workflows.liveness_book import FORGET_LOST_AFTER, LivenessBook
from workflows.models import LivenessCarry

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
THRESHOLD = timedelta(seconds=60)
GRACE = timedelta(seconds=15)  # a quarter of the threshold, at most 15 s
EVERY = timedelta(seconds=5)


def book() -> LivenessBook:
    made = LivenessBook("g", 0, 1, None, FakeLog())
    made.state.group = CapacityGroup(name="g", cluster="c", heartbeat_loss_threshold=THRESHOLD)
    return made


def report(at: datetime, heard: dict[str, int], reporter: str = "ingest-1") -> LivenessReport:
    return LivenessReport(group="g", reporter=reporter, at=at, report_every=EVERY, heard=heard)


def test_an_instance_silent_past_its_window_and_grace_is_lost_once() -> None:
    tracker = book()
    tracker.on_report(report(NOW, {"i-1": 0, "i-2": 0}), NOW)
    assert tracker.next_check() is None  # the relay promised a batch before the deadline: no timer
    # The relay keeps its promise, every 5 s; only i-2 is in its batches.
    at = NOW
    while at < NOW + THRESHOLD + GRACE:
        at += EVERY
        tracker.on_report(report(at, {"i-2": 0}), at)
        assert tracker.declare_losses(at) == ([] if at < NOW + THRESHOLD + GRACE else ["i-1"])
    assert tracker.declare_losses(at + timedelta(seconds=1)) == []  # told once
    tracker.told_lost(["i-1"], {})
    [change] = tracker.outbox
    assert (change.instance_id, change.lost, change.last_heard, change.for_good) == ("i-1", True, NOW, True)
    assert tracker.view().lost == ["i-1"] and tracker.view().declared_lost == 1


def test_a_declaration_says_who_was_lost_when_last_heard_and_when_the_last_batch_came() -> None:
    log = FakeLog()
    tracker = LivenessBook("g", 0, 1, None, log)
    tracker.state.group = CapacityGroup(name="g", cluster="c", heartbeat_loss_threshold=THRESHOLD)
    silent = [f"i-{n}" for n in range(7)]
    tracker.on_report(report(NOW, dict.fromkeys(silent, 0)), NOW)
    later = NOW
    while later < NOW + THRESHOLD + GRACE:
        later += EVERY
        tracker.on_report(report(later, {"i-alive": 0}), later)
    assert tracker.declare_losses(later) == silent
    [line] = [line for line in log.lines if " lost " in line]
    assert line == (
        "liveness of g: 7 lost (i-0, i-1, i-2, i-3, i-4, ...), last heard 2026-12-05T12:00:00Z..2026-12-05T12:00:00Z;"
        " the last batch came at 2026-12-05T12:01:15Z"
    )
    assert tracker.declare_losses(later + EVERY) == [] and len(log.lines) == 1  # nothing new, nothing said


def test_a_lost_instance_heard_again_is_told_so() -> None:
    tracker = book()
    # A probe signalling directly (a trusted lab): its silence is its own, no pipeline to wait for.
    probe = report(NOW, {"i-1": 0}, reporter="probe").model_copy(update={"relay": False})
    tracker.on_report(probe, NOW)
    later = NOW + THRESHOLD + GRACE
    assert tracker.declare_losses(later) == ["i-1"]
    tracker.on_report(probe.model_copy(update={"at": later}), later)
    [change] = tracker.outbox
    assert (change.instance_id, change.lost, change.last_heard) == ("i-1", False, later)
    assert "i-1" not in tracker.lost and tracker.state.recovered == 1


def test_a_silent_pipeline_is_not_silent_hosts() -> None:
    tracker = book()
    tracker.on_report(report(NOW, {"i-1": 0}), NOW)
    later = NOW + THRESHOLD + GRACE
    assert tracker.pipeline_silent(later)
    assert tracker.declare_losses(later) == [] and tracker.state.silent_since == NOW
    # Batches come again: nothing is declared for a full window from then.
    back = later + timedelta(minutes=5)
    tracker.on_report(report(back, {"i-2": 0}), back)
    assert tracker.state.silent_since is None and tracker.state.floor == back + THRESHOLD + GRACE and tracker.wake
    assert tracker.declare_losses(back + THRESHOLD) == []
    assert (tracker.state.last_silence_from, tracker.state.last_silence_to) == (NOW, back)


def test_a_timer_that_fires_late_declares_nothing_for_a_window() -> None:
    tracker = book()
    tracker.on_report(report(NOW, {"i-1": 0}, reporter="probe").model_copy(update={"relay": False}), NOW)
    tracker.armed_for = tracker.next_check()
    assert tracker.armed_for == NOW + THRESHOLD + GRACE
    late = tracker.armed_for + timedelta(minutes=10)
    assert tracker.timer_fired(late, armed_at=NOW) == []
    assert tracker.state.floor == late + THRESHOLD + GRACE
    tracker.armed_for = tracker.next_check()  # as the workflow's loop sets its timer again
    assert tracker.armed_for == tracker.state.floor
    assert tracker.timer_fired(tracker.state.floor, armed_at=late) == ["i-1"]


def took_over_from(
    last_batch: datetime, log: FakeLog, heard: dict[str, int] | None = None
) -> tuple[LivenessBook, LivenessReport]:
    """A run that continued one whose last batch, from a probe reporting for itself, came at `last_batch` with
    `heard` (i-1 and i-2 just heard, unless given)."""
    before = book()
    probe = report(last_batch, heard or {"i-1": 0, "i-2": 0}, reporter="probe").model_copy(update={"relay": False})
    before.on_report(probe, last_batch)
    return LivenessBook("g", 0, 1, before.carried(), log), probe


def test_a_run_that_took_over_waits_one_interval_for_the_batches_refused_while_it_did() -> None:
    """While the previous run closed, Temporal refused the probes' batches ("workflow is closing"): the new run
    must not declare the instances whose retried batches are on their way. A quick hand-over (the last batch came
    within an interval of it) waits one interval; a floor already later is kept."""
    took_over = NOW + EVERY
    # i-2 was last heard long before the last batch: its deadline passed during the hand-over.
    tracker, _ = took_over_from(NOW, FakeLog(), heard={"i-1": 0, "i-2": 100})
    assert not tracker.handed_over_slowly(took_over)
    tracker.resumed(took_over)
    assert tracker.state.floor == took_over + EVERY + GRACE
    assert tracker.next_check() == tracker.state.floor and tracker.declare_losses(took_over) == []
    assert tracker.declare_losses(tracker.state.floor) == ["i-2"]
    later = tracker.state.floor + timedelta(minutes=5)
    tracker.state.floor = later
    tracker.resumed(took_over)
    assert tracker.state.floor == later


def test_a_slow_hand_over_waits_a_full_window_for_the_refused_batches() -> None:
    """No batch reached the previous run for longer than an interval before this one began (its continue-as-new
    was overtaken by batches and retried on a worker that died: Temporal refused every batch for a workflow-task
    timeout). The probes send again on their client's backoff: the new run waits a full window, as for a silent
    pipeline that came back, and then declares only those still silent."""
    took_over = NOW + THRESHOLD + GRACE + timedelta(seconds=30)  # deadlines already past at the hand-over
    log = FakeLog()
    tracker, probe = took_over_from(NOW, log)
    assert tracker.handed_over_slowly(took_over)
    tracker.resumed(took_over, slowly=True)
    assert tracker.state.floor == took_over + THRESHOLD + GRACE
    assert tracker.next_check() == tracker.state.floor
    # i-1's refused batch arrives well after one interval, within the window; i-2 is silent for real.
    retried = took_over + EVERY + GRACE + timedelta(seconds=10)
    assert tracker.declare_losses(retried) == []
    tracker.on_report(probe.model_copy(update={"at": retried, "heard": {"i-1": 0}}), retried)
    assert tracker.declare_losses(tracker.state.floor) == ["i-2"]
    assert [line for line in log.lines if "no batch arrived from" in line] == [
        f"liveness of g: no batch arrived from {iso(NOW)} until this run began; no loss declared before "
        f"{iso(took_over + THRESHOLD + GRACE)}"
    ]


def test_a_game_day_ignores_receipts_until_it_ends() -> None:
    tracker = book()
    tracker.on_report(report(NOW, {"i-1": 0}), NOW)
    until = NOW + timedelta(minutes=2)
    tracker.on_ignore(IgnoreHeartbeats(instance_id="i-1", since=NOW, until=until), NOW)
    tracker.on_report(report(NOW + timedelta(minutes=1), {"i-1": 0}), NOW + timedelta(minutes=1))
    assert tracker.state.heard["i-1"] == int(NOW.timestamp())
    after = until + timedelta(seconds=5)
    tracker.on_report(report(after, {"i-1": 0}), after)
    assert tracker.state.heard["i-1"] == int(after.timestamp())


def test_a_recheck_judges_a_loss_afresh_from_now() -> None:
    tracker = book()
    tracker.on_report(report(NOW, {"i-1": 0}), NOW)
    tracker.lost.add("i-1")
    later = NOW + timedelta(minutes=3)
    tracker.on_recheck(RecheckLoss(instance_id="i-1"), later)
    assert "i-1" not in tracker.lost and tracker.state.heard["i-1"] == int(later.timestamp())
    tracker.on_recheck(RecheckLoss(instance_id="i-2"), later)  # never lost: nothing to do
    assert "i-2" not in tracker.state.heard


def test_what_left_on_purpose_says_so_and_whether_for_good() -> None:
    tracker = book()
    tracker.on_report(report(NOW, {"i-1": 0, "i-2": 0}), NOW)
    tracker.lost.update({"i-1", "i-2"})
    gone = {
        "i-1": GoneInstance(instance_id="i-1", state="stopped", reason="User initiated", cause=GoneCause.EC2_STOPPED),
        "i-2": GoneInstance(instance_id="i-2", state="terminated", reason="", cause=GoneCause.EC2_TERMINATED),
    }
    tracker.told_lost(["i-1", "i-2"], gone)
    stopped, terminated = tracker.outbox
    assert (stopped.gone, stopped.for_good) == ("stopped in EC2: User initiated", False)
    assert (terminated.gone, terminated.for_good) == ("terminated in EC2: no reason given", True)


def test_a_new_threshold_is_checked_and_moves_every_deadline() -> None:
    tracker = book()
    tracker.on_group_changed(CapacityGroup(name="other", cluster="c"))
    assert tracker.state.rejected_signals == 1
    wider = CapacityGroup(name="g", cluster="c", heartbeat_loss_threshold=timedelta(minutes=5))
    tracker.on_group_changed(wider)
    assert tracker.wake and tracker.threshold() == timedelta(minutes=5) and tracker.window() == timedelta(minutes=5)


def test_a_batch_for_another_shard_is_rejected() -> None:
    tracker = book()
    tracker.on_report(report(NOW, {"i-1": 0}).model_copy(update={"group": "other"}), NOW)
    assert tracker.state.rejected_signals == 1 and tracker.state.heard == {}


def test_state_stays_bounded() -> None:
    tracker = book()
    tracker.state.heard = {f"i-{n}": int(NOW.timestamp()) for n in range(MAX_INSTANCES_PER_SHARD)}
    tracker.on_report(report(NOW, {"i-new": 0}), NOW)
    assert "i-new" not in tracker.state.heard and tracker.state.dropped_instances == 1


def test_an_instance_lost_for_a_day_is_forgotten() -> None:
    tracker = book()
    tracker.on_report(report(NOW, {"i-1": 0}, reporter="probe").model_copy(update={"relay": False}), NOW)
    tracker.lost.add("i-1")
    tracker.declare_losses(NOW + FORGET_LOST_AFTER + timedelta(seconds=1))
    assert "i-1" not in tracker.state.heard and tracker.state.forgotten == 1


@pytest.mark.parametrize("carry", [None, LivenessCarry(lost=["i-9"], heard={"i-9": 1})])
def test_what_the_next_run_takes_over(carry: LivenessCarry | None) -> None:
    tracker = LivenessBook("g", 0, 1, carry, FakeLog())
    tracker.lost.add("i-1")
    assert "i-1" in tracker.carried().lost
