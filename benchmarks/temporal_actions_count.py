"""Counting Temporal Cloud billable actions: from the real event histories, plus the two kinds no history shows
(queries, activity heartbeats), which `ActionCounter` records as they happen.

The rules are Temporal Cloud's list of actions (docs.temporal.io/cloud/actions):
  workflow started (a client start, continue-as-new, a child)   one; a signal-with-start is one action in all,
                                                                 whether or not it started the workflow
  signal sent (from a client or from a workflow)                 one per signal
  timer started (also the implicit one of wait_condition(timeout))  one
  search-attribute upsert (not those given at start)             one per command
  activity started or retried                                    one per attempt
  activity heartbeat that reaches the server                     one (the SDK throttles to 80 % of the timeout)
  query received by a worker, update accepted or rejected        one each
  child workflow start                                           two (the start and the execution)
A signal is counted where it lands (WorkflowExecutionSignaled), so a signal one workflow sends another is counted
once; one sent to a closed workflow (SignalExternalWorkflowExecutionFailed) is counted where it was sent.
Used by benchmarks.temporal_actions.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, Interceptor, OutboundInterceptor, QueryWorkflowInput
from temporalio.worker import (
    ActivityInboundInterceptor,
    ActivityOutboundInterceptor,
)
from temporalio.worker import (
    Interceptor as WorkerInterceptor,
)

from workflows.options import heartbeat_every

# Temporal's default thresholds for suggesting continue-as-new (limit.historyCount/historySize.suggestContinueAsNew)
SUGGEST_CAN_EVENTS = 4 * 1024
SUGGEST_CAN_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Action:
    """Billable actions (n) of one kind at one moment, in one workflow's history or seen by the counter."""

    at: datetime
    kind: str
    n: int
    workflow_id: str
    detail: str = ""


@dataclass
class Execution:
    """One run of a workflow: its billable actions, and every event's time and size (for continue-as-new)."""

    workflow_id: str
    run_id: str
    workflow_type: str
    actions: list[Action] = field(default_factory=list)
    events: list[tuple[datetime, int]] = field(default_factory=list)  # (time, bytes)
    signals: list[datetime] = field(default_factory=list)  # signals received: the workflows' own run limit


# --- what no history shows ------------------------------------------------------------------------------------


@dataclass
class HeartbeatCalls:
    workflow_id: str
    activity_type: str
    throttle_s: float
    calls: list[float] = field(default_factory=list)


class ActionCounter(Interceptor, WorkerInterceptor):
    """Given to the client (and so to the worker made from it): records every query the harness or an activity
    makes, and every heartbeat an activity calls."""

    def __init__(self) -> None:
        # (time, the workflow queried, the query, the workflow whose activity asked: None for the harness)
        self.queries: list[tuple[float, str, str, str | None]] = []
        self.heartbeats: dict[tuple[str, str, int], HeartbeatCalls] = {}

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _CountQueries(next, self)

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _CountHeartbeatsIn(next, self)

    def query_actions(self) -> list[Action]:
        """Each answered query, charged to the workflow whose activity made it (the harness's to its target)."""
        return [
            Action(datetime.fromtimestamp(at, UTC), "query" if origin else "query (harness)", 1, origin or target, q)
            for at, target, q, origin in self.queries
        ]

    def heartbeat_actions(self) -> list[Action]:
        """The heartbeats that reached the server, by the SDK's throttle: the first at once, then at most one per
        throttle interval, the latest of those called in between (a call still pending when the activity ends is
        not sent: its completion says more)."""
        actions: list[Action] = []
        for (_, activity_id, attempt), log in self.heartbeats.items():
            for at in throttled(log.calls, log.throttle_s):
                detail = f"{log.activity_type} {activity_id}#{attempt}"
                when = datetime.fromtimestamp(at, UTC)
                actions.append(Action(when, "activity heartbeat", 1, log.workflow_id, detail))
        return actions


def throttled(calls: list[float], every: float) -> list[float]:
    sent: list[float] = []
    pending = False
    for at in sorted(calls):
        while pending and sent and sent[-1] + every <= at:
            sent.append(sent[-1] + every)
            pending = False
        if not sent or at - sent[-1] >= every:
            sent.append(at)
        else:
            pending = True
    return sent


class _CountQueries(OutboundInterceptor):
    def __init__(self, next: OutboundInterceptor, counter: ActionCounter) -> None:
        super().__init__(next)
        self._counter = counter

    async def query_workflow(self, input: QueryWorkflowInput) -> Any:
        # Only a query a worker answered is billed: one to a workflow that does not exist never reaches one.
        result = await super().query_workflow(input)
        origin = (activity.info().workflow_id or "") if activity.in_activity() else None
        self._counter.queries.append((time.time(), input.id, input.query, origin))
        return result


class _CountHeartbeatsIn(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, counter: ActionCounter) -> None:
        super().__init__(next)
        self._counter = counter

    def init(self, outbound: ActivityOutboundInterceptor) -> None:
        super().init(_CountHeartbeatsOut(outbound, self._counter))


