"""Publish fleet events to Amazon EventBridge (ECS's own channel for health changes), a JSON-lines file and/or a
webhook (activities/webhook.py), and count them in our metrics (activities/metrics.py).

Every sink fails open: `publish_event` tries each once, together, for at most `events.sink_timeout` (the webhook:
`webhook_timeout`), and what a sink refuses waits in that sink's outbox on the worker's disk, sent later by the
worker's delivery task (`event_delivery`) or, past `events.outbox_deadline`, dead-lettered (activities/webhook.py
has the outbox). So a deleted bus, a throttling storm or an unwritable file costs a repair step a second or two at
most, and the activity fails only when an event cannot be kept at all (a broken disk).

Delivery is at least once: a retried activity, or a try that timed out but got through, may publish an event twice.
Every event carries a deterministic `event_id`, so consumers drop the duplicates.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import date, datetime
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError
from pydantic import BaseModel, ValidationError
from temporalio import activity
from temporalio.common import MetricMeter
from temporalio.exceptions import ApplicationError

from activities.aws import AwsClients
from activities.errors import application_error
from activities.metrics import EventMetrics
from activities.models import EventType, FleetEvent
from activities.webhook import (
    DEAD_LETTER_FILE,
    DrainTiming,
    Failure,
    Outbox,
    OutboxMetrics,
    OutboxSender,
    WebhookSender,
    WebhookSink,
    append_line,
    deliver_or_queue,
    draining,
)
from contract.config import AwsSettings, EventSettings
from contract.formats import iso, workflow_url

if TYPE_CHECKING:
    from mypy_boto3_events import EventBridgeClient

log = logging.getLogger(__name__)

EVENTBRIDGE = "eventbridge"
JSONL = "jsonl"

# Entry error codes that say the event itself is malformed: no retry can help, so it is dead-lettered at once rather
# than blocking the events queued behind it. Any other entry error (AccessDeniedException, InternalFailure,
# ThrottlingException, ...) is retried from the outbox.
REJECTED_ENTRY_ERRORS = frozenset({"InvalidArgument", "MalformedDetail"})
PERMANENT_ENTRY_ERRORS = frozenset({"AccessDeniedException", "NotAuthorizedForSourceException"})
# A file that cannot be written until someone changes the disk, its mount or its permissions.
PERMANENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR, errno.ENOTDIR})
# The delivery task is on nobody's critical path: it may wait for a slow answer.
DRAIN_TIMEOUT_SECONDS = 10.0


def _json_default(value: Any) -> Any:
    # `fields` may hold datetimes and enums when a caller did not dump its model in JSON mode.
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def event_body(event: FleetEvent, workflow_url: str | None = None) -> dict[str, Any]:
    """The event's flat line, plus ECS's `healthChecks` name for a HealthChanged event's health details, and the
    Web UI page of the workflow that sent it (what ECS's event cannot give: the repair's story, step by step)."""
    body = event.line()
    if workflow_url is not None:
        body["workflow_url"] = workflow_url
    details = event.fields.get("details")
    if (
        event.type is EventType.HEALTH_CHANGED
        and isinstance(details, list)
        and all(isinstance(d, dict) and "type" in d and "status" in d for d in details)
    ):
        # ECS's "Container Instance Health Change" event says healthChecks where the API says details;
        # consumers written for ECS's event then read ours unchanged.
        body["healthChecks"] = details
    return body


# --- outbox entries: each says where its event was going, so a later delivery needs no settings ----------------


class EventBridgeTarget(BaseModel):
    region: str
    endpoint_url: str | None = None
    bus_name: str
    source: str


class EventBridgeEntry(BaseModel):
    target: EventBridgeTarget
    detail_type: str
    time: datetime
    event: dict[str, Any]


class JsonlTarget(BaseModel):
    path: Path


class JsonlEntry(BaseModel):
    target: JsonlTarget
    event: dict[str, Any]


def _folder(root: Path, label: str, key: str) -> Path:
    """One outbox per target: a readable label and a digest of everything that tells targets apart."""
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", label)[:40] or "_"
    return root / f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def eventbridge_outbox(settings: EventSettings, target: EventBridgeTarget) -> Outbox:
    root = settings.webhook_outbox_dir / EVENTBRIDGE
    folder = _folder(root, target.bus_name, target.model_dump_json(include={"region", "endpoint_url", "bus_name"}))
    return Outbox(folder, settings.webhook_outbox_max_events, sink=EVENTBRIDGE, dead_letters=root / DEAD_LETTER_FILE)


def jsonl_outbox(settings: EventSettings, path: Path) -> Outbox:
    root = settings.webhook_outbox_dir / JSONL
    folder = _folder(root, path.name, str(path))
    return Outbox(folder, settings.webhook_outbox_max_events, sink=JSONL, dead_letters=root / DEAD_LETTER_FILE)


# --- one try at each sink -------------------------------------------------------------------------------------


def events_client(target: EventBridgeTarget, timeout: float) -> EventBridgeClient:
    """A client that tries once and waits `timeout` at most per connection step: the outbox is the retry."""
    # A session of our own: boto3's default session is module-global and not safe to share across threads.
    session = boto3.session.Session(region_name=target.region)
    config = Config(
        region_name=target.region,
        connect_timeout=timeout,
        read_timeout=timeout,
        retries={"mode": "standard", "total_max_attempts": 1},
        max_pool_connections=50,
    )
    return session.client("events", endpoint_url=target.endpoint_url, config=config)


@dataclass(frozen=True)
class _EventsOnly:
    events: EventBridgeClient


class EventBridgeTry:
    """PutEvents once, through a client that does not retry and waits briefly: the outbox is the retry. The client is
    `self._aws.events`, as in the other activities, so that the check of the worker's IAM policy
    (tests/test_deploy_files.py) finds the call."""

    def __init__(self, target: EventBridgeTarget, timeout: float) -> None:
        self._aws = _EventsOnly(events=events_client(target, timeout))

    def put(self, entry: EventBridgeEntry) -> Failure | None:
        bus = entry.target.bus_name
        call, resource = "events:PutEvents", f"event bus {bus}"
        try:
            resp = self._aws.events.put_events(
                Entries=[
                    {
                        "EventBusName": bus,
                        "Source": entry.target.source,
                        "DetailType": entry.detail_type,
                        "Detail": json.dumps(entry.event),
                        "Time": entry.time,
                    }
                ]
            )
        except ClientError as err:
            # A deleted bus or a missing permission is permanent until an operator acts; throttling and 5xx are not.
            failed = application_error(err, call, resource)
            return Failure(failed.message, "permanent" if failed.non_retryable else "transient")
        except ParamValidationError as err:
            return Failure(" ".join(f"{call} on {resource} failed: invalid parameters: {err}".split()), "rejected")
        except BotoCoreError as err:  # a timeout, a refused connection, a garbled answer
            return Failure(f"{call} on {resource} failed: {type(err).__name__}: {err}")
        if resp.get("FailedEntryCount", 0) > 0:
            failed_entry = (resp.get("Entries") or [{}])[0]
            code = failed_entry.get("ErrorCode") or "PutEventsFailed"
            message = f"{call} on {resource} failed for event {entry.event.get('event_id')}: {code}: " + str(
                failed_entry.get("ErrorMessage", "no message")
            )
            if code in REJECTED_ENTRY_ERRORS:
                return Failure(message, "rejected")
            return Failure(message, "permanent" if code in PERMANENT_ENTRY_ERRORS else "transient")
        return None


def _append_blocking(entry: JsonlEntry) -> Failure | None:
    try:
        append_line(entry.target.path, json.dumps(entry.event).encode() + b"\n")
    except OSError as err:
        permanent = err.errno in PERMANENT_ERRNOS
        return Failure(f"appending to {entry.target.path} failed: {err}", "permanent" if permanent else "transient")
    return None


async def _bounded(what: str, timeout: float, call: Callable[[], Failure | None]) -> Failure | None:
    """One try, waited on for `timeout` at most. A thread left behind may still get through: at least once."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(call), timeout)
    except TimeoutError:
        return Failure(f"{what}: no answer within {timeout:g}s")


