"""Publish fleet events to Amazon EventBridge (ECS's own channel for health changes), a JSON-lines file and/or a
webhook (activities/webhook.py), and count them in our metrics (activities/metrics.py).

Delivery is at least once: a retried activity may publish an event twice. Every event carries a deterministic
`event_id`, so consumers drop the duplicates.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from datetime import date, datetime
from enum import Enum
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.aws import AwsClients, aws_call
from activities.metrics import EventMetrics
from activities.models import EventType, FleetEvent
from activities.webhook import WebhookSink
from contract.config import EventSettings
from contract.formats import iso, workflow_url

log = logging.getLogger(__name__)

# Entry error codes that a retry cannot fix (a malformed event or a missing permission); anything else
# (InternalFailure, ThrottlingException, ...) is retried.
PERMANENT_ENTRY_ERRORS = frozenset({"InvalidArgument", "MalformedDetail", "AccessDeniedException"})


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


def _append_line(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = line.encode()
    # One write on an O_APPEND descriptor: concurrent writers (threads, or several workers on one host) never
    # interleave within a line of this size.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        while written < len(data):  # short writes only happen on full disks or signals; finish the line
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)


class EventActivities:
    def __init__(self, aws: AwsClients, settings: EventSettings, ui_url: str | None = None) -> None:
        self._aws = aws
        self._settings = settings
        self._ui_url = ui_url
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
        # Counted on the first attempt only, and before the sinks: a retry (an EventBridge outage) must not count
        # the step twice, and a sink outage must not hide it from the metrics.
        metrics = self._metrics()
        if metrics is not None and activity.info().attempt == 1:
            self._record(metrics, event)
        # EventBridge first: its transient failures are the common retry, and retrying before the file is
        # written keeps the file free of duplicates from them.
        if self._settings.eventbridge:
            await self._put(event, text)
        if self._settings.jsonl_path is not None:
            await asyncio.to_thread(_append_line, self._settings.jsonl_path, text + "\n")
        # Last, so that an EventBridge retry does not POST the event again; it never raises.
        if self._webhook is not None:
            dropped = await self._webhook.publish(event.event_id, text.encode())
            if dropped and metrics is not None:
                metrics.webhook_dropped(len(dropped))

    @staticmethod
    def _metrics() -> EventMetrics | None:
        try:
            return EventMetrics(activity.metric_meter())
        except Exception as err:  # metrics are never worth failing an event for
            log.warning("metrics unavailable: %s", err)
            return None

    @staticmethod
    def _record(metrics: EventMetrics, event: FleetEvent) -> None:
        try:
            metrics.record(event)
        except Exception as err:
            log.warning("could not record metrics for %s event %s: %s", event.type.value, event.event_id, err)

    async def _put(self, event: FleetEvent, detail: str) -> None:
        bus = self._settings.bus_name
        resp = await aws_call(
            f"event bus {bus}",
            self._aws.events.put_events,
            Entries=[
                {
                    "EventBusName": bus,
                    "Source": self._settings.source,
                    "DetailType": event.detail_type,
                    "Detail": detail,
                    "Time": event.time,
                }
            ],
        )
        if resp.get("FailedEntryCount", 0) > 0:
            entry = (resp.get("Entries") or [{}])[0]
            code = entry.get("ErrorCode") or "PutEventsFailed"
            raise ApplicationError(
                f"events:PutEvents on event bus {bus} failed for {event.type.value} event {event.event_id}: "
                f"{code}: {entry.get('ErrorMessage', 'no message')}",
                type=code,
                non_retryable=code in PERMANENT_ENTRY_ERRORS,
            )
