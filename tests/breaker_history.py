"""Reading a workflow's history for tests/test_breaker_property.py: what its workflow tasks saw (Timeline), which
of its workflow tasks failed, and what it has in flight."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.api.history.v1 import HistoryEvent
from temporalio.contrib.pydantic import pydantic_data_converter

from contract import names
from contract.breaker import HoldNotice, ImpairmentReport
from contract.groups import GroupConfigUpdate
from workflows.models import PermitGrant

# The janitor's own failures (RESET_STICKY_TASK_QUEUE), and what the server fails by itself when a signal races a
# close or continue-as-new (tests/test_signal_fuzz.py explains these).
RESET_STICKY = WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_STICKY_TASK_QUEUE
SERVER_CAUSED = {
    RESET_STICKY,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND,
}


@dataclass
class Timeline:
    """A semaphore's history as what its workflow tasks saw: each signal by the first task it was handed to, each
    grant and each resume by the task that made it (tasks numbered by their completions, across runs)."""

    grants: list[tuple[int, PermitGrant]] = field(default_factory=list)
    reports: list[tuple[int, ImpairmentReport]] = field(default_factory=list)
    fleet: list[tuple[int, HoldNotice]] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, runs: Sequence[Sequence[HistoryEvent]]) -> Timeline:
        timeline = cls()
        done = 0  # workflow tasks completed so far
        convert = pydantic_data_converter.payload_converter
        for events in runs:
            for event in events:
                kind = event.event_type
                if kind == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                    done += 1
                elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                    signal = event.workflow_execution_signaled_event_attributes
                    payloads = signal.input.payloads
                    # Handed to the next task to complete (a signal that came during a task is recorded after it).
                    if signal.signal_name == names.SIGNAL_IMPAIRED and len(payloads) == 1:
                        timeline.reports.append((done + 1, convert.from_payload(payloads[0], ImpairmentReport)))
                    elif signal.signal_name == names.SIGNAL_FLEET_HOLD and len(payloads) == 1:
                        timeline.fleet.append((done + 1, convert.from_payload(payloads[0], HoldNotice)))
                elif kind == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
                    command = event.signal_external_workflow_execution_initiated_event_attributes
                    if command.signal_name == names.SIGNAL_PERMIT_GRANTED:
                        timeline.grants.append((done, convert.from_payload(command.input.payloads[0], PermitGrant)))
                elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
                    request = event.workflow_execution_update_accepted_event_attributes.accepted_request.input
                    update = convert.from_payload(request.args.payloads[0], GroupConfigUpdate)
                    if request.name == names.UPDATE_GROUP and update.resume:
                        # The handler resumes before its first await: in the task that accepted it.
                        timeline.resumes.append(done)
        return timeline


def failed_tasks(events: Sequence[HistoryEvent]) -> list[str]:
    """The workflow task failures of a history that the server did not cause itself."""
    failures = []
    for event in events:
        if event.event_type != EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
            continue
        attributes = event.workflow_task_failed_event_attributes
        if attributes.cause not in SERVER_CAUSED:
            cause = WorkflowTaskFailedCause.Name(attributes.cause).removeprefix("WORKFLOW_TASK_FAILED_CAUSE_")
            failures.append(f"workflow task failed (event {event.event_id}, {cause}): {attributes.failure.message}")
    return failures


def open_work(events: Sequence[HistoryEvent]) -> list[str]:
    """What a workflow's history shows in flight: a workflow task, activities, signals to other workflows."""
    task = False
    activities: set[int] = set()
    signals: set[int] = set()
    for event in events:
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
            task = True
        elif kind in (
            EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED,
            EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED,
            EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT,
        ):
            task = False
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            activities.add(event.event_id)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            activities.discard(event.activity_task_completed_event_attributes.scheduled_event_id)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
            activities.discard(event.activity_task_failed_event_attributes.scheduled_event_id)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
            activities.discard(event.activity_task_timed_out_event_attributes.scheduled_event_id)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED:
            activities.discard(event.activity_task_canceled_event_attributes.scheduled_event_id)
        elif kind == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            signals.add(event.event_id)
        elif kind == EventType.EVENT_TYPE_EXTERNAL_WORKFLOW_EXECUTION_SIGNALED:
            signals.discard(event.external_workflow_execution_signaled_event_attributes.initiated_event_id)
        elif kind == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_FAILED:
            signals.discard(event.signal_external_workflow_execution_failed_event_attributes.initiated_event_id)
    pending = ["a workflow task"] if task else []
    pending += [f"activity {i}" for i in sorted(activities)] + [f"signal {i}" for i in sorted(signals)]
    return pending