class EventBridgeSink:
    def __init__(self, aws: AwsSettings, settings: EventSettings) -> None:
        self._target = EventBridgeTarget(
            region=aws.region, endpoint_url=aws.endpoint_url, bus_name=settings.bus_name, source=settings.source
        )
        self._timeout = settings.sink_timeout.total_seconds()
        self._put = EventBridgeTry(self._target, self._timeout)
        self._outbox = eventbridge_outbox(settings, self._target)

    def publish(self, event: FleetEvent, text: str, metrics: OutboxMetrics) -> Awaitable[list[str]]:
        entry = EventBridgeEntry(
            target=self._target, detail_type=event.detail_type, time=event.time, event=json.loads(text)
        )

        def attempt() -> Awaitable[Failure | None]:
            what = f"events:PutEvents on event bus {self._target.bus_name}"
            return _bounded(what, self._timeout, lambda: self._put.put(entry))

        return deliver_or_queue(self._outbox, event.event_id, entry.model_dump_json().encode(), attempt, metrics)


class JsonlSink:
    def __init__(self, settings: EventSettings, path: Path) -> None:
        self._path = path
        self._timeout = settings.sink_timeout.total_seconds()
        self._outbox = jsonl_outbox(settings, path)

    def publish(self, event: FleetEvent, text: str, metrics: OutboxMetrics) -> Awaitable[list[str]]:
        entry = JsonlEntry(target=JsonlTarget(path=self._path), event=json.loads(text))

        def attempt() -> Awaitable[Failure | None]:
            return _bounded(f"appending to {self._path}", self._timeout, lambda: _append_blocking(entry))

        return deliver_or_queue(self._outbox, event.event_id, entry.model_dump_json().encode(), attempt, metrics)


