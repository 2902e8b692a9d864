"""Publish fleet events to Amazon EventBridge (ECS's own channel for health changes), a JSON-lines file and/or a
webhook (activities/event_sinks.py), and count them in our metrics (activities/metrics.py).

Every sink fails open: `publish_event` tries each once, together, for at most `events.sink_timeout` (the webhook:
`webhook_timeout`), and hands what a sink refuses to that sink's event outbox, a Temporal workflow
(workflows/event_outbox.py, signal-with-start), which sends it later or, past `events.outbox_deadline`, dead-letters it
through `dead_letter_events`. Nothing waits on the worker's disk: any worker replica may die at any moment and another
carries on. A deleted bus, a throttling storm or an unwritable file costs a repair step a second or two at most, and
the activity fails only when the event can be neither delivered nor handed to Temporal.

A repair's news (`publish_news`) is its progress for the instance's health workflow, signalled through the client, and
the events its steps made since its last batch, each published as `publish_event` publishes one.

Delivery is at least once: a retried activity, or a try that timed out but got through, may publish an event twice.
Every event carries a deterministic `event_id`, so consumers drop the duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from enum import Enum
from typing import Any

from pydantic import ValidationError
from temporalio import activity
from temporalio.api.common.v1 import Payloads, WorkflowExecution
from temporalio.api.workflowservice.v1 import SignalWorkflowExecutionRequest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import MetricMeter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.aws import AwsClients
from activities.event_sinks import SinkTries
from activities.metrics import EventMetrics, OutboxMetrics
from activities.models import FleetEvent, RepairNews
from contract import names
from contract.config import EventSettings
from contract.event_outbox import (
    MAX_ENTRIES_PER_SIGNAL,
    MAX_SIGNAL_BYTES,
    Burial,
    Delivery,
    DeliveryResult,
    OutboxEntries,
    OutboxEntry,
    OutboxRun,
    Sink,
    SinkTarget,
    outbox_workflow_id,
)
from contract.events import Event
from contract.formats import iso, workflow_url
from contract.repair import RepairProgress

log = logging.getLogger(__name__)
# How long an outbox found RUNNING is taken as a backlog without asking Temporal again (Outboxes.backlogged).
BACKLOG_RECHECK = timedelta(seconds=5)


def _json_default(value: Any) -> Any:
    # A detail sent as built may hold datetimes and enums where a caller did not dump its model in JSON mode.
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def event_body(event: FleetEvent, workflow_url: str | None = None) -> dict[str, Any]:
    """The event as every sink takes it (contract/events.py): the envelope, its detail in its type's model's JSON form
    (with ECS's `healthChecks` and `overallStatus` on a HealthChanged), and the Web UI page of the workflow that sent
    it (what ECS's event cannot give: the repair's story, step by step)."""
    try:
        published = event.published()
    except ValidationError as err:
        # Built by a workflow of another version (a field this worker does not know): sent as built, never lost.
        log.warning("%s event %s sent as built, not of its schema: %s", event.type.value, event.event_id, err)
        published = event
    if workflow_url is not None:
        published = published.model_copy(update={"workflow_url": workflow_url})
    return published.line()


def current_entry(entry: OutboxEntry) -> OutboxEntry:
    """An entry that waited since a worker of schema_version 1 queued it, in version 2's shape, so that a consumer
    sees one shape after the upgrade. The entry's own event_id is the event's: a flat ScheduledEventFound's body
    had EC2's event id in its place."""
    if "schema_version" in entry.event:
        return entry
    try:
        event = Event.model_validate(entry.event).model_copy(update={"event_id": entry.event_id})
    except ValidationError:
        return entry
    return entry.model_copy(update={"event": json.loads(json.dumps(event_body(event), default=_json_default))})


class Outboxes:
    """The event outboxes as `publish_event` sees them: hand an event over (signal-with-start), and whether one this
    process handed events to still has them waiting (a running outbox is a backlog: a new event must queue behind
    it, not overtake it). Only outboxes this process used are looked at, so a healthy sink costs no Temporal call."""

    def __init__(
        self,
        client: Client,
        task_queue: str,
        settings: EventSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._task_queue = task_queue
        self._settings = settings
        self._clock = clock
        self._used: set[str] = set()
        self._running_until: dict[str, float] = {}  # outbox id -> until when its RUNNING is taken as still true
        # Per outbox: the events waiting for a hand-over, and the lock whose holder hands them over.
        self._pending: dict[str, list[tuple[OutboxEntry, asyncio.Future[None]]]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._asking: dict[str, asyncio.Lock] = {}  # per outbox: held by the one describe in flight

    async def backlogged(self, target: SinkTarget) -> bool:
        workflow_id = outbox_workflow_id(target, self._task_queue)
        if workflow_id not in self._used:
            return False
        # A backlog lasts: in a burst every describe of the one outbox waits for its lock behind the events being
        # handed to it (7.8 s at the median in a 1,000 / 200 run, as long as the hand-over), so the answer is kept a
        # while, and asked once for all who want it. Taken as running after it ended, an event only goes through a
        # new outbox, still in order.
        async with self._asking.setdefault(workflow_id, asyncio.Lock()):
            if self._clock() < self._running_until.get(workflow_id, 0.0):
                return True
            if workflow_id not in self._used:
                return False
            try:
                described = await self._client.get_workflow_handle(workflow_id).describe()
            except RPCError as err:
                if err.status == RPCStatusCode.NOT_FOUND:
                    self._used.discard(workflow_id)
                    return False
                raise
            if described.status == WorkflowExecutionStatus.RUNNING:
                self._running_until[workflow_id] = self._clock() + BACKLOG_RECHECK.total_seconds()
                return True
            self._used.discard(workflow_id)
            return False

    async def hand_over(self, target: SinkTarget, entry: OutboxEntry) -> None:
        """Into the target's outbox (signal-with-start), in Temporal before this returns. One outbox takes signals one
        at a time (in a 1,000 / 200 run a hand-over each queued for its lock: 9.9 s at the median, past publish_event's
        timeout), so the events this process hands over while one hand-over to it is in flight go together in the
        next, oldest first."""
        workflow_id = outbox_workflow_id(target, self._task_queue)
        handed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._pending.setdefault(workflow_id, [])
        waiting.append((entry, handed))
        try:
            async with self._locks.setdefault(workflow_id, asyncio.Lock()):
                while not handed.done():
                    await self._send(target, workflow_id)
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):  # not taken by a hand-over yet: this activity's retry brings it
                waiting.remove((entry, handed))
            raise
        await handed  # what the hand-over that carried it raised, if anything

    async def _send(self, target: SinkTarget, workflow_id: str) -> None:
        waiting = self._pending[workflow_id]
        batch, size = [waiting[0]], waiting[0][0].size()
        for pair in waiting[1:MAX_ENTRIES_PER_SIGNAL]:
            size += pair[0].size()
            if size > MAX_SIGNAL_BYTES:
                break
            batch.append(pair)
        del waiting[: len(batch)]
        entries = [entry for entry, _ in batch]
        # One event alone goes as before: an outbox run by a worker older than OutboxEntries still takes it.
        signal, arg = (
            (names.SIGNAL_OUTBOX_ENQUEUE, entries[0])
            if len(entries) == 1
            else (names.SIGNAL_OUTBOX_ENQUEUE_MANY, OutboxEntries(entries=entries))
        )
        run = OutboxRun(
            target=target, max_events=self._settings.outbox_max_events, deadline=self._settings.outbox_deadline
        )
        try:
            await self._client.start_workflow(
                names.EVENT_OUTBOX_WORKFLOW,
                run,
                id=workflow_id,
                task_queue=self._task_queue,
                start_signal=signal,
                start_signal_args=[arg],
            )
        except asyncio.CancelledError:
            waiting[:0] = batch  # the next in line hands them over (again: the outbox drops an event it holds)
            raise
        except Exception as err:
            for _, handed in batch:
                if not handed.done():
                    handed.set_exception(err)
            return
        self._used.add(workflow_id)
        for _, handed in batch:
            if not handed.done():
                handed.set_result(None)


class EventActivities:
    def __init__(
        self,
        aws: AwsClients,
        settings: EventSettings,
        client: Client,
        task_queue: str = names.DEFAULT_TASK_QUEUE,
        ui_url: str | None = None,
    ) -> None:
        self._ui_url = ui_url
        self._client = client
        self._sinks = SinkTries(aws.settings, settings, aws.calls)
        self._outboxes = Outboxes(client, task_queue, settings)

    def activities(self) -> list[Callable[..., Any]]:
        """The bound activity methods, for `Worker(activities=...)`."""
        return [self.publish_event, self.publish_news, self.deliver_outboxed_events, self.dead_letter_events]

    def _workflow_url(self, event: FleetEvent) -> str | None:
        if self._ui_url is None or not event.workflow_id:
            return None
        return workflow_url(self._ui_url, activity.info().workflow_namespace or "default", event.workflow_id)

    @activity.defn(name="publish_event")
    async def publish_event(self, event: FleetEvent) -> None:
        await self._publish_event(event)

    @activity.defn(name="publish_news")
    async def publish_news(self, news: RepairNews) -> None:
        """A repair's news since its last batch: the health workflow's progress first (what a repair's correctness
        rests on), then its events in the order they were made. One activity, so one workflow task after it, where a
        signal and an activity per step each woke the repair for a task of its own and held up its next step."""
        if news.progress is not None:
            await self._tell_health(news.health_workflow_id, news.progress, news.signal_request_id)
        for event in news.events:
            await self._publish_event(event)

    async def _tell_health(self, workflow_id: str, progress: RepairProgress, request_id: str) -> None:
        # The request id is the workflow's: a retry of this activity signals with the same one, and the server drops
        # a signal whose id it already took (as it does for a workflow's own signal to another).
        request = SignalWorkflowExecutionRequest(
            namespace=self._client.namespace,
            workflow_execution=WorkflowExecution(workflow_id=workflow_id),
            signal_name=names.SIGNAL_REPAIR_PROGRESS,
            input=Payloads(payloads=await self._client.data_converter.encode([progress])),
            identity=self._client.identity,
            request_id=request_id,
        )
        try:
            await self._client.workflow_service.signal_workflow_execution(request, retry=True)
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            # Closed or never started: nobody is waiting for this repair's progress.
            log.info("%s not told of %s: %s", workflow_id, progress.phase.value, err.message)

    async def _publish_event(self, event: FleetEvent) -> None:
        body = event_body(event, self._workflow_url(event))
        text = json.dumps(body, default=_json_default)
        meter = _meter()
        metrics = EventMetrics(meter) if meter is not None else None
        # Counted on the first attempt only, and before the sinks: a retry must not count the step twice, and a
        # sink outage must not hide it from the metrics.
        if metrics is not None and activity.info().attempt == 1:
            _record(metrics, event)
        entry = OutboxEntry(
            event_id=event.event_id,
            queued_at=datetime.now(UTC),
            time=event.time,
            detail_type=event.detail_type,
            event=json.loads(text),
        )
        # The sinks together: the step waits for the slowest one's single try, not for the sum of them.
        results = await asyncio.gather(
            *(self._publish(target, entry, text.encode(), OutboxMetrics(meter)) for target in self._sinks.targets),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            # Neither delivered nor handed to Temporal: the one case worth a retry of the activity (bounded by the
            # workflow). A sink that took the event may take it again: consumers drop the duplicate by its id.
            raise ApplicationError(
                f"{event.type.value} event {event.event_id} could not be kept for a later delivery: {errors[0]}",
                type="EventOutboxUnusable",
            ) from errors[0]

    async def _publish(self, target: SinkTarget, entry: OutboxEntry, body: bytes, metrics: OutboxMetrics) -> None:
        sink = target.sink.value
        if await self._outboxes.backlogged(target):
            # Sent now, it would overtake the older events waiting for the same sink.
            await self._outboxes.hand_over(target, entry)
            metrics.queued(sink, "backlog")
            return
        failure = await self._sinks.attempt(target, entry, body if target.sink is Sink.WEBHOOK else None)
        if failure is None:
            return
        level = logging.WARNING if failure.kind == "transient" else logging.ERROR
        what = "dead-lettered" if failure.kind == "rejected" else "queued for retry"
        log.log(level, "%s delivery of event %s failed, %s: %s", sink, entry.event_id, what, failure.error)
        await self._outboxes.hand_over(target, entry.model_copy(update={"why": failure}))
        metrics.queued(sink, f"{failure.kind}_error")

    @activity.defn(name="deliver_outboxed_events")
    async def deliver_outboxed_events(self, delivery: Delivery) -> DeliveryResult:
        """Send waiting events oldest first, one try each, until one fails: how many the sink took, and why it
        stopped."""
        metrics = OutboxMetrics(_meter())
        sink = delivery.target.sink.value
        for index, entry in enumerate(delivery.entries):
            failure = await self._sinks.attempt(delivery.target, current_entry(entry))
            if failure is not None:
                metrics.retried(sink, f"{failure.kind}_error")
                level = logging.WARNING if failure.kind == "transient" else logging.ERROR
                log.log(level, "%s: event %s still not delivered: %s", sink, entry.event_id, failure.error)
                return DeliveryResult(delivered=index, failure=failure)
            metrics.retried(sink, "delivered")
        return DeliveryResult(delivered=len(delivery.entries))

    @activity.defn(name="dead_letter_events")
    async def dead_letter_events(self, burial: Burial) -> None:
        """Events given up on: an error line each, with the event whole (to replay it by hand), and the metric."""
        metrics = OutboxMetrics(_meter())
        sink = burial.target.sink.value
        for letter in burial.letters:
            log.error(
                "%s event %s dead-lettered (%s): %s; the event: %s",
                sink,
                letter.entry.event_id,
                letter.reason,
                letter.error,
                json.dumps(letter.entry.event, default=_json_default),
            )
            metrics.dead_lettered(sink, letter.reason)


def _meter() -> MetricMeter | None:
    try:
        return activity.metric_meter()
    except Exception as err:  # metrics are never worth failing an event for
        log.warning("metrics unavailable: %s", err)
        return None


def _record(metrics: EventMetrics, event: FleetEvent) -> None:
    try:
        metrics.record(event)
    except Exception as err:
        log.warning("could not record metrics for %s event %s: %s", event.type.value, event.event_id, err)
