"""The demo's closing timings line from an events file: fault -> IMPAIRED, the permit wait, a repair's own steps
(drain + launch + terminate, from its RepairCompleted timeline, not the waits for a boot or stop timeouts) and the
whole repair, each as p50, p90 and max."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio.api.common.v1 import ActivityType
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import (
    ActivityTaskCompletedEventAttributes,
    ActivityTaskScheduledEventAttributes,
    HistoryEvent,
)

from benchmarks.demo_timings import faults_written, step_holdups
from contract import event_types as ev
from contract.events import Event
from contract.health import HealthState
from contract.repair import PhaseStep, RepairAction
from simulator.demo_summary import EventLog, own_steps_seconds, timings_line

T0 = datetime(2026, 12, 5, 6, 0, tzinfo=UTC)


def at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat()


def timeline(offsets: dict[str, float]) -> list[dict[str, str]]:
    return [{"phase": phase, "started_at": at(s)} for phase, s in offsets.items()]


REPAIR_TIMELINE = {
    "WaitingForPermit": 2,
    "Draining": 3,  # 0.5 s
    "LaunchingReplacement": 3.5,  # 1 s
    "WaitingForReplacement": 4.5,  # the boot: not ours
    "StoppingTasks": 30,  # the stop timeouts: not ours
    "CollectingEvidence": 40,
    "Terminating": 41,  # 1.5 s
    "Completed": 42.5,
}


def test_own_steps_are_drain_launch_and_terminate_from_the_timeline() -> None:
    assert own_steps_seconds(timeline(REPAIR_TIMELINE)) == 3.0
    assert own_steps_seconds("not a timeline") is None
    assert own_steps_seconds([{"phase": "Draining"}]) is None
    assert own_steps_seconds(timeline({"WaitingForPermit": 0, "Completed": 1})) is None


def test_timings_line_reports_p50_p90_and_max_of_each_measure(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    faults_at = {}
    for n in range(10):
        instance = f"i-{n:017x}"
        faults_at[instance] = T0
        scale = n + 1  # the n-th repair takes n + 1 times as long in each measure
        steps = {phase: s * scale for phase, s in REPAIR_TIMELINE.items()}
        completed = ev.RepairCompleted(
            reason="XID_79",
            action=RepairAction.REPLACE,
            timeline=[PhaseStep.model_validate(s) for s in timeline(steps)],
        )
        for seconds, detail in [
            (0.1 * scale, ev.HealthChanged(overall_status=HealthState.IMPAIRED, details=[])),
            (1, ev.RepairStarted(reason="XID_79")),
            (1 + 0.2 * scale, ev.DrainPermitGranted()),
            (1 + 10 * scale, completed),
        ]:
            time = T0 + timedelta(seconds=seconds)
            event = Event.of(
                detail, event_id=f"e{len(events)}", time=time, group="g", instance_id=instance, workflow_id="w"
            )
            events.append(event.published().line())
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    log = EventLog(path)
    log.read_new()

    assert timings_line(log, faults_at) == (
        "fault -> IMPAIRED p50 0.6s p90 0.9s max 1.0s (10/10); "
        "permit wait p50 1.1s p90 1.8s max 2.0s (10/10); "
        "drain+launch+terminate p50 16.5s p90 27.0s max 30.0s (10/10); "
        "repair p50 55.0s p90 90.0s max 100.0s (10/10)"
    )


def test_the_benchmark_reads_when_each_fault_was_written_from_the_demo_log(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    log.write_text(
        "2026-12-05 05:32:58,910 INFO simulator.fleet: fleet-sim: injected Xid 109 on i-32377617956102b20 "
        "(0000:86:00)\n"
        "2026-12-05 05:32:59,001 INFO ingest.server: relayed finding of i-32377617956102b20 in gpu-a\n"
        "2026-12-05 05:33:10,000 INFO simulator.fleet: fleet-sim: injected Xid 79 on i-32377617956102b20 (0000:86:00)\n"
    )
    assert faults_written(log) == {"i-32377617956102b20": datetime(2026, 12, 5, 5, 32, 58, 910000, tzinfo=UTC)}


def _event(event_id: int, kind: EventType.ValueType, seconds: float, **attributes: Any) -> HistoryEvent:
    event = HistoryEvent(event_id=event_id, event_type=kind, **attributes)
    event.event_time.FromDatetime(T0 + timedelta(seconds=seconds))
    return event


def test_a_step_completed_while_a_news_task_ran_is_held_until_that_one_is_done() -> None:
    """The benchmark's hold-up measure, on a history shaped as a repair's: a drain that completes while the task of
    its event's publish is in flight gets its own task only after that one; a launch that completes with none in
    flight gets its task at once; a news activity's completion is not a step."""

    def scheduled(event_id: int, seconds: float, name: str) -> HistoryEvent:
        attributes = ActivityTaskScheduledEventAttributes(activity_type=ActivityType(name=name))
        return _event(
            event_id,
            EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
            seconds,
            activity_task_scheduled_event_attributes=attributes,
        )

    def completed(event_id: int, seconds: float, of: int) -> HistoryEvent:
        attributes = ActivityTaskCompletedEventAttributes(scheduled_event_id=of)
        return _event(
            event_id,
            EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
            seconds,
            activity_task_completed_event_attributes=attributes,
        )

    def task(event_id: int, seconds: float) -> HistoryEvent:
        return _event(event_id, EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED, seconds)

    events = [
        scheduled(1, 0.0, "set_draining"),
        scheduled(2, 0.0, "publish_event"),
        completed(3, 0.2, of=2),  # the event published: a task for it...
        task(4, 0.2),
        _event(5, EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED, 0.3),
        _event(6, EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED, 0.9),
        completed(7, 0.5, of=1),  # ...in flight when the drain completed: written after it, its task after that
        task(8, 0.9),
        scheduled(9, 1.0, "launch_replacement"),
        completed(10, 1.3, of=9),
        task(11, 1.3),
    ]
    assert step_holdups(events) == [0.4, 0.0]