class EventActivities:
    def __init__(self, aws: AwsClients, settings: EventSettings, ui_url: str | None = None) -> None:
        self._settings = settings
        self._ui_url = ui_url
        self._eventbridge = EventBridgeSink(aws.settings, settings) if settings.eventbridge else None
        self._jsonl = JsonlSink(settings, settings.jsonl_path) if settings.jsonl_path is not None else None
        self._webhook = WebhookSink(settings) if settings.webhook_url else None

    def activities(self) -> list[Callable[..., Any]]:
        """The bound activity methods, for `Worker(activities=...)`."""
        return [self.publish_event]

    def _workflow_url(self, event: FleetEvent) -> str | None:
        if self._ui_url is None or not event.workflow_id:
            return None
        return workflow_url(self._ui_url, activity.info().workflow_namespace or "default", event.workflow_id)

    @activity.defn(name="publish_event")
    async def publish_event(self, event: FleetEvent) -> None:
        body = event_body(event, self._workflow_url(event))
        text = json.dumps(body, default=_json_default)
        meter = self._meter()
        metrics = EventMetrics(meter) if meter is not None else None
        # Counted on the first attempt only, and before the sinks: a retry must not count the step twice, and a
        # sink outage must not hide it from the metrics.
        if metrics is not None and activity.info().attempt == 1:
            self._record(metrics, event)
        sink_metrics = OutboxMetrics(meter)
        # The sinks together: the step waits for the slowest one's single try, not for the sum of them.
        tries: list[Awaitable[list[str]]] = []
        if self._eventbridge is not None:
            tries.append(self._eventbridge.publish(event, text, sink_metrics))
        if self._jsonl is not None:
            tries.append(self._jsonl.publish(event, text, sink_metrics))
        if self._webhook is not None:
            tries.append(self._webhook.publish(event.event_id, text.encode(), sink_metrics))
        results = await asyncio.gather(*tries, return_exceptions=True)
        if self._webhook is not None and metrics is not None and isinstance(results[-1], list) and results[-1]:
            metrics.webhook_dropped(len(results[-1]))
        errors = [r for r in results if isinstance(r, BaseException)]
        unusable = [e for e in errors if isinstance(e, OSError)]
        if len(unusable) < len(errors):
            raise next(e for e in errors if not isinstance(e, OSError))
        if unusable:
            # Neither delivered nor kept: the one case worth a retry of the activity (bounded by the workflow).
            raise ApplicationError(
                f"{event.type.value} event {event.event_id} could not be kept for a later delivery: {unusable[0]}",
                type="EventOutboxUnusable",
            ) from unusable[0]

    @staticmethod
    def _meter() -> MetricMeter | None:
        try:
            return activity.metric_meter()
        except Exception as err:  # metrics are never worth failing an event for
            log.warning("metrics unavailable: %s", err)
            return None

    @staticmethod
    def _record(metrics: EventMetrics, event: FleetEvent) -> None:
        try:
            metrics.record(event)
        except Exception as err:
            log.warning("could not record metrics for %s event %s: %s", event.type.value, event.event_id, err)


