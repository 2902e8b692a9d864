"""One try at each event sink: Amazon EventBridge, a JSON-lines file, the webhook. Each answers None (taken) or a
Failure that says whether trying again later can help; none retries by itself (the event outbox is the retry)."""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

from activities.aws import AwsCalls
from activities.errors import application_error
from activities.webhook import WebhookClient
from contract.aws_session import new_session
from contract.config import AwsSettings, EventSettings
from contract.event_outbox import Failure, OutboxEntry, Sink, SinkTarget

if TYPE_CHECKING:
    from mypy_boto3_events import EventBridgeClient

# Entry error codes that say the event itself is malformed: no retry can help, so it is dead-lettered at once rather
# than blocking the events queued behind it. Any other entry error (InternalFailure, ThrottlingException, ...) is
# retried from the outbox.
REJECTED_ENTRY_ERRORS = frozenset({"InvalidArgument", "MalformedDetail"})
PERMANENT_ENTRY_ERRORS = frozenset({"AccessDeniedException", "NotAuthorizedForSourceException"})
# A file that cannot be written until someone changes the disk, its mount or its permissions.
PERMANENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR, errno.ENOTDIR})


def append_line(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # One write on an O_APPEND descriptor: concurrent writers (threads, or several workers on one host) never
    # interleave within a line of this size.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        while written < len(data):  # short writes only happen on full disks or signals; finish the line
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)


def events_client(target: SinkTarget, timeout: float) -> EventBridgeClient:
    """A client that tries once and waits `timeout` at most per connection step: the outbox is the retry."""
    session = new_session(target.region)
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
    """PutEvents once. The client is `self._aws.events`, as in the other activities, so that the check of the worker's
    IAM policy (tests/test_deploy_files.py) finds the call."""

    def __init__(self, target: SinkTarget, timeout: float) -> None:
        self._aws = _EventsOnly(events=events_client(target, timeout))

    def put(self, target: SinkTarget, entry: OutboxEntry) -> Failure | None:
        bus = target.bus_name or "default"
        call, resource = "events:PutEvents", f"event bus {bus}"
        try:
            resp = self._aws.events.put_events(
                Entries=[
                    {
                        "EventBusName": bus,
                        "Source": target.source or "gpu-autorepair",
                        "DetailType": entry.detail_type,
                        "Detail": json.dumps(entry.event),
                        "Time": entry.time,
                    }
                ]
            )
        except ClientError as err:
            # A deleted bus or a missing permission is permanent until an operator acts; throttling and 5xx are not.
            failed = application_error(err, call, resource)
            return Failure(error=failed.message, kind="permanent" if failed.non_retryable else "transient")
        except ParamValidationError as err:
            return Failure(
                error=" ".join(f"{call} on {resource} failed: invalid parameters: {err}".split()), kind="rejected"
            )
        except BotoCoreError as err:  # a timeout, a refused connection, a garbled answer
            return Failure(error=f"{call} on {resource} failed: {type(err).__name__}: {err}")
        if resp.get("FailedEntryCount", 0) > 0:
            failed_entry = (resp.get("Entries") or [{}])[0]
            code = failed_entry.get("ErrorCode") or "PutEventsFailed"
            message = f"{call} on {resource} failed for event {entry.event_id}: {code}: " + str(
                failed_entry.get("ErrorMessage", "no message")
            )
            if code in REJECTED_ENTRY_ERRORS:
                return Failure(error=message, kind="rejected")
            return Failure(error=message, kind="permanent" if code in PERMANENT_ENTRY_ERRORS else "transient")
        return None


def append_event(path: Path, entry: OutboxEntry) -> Failure | None:
    try:
        append_line(path, json.dumps(entry.event).encode() + b"\n")
    except OSError as err:
        permanent = err.errno in PERMANENT_ERRNOS
        return Failure(error=f"appending to {path} failed: {err}", kind="permanent" if permanent else "transient")
    return None


class SinkTries:
    """The sinks the settings turn on, as targets, and one try at any target (one a previous configuration named
    included: its events still say where they were going)."""

    def __init__(self, aws: AwsSettings, settings: EventSettings, calls: AwsCalls) -> None:
        self._settings = settings
        self._calls = calls
        self._timeout = settings.sink_timeout.total_seconds()
        self.targets: list[SinkTarget] = []
        if settings.eventbridge:
            self.targets.append(
                SinkTarget(
                    sink=Sink.EVENTBRIDGE,
                    region=aws.region,
                    endpoint_url=aws.endpoint_url,
                    bus_name=settings.bus_name,
                    source=settings.source,
                )
            )
        if settings.jsonl_path is not None:
            self.targets.append(SinkTarget(sink=Sink.JSONL, path=str(settings.jsonl_path)))
        self._webhook = WebhookClient(settings, calls) if settings.webhook_url else None
        if self._webhook is not None:
            self.targets.append(SinkTarget(sink=Sink.WEBHOOK))
        # One client per region and endpoint, made on first use and kept: a client costs tens of milliseconds.
        self._buses: dict[tuple[str | None, str | None], EventBridgeTry] = {}

    async def attempt(self, target: SinkTarget, entry: OutboxEntry, body: bytes | None = None) -> Failure | None:
        """One try; `body` is the webhook's exact bytes when the caller has them (else the entry's event, dumped)."""
        if target.sink is Sink.EVENTBRIDGE:
            key = (target.region, target.endpoint_url)
            if key not in self._buses:
                self._buses[key] = await self._calls.run("events:client", EventBridgeTry, target, self._timeout)
            put = self._buses[key]
            what, api = f"events:PutEvents on {target.label()}", "events:PutEvents"
            return await self._bounded(what, api, functools.partial(put.put, target, entry))
        if target.sink is Sink.JSONL:
            path = Path(target.path or "")
            append = functools.partial(append_event, path, entry)
            return await self._bounded(f"appending to {path}", "jsonl:append", append)
        if self._webhook is None:
            return Failure(
                error="events.webhook_url is not set on this worker: its events wait for one that has it",
                kind="permanent",
            )
        error = await self._webhook.post(body if body is not None else json.dumps(entry.event).encode())
        return None if error is None else Failure(error=error)

    async def _bounded(self, what: str, api: str, call: Callable[[], Failure | None]) -> Failure | None:
        """One try on the worker's call threads (never asyncio's default executor: min(32, cpus + 4) threads, which a
        burst of events at a correlated failure queued past the timeout), waited on for sink_timeout at most, its wait
        for a thread included. A call left running may still get through: at least once; one still queued never
        starts."""
        try:
            return await asyncio.wait_for(self._calls.run(api, call), self._timeout)
        except TimeoutError:
            return Failure(error=f"{what}: no answer within {self._timeout:g}s")