class _CountHeartbeatsOut(ActivityOutboundInterceptor):
    def __init__(self, next: ActivityOutboundInterceptor, counter: ActionCounter) -> None:
        super().__init__(next)
        self._counter = counter

    def heartbeat(self, *details: Any) -> None:
        info = self.info()
        throttle = heartbeat_every(info.heartbeat_timeout).total_seconds()
        key = (info.workflow_id or "", info.activity_id, info.attempt)
        log = self._counter.heartbeats.setdefault(
            key, HeartbeatCalls(info.workflow_id or "", info.activity_type, throttle)
        )
        log.calls.append(time.time())
        super().heartbeat(*details)


# --- the histories ----------------------------------------------------------------------------------------------


def _at(event: Any) -> datetime:
    return event.event_time.ToDatetime(tzinfo=UTC)


def count_history(workflow_id: str, run_id: str, workflow_type: str, events: Iterable[Any]) -> Execution:
    """The billable actions of one run's history."""
    run = Execution(workflow_id, run_id, workflow_type)
    attempts: dict[int, int] = {}  # scheduled event id -> attempts, from its started event
    scheduled: dict[int, tuple[datetime, str]] = {}
    started_at: datetime | None = None
    for event in events:
        at = _at(event)
        run.events.append((at, event.ByteSize()))
        kind = event.event_type

        def add(what: str, n: int = 1, detail: str = "", when: datetime = at) -> None:
            run.actions.append(Action(when, what, n, workflow_id, detail))

        if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            attrs = event.workflow_execution_started_event_attributes
            started_at = at
            add("start (continue-as-new)" if attrs.continued_execution_run_id else "start")
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            attrs = event.workflow_execution_signaled_event_attributes
            run.signals.append(at)
            sender = attrs.external_workflow_execution.workflow_id
            if event.event_id == 2 and started_at is not None:
                # Signalled before its first workflow task was even scheduled: the signal of the signal-with-start
                # that started this run, one action with the start.
                add("signal-with-start's signal (free with its start)", 0, attrs.signal_name)
            else:
                add("signal from workflow" if sender else "signal", 1, attrs.signal_name)
        elif kind == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_FAILED:
            attrs = event.signal_external_workflow_execution_failed_event_attributes
            add("signal to a closed workflow", 1, attrs.workflow_execution.workflow_id)
        elif kind == EventType.EVENT_TYPE_TIMER_STARTED:
            add("timer")
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            scheduled[event.event_id] = (at, name)
            add("activity", 1, name)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            attrs = event.activity_task_started_event_attributes
            attempts[attrs.scheduled_event_id] = max(attrs.attempt, 1)
        elif kind == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            add("search-attribute upsert")
        elif kind == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED:
            add("child workflow start", 2)
        elif kind in (
            EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED,
            EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_REJECTED,
        ):
            add("update")
        elif kind == EventType.EVENT_TYPE_MARKER_RECORDED:
            add("marker (local activity / side effect)")
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_OPTIONS_UPDATED:
            add("workflow options update")
    for event_id, tries in attempts.items():
        if tries > 1 and event_id in scheduled:
            when, name = scheduled[event_id]
            run.actions.append(Action(when, "activity retry", tries - 1, workflow_id, name))
    return run


async def fetch_executions(client: Client) -> list[Execution]:
    """Every run the server knows of (continue-as-new chains included: each run is listed), counted."""
    runs: list[Execution] = []
    async for listed in client.list_workflows(page_size=1000):
        history = await client.get_workflow_handle(listed.id, run_id=listed.run_id).fetch_history()
        runs.append(count_history(listed.id, listed.run_id, listed.workflow_type, history.events))
    return runs


# --- windows and tallies ----------------------------------------------------------------------------------------


def between(actions: Iterable[Action], start: datetime, end: datetime) -> list[Action]:
    return [a for a in actions if start <= a.at < end]


def tally(actions: Iterable[Action]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for action in actions:
        counts[action.kind] += action.n
    return counts


def tally_detail(actions: Iterable[Action]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for action in actions:
        counts[f"{action.kind}: {action.detail}" if action.detail else action.kind] += action.n
    return counts


@dataclass
class Growth:
    """How fast a workflow's history grows in a window: what decides how often it continues as new."""

    events: int = 0
    bytes: int = 0
    signals: int = 0

    def add(self, run: Execution, start: datetime, end: datetime) -> None:
        inside = [size for at, size in run.events if start <= at < end]
        self.events += len(inside)
        self.bytes += sum(inside)
        self.signals += sum(1 for at in run.signals if start <= at < end)

    def runs_per(self, scale: float, signals_per_run: int) -> float:
        """Runs per extrapolated period (the window's growth times `scale`): a run continues as new at the first
        of Temporal's suggestions (events, bytes) or the workflow's own signal limit."""
        return max(
            self.events * scale / SUGGEST_CAN_EVENTS,
            self.bytes * scale / SUGGEST_CAN_BYTES,
            self.signals * scale / signals_per_run,
        )


def seconds(delta: timedelta) -> float:
    return delta.total_seconds()