# --- the worker's delivery tasks --------------------------------------------------------------------------------


class EventBridgeSender(OutboxSender):
    sink = EVENTBRIDGE

    def __init__(self, settings: EventSettings) -> None:
        self._root = settings.webhook_outbox_dir / EVENTBRIDGE
        self._max_events = settings.webhook_outbox_max_events
        # One client per region and endpoint the waiting entries name, for as long as the task runs.
        self._clients: dict[tuple[str, str | None], EventBridgeTry] = {}

    def queues(self) -> list[Outbox]:
        return Outbox.under(self._root, self._max_events, EVENTBRIDGE)

    async def send(self, body: bytes) -> Failure | None:
        try:
            entry = EventBridgeEntry.model_validate_json(body)
        except ValidationError as err:
            return Failure(f"unreadable outbox entry: {err}", "rejected")
        key = (entry.target.region, entry.target.endpoint_url)
        if key not in self._clients:
            self._clients[key] = await asyncio.to_thread(EventBridgeTry, entry.target, DRAIN_TIMEOUT_SECONDS)
        client = self._clients[key]
        what = f"events:PutEvents on event bus {entry.target.bus_name}"
        return await _bounded(what, DRAIN_TIMEOUT_SECONDS * 2, lambda: client.put(entry))


class JsonlSender(OutboxSender):
    sink = JSONL

    def __init__(self, settings: EventSettings) -> None:
        self._root = settings.webhook_outbox_dir / JSONL
        self._max_events = settings.webhook_outbox_max_events

    def queues(self) -> list[Outbox]:
        return Outbox.under(self._root, self._max_events, JSONL)

    async def send(self, body: bytes) -> Failure | None:
        try:
            entry = JsonlEntry.model_validate_json(body)
        except ValidationError as err:
            return Failure(f"unreadable outbox entry: {err}", "rejected")
        return await _bounded(
            f"appending to {entry.target.path}", DRAIN_TIMEOUT_SECONDS, lambda: _append_blocking(entry)
        )


@asynccontextmanager
async def event_delivery(
    settings: EventSettings, meter: MetricMeter | None = None, *, timing: DrainTiming | None = None
) -> AsyncIterator[None]:
    """Send every sink's outbox while the worker runs: EventBridge's and the JSON-lines file's always (entries left
    by an earlier configuration still name their bus or file), the webhook's when one is set."""
    senders: list[OutboxSender] = [EventBridgeSender(settings), JsonlSender(settings)]
    if settings.webhook_url:
        senders.append(WebhookSender(settings, meter or MetricMeter.noop))
    async with draining(senders, settings, meter, timing or DrainTiming()):
        yield
