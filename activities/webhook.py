"""The webhook sink, and the durable outbox every sink falls back on so that no sink ever holds up a repair.

`publish_event` tries each sink (EventBridge, the JSON-lines file, the webhook) once, with a short timeout. When that
fails, or when older events for that sink are still waiting, the event goes to the sink's outbox: one file per event
under `events.webhook_outbox_dir` (the webhook's at the top, EventBridge's and the JSON-lines file's in `eventbridge/`
and `jsonl/`, one folder per bus or file), named so that sorting the names gives the order they were queued in and
carrying the event's id, so that a retried activity does not queue it twice. A background task per sink kind in the
worker process (`activities.events.event_delivery`) sends each outbox oldest first, with backoff, and deletes each file
once the sink accepted it. An event still refused `events.outbox_deadline` after it was queued, one the sink rejects as
malformed, or the oldest of a full outbox (`webhook_outbox_max_events`) goes to the `dead-letter.jsonl` next to its
outbox, with the last error, and is counted and logged. So a slow or dead sink costs a repair at most one timeout per
event (none while a backlog waits), never fails the activity, and loses nothing silently.

Receivers must tolerate redelivery (a request that timed out may still have been processed): drop duplicates by the
`event_id` in the body or the `X-Autorepair-Event-Id` header. Order holds per worker process; with several workers,
order by the event's `time`. Every attempt carries `X-Autorepair-Timestamp`, its own Unix time in seconds; with
`webhook_secret` set, `X-Autorepair-Signature: sha256=<hex>` is the HMAC-SHA256 under the secret of the timestamp, a
`.` and the exact request body, so a receiver can reject a captured request replayed later (docs/operations.md,
"The webhook sink", shows how). Redirects are not followed (urllib would turn the POST into a body-less GET that
might answer 2xx): a 3xx is a failed attempt like any other, reported with its `Location`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.client import HTTPMessage
from pathlib import Path
from typing import IO, Any, Literal

from temporalio.common import MetricMeter

from activities.metrics import WEBHOOK_DELIVERY_FAILURES, WEBHOOK_OUTBOX_EVENTS
from contract.config import EventSettings
from contract.formats import iso

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Autorepair-Signature"
TIMESTAMP_HEADER = "X-Autorepair-Timestamp"
EVENT_ID_HEADER = "X-Autorepair-Event-Id"
EVENT_TYPE_HEADER = "X-Autorepair-Event-Type"

WEBHOOK = "webhook"
OUTBOX_SUFFIX = ".json"
DEAD_LETTER_FILE = "dead-letter.jsonl"
IDLE_POLL_SECONDS = 0.5
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 300.0

# Per sink (`sink` label: eventbridge, jsonl, webhook). Counters are per worker process, like activities/metrics.py's.
EVENTS_QUEUED = "autorepair_events_queued"
EVENT_RETRIES = "autorepair_event_retries"
EVENTS_DEAD_LETTERED = "autorepair_events_dead_lettered"
EVENT_OUTBOX_EVENTS = "autorepair_event_outbox_events"

# transient: try again later. permanent: the sink itself refuses (a deleted bus, a missing permission, a read-only
# file) until an operator fixes it; still retried until the deadline, but logged as an error. rejected: the event
# itself is refused (malformed), so no retry can help and it would block the events queued behind it.
FailureKind = Literal["transient", "permanent", "rejected"]
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The signature header's value: HMAC-SHA256 of `{timestamp}.{body}`, as Stripe and Slack sign theirs."""
    return "sha256=" + hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Refuse every redirect, so that the 3xx surfaces as an HTTPError. Followed, a 301/302/303 would resend the
    POST as a GET without its body, and a 2xx to that would count as delivered."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        return None


@dataclass(frozen=True)
class Failure:
    """Why one try at a sink failed."""

    error: str
    kind: FailureKind = "transient"


def append_line(path: Path, data: bytes, *, fsync: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # One write on an O_APPEND descriptor: concurrent writers (threads, or several workers on one host) never
    # interleave within a line of this size.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        while written < len(data):  # short writes only happen on full disks or signals; finish the line
            written += os.write(fd, data[written:])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


class OutboxMetrics:
    """The outboxes' instruments, from one meter (the activity's, or the worker's for the delivery tasks)."""

    def __init__(self, meter: MetricMeter | None) -> None:
        meter = meter or MetricMeter.noop
        self._queued = meter.create_counter(
            EVENTS_QUEUED, "Events put in an outbox by publish_event, by sink and cause (error or backlog)"
        )
        self._retries = meter.create_counter(
            EVENT_RETRIES, "Tries from an outbox, by sink and outcome (delivered, transient_error, permanent_error)"
        )
        self._dead = meter.create_counter(
            EVENTS_DEAD_LETTERED, "Events given up on, by sink and reason (deadline, rejected, outbox_full)"
        )
        self._depth = meter.create_gauge(EVENT_OUTBOX_EVENTS, "Events waiting in this worker's outboxes, by sink")

    def queued(self, sink: str, cause: str) -> None:
        self._queued.add(1, {"sink": sink, "cause": cause})

    def retried(self, sink: str, outcome: str) -> None:
        self._retries.add(1, {"sink": sink, "outcome": outcome})

    def dead_lettered(self, sink: str, reason: str, count: int = 1) -> None:
        if count:
            self._dead.add(count, {"sink": sink, "reason": reason})

    def depth(self, sink: str, count: int) -> None:
        self._depth.set(count, {"sink": sink})


def _token(event_id: str) -> str:
    """The event id as it appears in an entry's name: itself when it is a plain name, else a digest of it."""
    if _SAFE_ID.match(event_id):
        return event_id
    return hashlib.sha256(event_id.encode()).hexdigest()[:32]


class Outbox:
    """Events waiting for one sink (a webhook, an event bus, a file), one file each. The directory is the only state,
    so the activities and the delivery task need no shared object, and a restarted worker carries on where the last
    one stopped. Entries are named `<queued at, ns>-<event id>.json`."""

    def __init__(
        self, directory: Path, max_events: int, *, sink: str = WEBHOOK, dead_letters: Path | None = None
    ) -> None:
        self.directory = directory
        self.sink = sink
        self.dead_letters = dead_letters or directory / DEAD_LETTER_FILE
        self._max_events = max_events
        self._last_ns = 0

    @classmethod
    def under(cls, root: Path, max_events: int, sink: str) -> list[Outbox]:
        """The outboxes of a sink kind with one per target (a bus, a file), sharing one dead-letter file."""
        try:
            folders = sorted(e.name for e in os.scandir(root) if e.is_dir())
        except FileNotFoundError:
            return []
        return [cls(root / name, max_events, sink=sink, dead_letters=root / DEAD_LETTER_FILE) for name in folders]

    def entries(self) -> list[Path]:
        """Oldest first. Files being written (`.tmp`) are not entries yet."""
        try:
            names = sorted(e.name for e in os.scandir(self.directory) if e.name.endswith(OUTBOX_SUFFIX))
        except FileNotFoundError:
            return []
        return [self.directory / name for name in names]

    def is_empty(self) -> bool:
        return not self.entries()

    def status(self, event_id: str) -> tuple[bool, bool]:
        """(this event is waiting already, nothing is waiting)."""
        entries = self.entries()
        token = _token(event_id)
        return any(_entry_token(p.name) == token for p in entries), not entries

    def put(self, body: bytes, event_id: str | None = None) -> list[str]:
        """Queue one event durably, unless it waits already; returns the names of the oldest entries dead-lettered
        to make room (normally none)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        held, _ = self.status(event_id) if event_id else (False, False)
        if held:
            return []
        dropped: list[str] = []
        entries = self.entries()
        for oldest in entries[: max(len(entries) - self._max_events + 1, 0)]:
            old = self.read(oldest)
            if old is None:
                continue  # delivered meanwhile: that is room made too
            self.bury(oldest, old, f"outbox full ({self._max_events} events): the oldest gave way", "outbox_full")
            dropped.append(oldest.name)
        # Nanoseconds that never go backwards within this process, so names sort in the order events were queued
        # even if the wall clock is stepped back; the id (random without one) keeps names unique across processes.
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        name = f"{self._last_ns:020d}-{_token(event_id) if event_id else uuid.uuid4().hex[:12]}"
        tmp = self.directory / f"{name}.tmp"
        with open(tmp, "wb") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        # The rename makes the entry appear whole or not at all, even if the worker dies mid-write.
        os.replace(tmp, self.directory / f"{name}{OUTBOX_SUFFIX}")
        return dropped

    @staticmethod
    def read(path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    @staticmethod
    def remove(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    @staticmethod
    def queued_at(path: Path) -> float:
        """When the entry was queued (Unix seconds), from its name."""
        try:
            return int(path.name.split("-", 1)[0]) / 1e9
        except ValueError:
            return path.stat().st_mtime

    def bury(self, path: Path | None, body: bytes, error: str, reason: str) -> str:
        """Append the entry to the dead-letter file (fsynced) and remove it; returns the event's id."""
        record = dead_letter_record(self.sink, body, error, reason, self.queued_at(path) if path else None)
        append_line(self.dead_letters, json.dumps(record).encode() + b"\n", fsync=True)
        if path is not None:
            self.remove(path)
        return str(record["event_id"])


def _entry_token(name: str) -> str:
    return name.split("-", 1)[-1].removesuffix(OUTBOX_SUFFIX)


def dead_letter_record(sink: str, body: bytes, error: str, reason: str, queued_at: float | None) -> dict[str, Any]:
    """One line of a dead-letter file: what was given up on, why, and the event, whole, to replay it by hand."""
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = body.decode("utf-8", "replace")
    # EventBridge's and the JSON-lines file's entries say where the event was going; the webhook's are the event.
    wrapped = isinstance(parsed, dict) and "event" in parsed and "target" in parsed
    event = parsed["event"] if wrapped else parsed
    return {
        "dead_lettered_at": iso(datetime.now(UTC)),
        "sink": sink,
        "reason": reason,
        "error": error,
        "event_id": event.get("event_id", "") if isinstance(event, dict) else "",
        "queued_at": iso(datetime.fromtimestamp(queued_at, UTC)) if queued_at is not None else None,
        "target": parsed["target"] if wrapped else None,
        "event": event,
    }


async def deliver_or_queue(
    outbox: Outbox,
    event_id: str,
    entry: bytes,
    attempt: Callable[[], Awaitable[Failure | None]],
    metrics: OutboxMetrics,
) -> list[str]:
    """The activity's side of every sink: one quick try, else the outbox. Returns the names of entries dead-lettered
    to make room (normally none). Raises OSError only when the event cannot be kept (a broken disk)."""
    sink = outbox.sink
    held, empty = await asyncio.to_thread(outbox.status, event_id)
    if held:
        return []  # an earlier attempt of this activity queued it
    cause = "backlog"
    # Behind a backlog the event queues too: sent directly it would overtake the older ones.
    if empty:
        failure = await attempt()
        if failure is None:
            return []
        if failure.kind == "rejected":
            await asyncio.to_thread(outbox.bury, None, entry, failure.error, "rejected")
            metrics.dead_lettered(sink, "rejected")
            log.error(
                "%s refused event %s, dead-lettered to %s: %s", sink, event_id, outbox.dead_letters, failure.error
            )
            return []
        cause = f"{failure.kind}_error"
        level = logging.ERROR if failure.kind == "permanent" else logging.WARNING
        log.log(level, "%s delivery of event %s failed, queued for retry: %s", sink, event_id, failure.error)
    dropped = await asyncio.to_thread(outbox.put, entry, event_id)
    metrics.queued(sink, cause)
    for name in dropped:
        log.warning(
            "%s outbox %s full: dropped the oldest event %s to %s", sink, outbox.directory, name, outbox.dead_letters
        )
    metrics.dead_lettered(sink, "outbox_full", len(dropped))
    return dropped


class WebhookClient:
    def __init__(self, settings: EventSettings) -> None:
        assert settings.webhook_url is not None
        self._url = settings.webhook_url
        self._secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret else None
        self._timeout = settings.webhook_timeout.total_seconds()
        self._opener = urllib.request.build_opener(_NoRedirects)

    async def post(self, body: bytes) -> str | None:
        """One attempt, bounded by the timeout as a whole; None on success, else why it failed."""
        try:
            # urllib's timeout bounds each socket operation, not the request; wait_for bounds the request. A thread
            # left behind by wait_for ends at its own socket timeout.
            return await asyncio.wait_for(asyncio.to_thread(self._post_blocking, body), self._timeout)
        except TimeoutError:
            return f"no answer within {self._timeout:g}s"

    def _post_blocking(self, body: bytes) -> str | None:
        try:
            head = json.loads(body)
        except ValueError:
            head = {}
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "gpu-autorepair",
            EVENT_ID_HEADER: str(head.get("event_id", "")),
            EVENT_TYPE_HEADER: str(head.get("type", "")),
        }
        # The time of this attempt, not of the event: a redelivery hours later is signed afresh and still passes a
        # receiver's freshness check, while a captured request replayed later does not.
        timestamp = str(int(time.time()))
        headers[TIMESTAMP_HEADER] = timestamp
        if self._secret is not None:
            headers[SIGNATURE_HEADER] = sign(self._secret, timestamp, body)
        request = urllib.request.Request(self._url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=self._timeout) as response:
                response.read()
                status = int(response.status)
        except urllib.error.HTTPError as err:
            err.close()
            if 300 <= err.code < 400:
                location = err.headers.get("Location") if err.headers is not None else None
                return (
                    f"HTTP {err.code} {err.reason}, a redirect to {location!r}: redirects are not followed, point "
                    f"events.webhook_url at the receiver itself"
                )
            return f"HTTP {err.code} {err.reason}"
        except Exception as err:
            # Refused, reset, DNS, TLS, a socket timeout, a garbled answer (http.client.HTTPException): whatever
            # went wrong with one attempt, the answer is the same, queue the event and try again later.
            return f"{type(err).__name__}: {err}"
        return None if 200 <= status < 300 else f"HTTP {status}"


class WebhookSink:
    """The activity's side: one quick try, else the outbox. A webhook must not hold up a repair."""

    def __init__(self, settings: EventSettings) -> None:
        self._client = WebhookClient(settings)
        self._outbox = Outbox(settings.webhook_outbox_dir, settings.webhook_outbox_max_events)

    async def publish(self, event_id: str, body: bytes, metrics: OutboxMetrics | None = None) -> list[str]:
        """Returns the outbox entries dead-lettered to make room (normally none)."""

        async def attempt() -> Failure | None:
            error = await self._client.post(body)
            return None if error is None else Failure(error)

        return await deliver_or_queue(self._outbox, event_id, body, attempt, metrics or OutboxMetrics(None))


@dataclass(frozen=True)
class DrainTiming:
    idle_poll: float = IDLE_POLL_SECONDS
    first_backoff: float = FIRST_BACKOFF_SECONDS
    max_backoff: float = MAX_BACKOFF_SECONDS


class OutboxSender:
    """The delivery task's side of one sink kind: which outboxes it has, and one try at sending an entry."""

    sink: str

    def queues(self) -> list[Outbox]:
        raise NotImplementedError

    async def send(self, body: bytes) -> Failure | None:
        raise NotImplementedError

    def observe(self, depth: int, failed: bool) -> None:
        """After each round (`depth` entries waiting) or failed try; for a sink's own older metrics."""


class WebhookSender(OutboxSender):
    sink = WEBHOOK

    def __init__(self, settings: EventSettings, meter: MetricMeter) -> None:
        self._outbox = Outbox(settings.webhook_outbox_dir, settings.webhook_outbox_max_events)
        self._client = WebhookClient(settings)
        self._depth = meter.create_gauge(WEBHOOK_OUTBOX_EVENTS, "Events waiting in the webhook outbox of this worker")
        self._failures = meter.create_counter(WEBHOOK_DELIVERY_FAILURES, "Failed webhook deliveries from the outbox")

    def queues(self) -> list[Outbox]:
        return [self._outbox]

    async def send(self, body: bytes) -> Failure | None:
        error = await self._client.post(body)
        return None if error is None else Failure(error)

    def observe(self, depth: int, failed: bool) -> None:
        if failed:
            self._failures.add(1)
        else:
            self._depth.set(depth)


@dataclass
class _Queue:
    """The delivery task's memory of one outbox: when to try it next, and what the sink last said."""

    backoff: float
    next_try: float = 0.0
    last_failure: Failure | None = field(default=None)


async def drain(sender: OutboxSender, deadline: float, metrics: OutboxMetrics, timing: DrainTiming) -> None:
    """Send every outbox of a sink kind oldest first until cancelled; a failing outbox waits (doubling) and starts
    again from its oldest, without holding up the sink kind's other outboxes (another bus, another file)."""
    queues: dict[Path, _Queue] = {}
    loop = asyncio.get_running_loop()
    error_backoff = timing.first_backoff
    while True:
        try:
            depth = 0
            for outbox in await asyncio.to_thread(sender.queues):
                queue = queues.setdefault(outbox.directory, _Queue(backoff=timing.first_backoff))
                if loop.time() >= queue.next_try:
                    await _drain_one(sender, outbox, queue, deadline, metrics, timing)
                depth += len(await asyncio.to_thread(outbox.entries))
            metrics.depth(sender.sink, depth)
            sender.observe(depth, failed=False)
            error_backoff = timing.first_backoff
        except OSError as err:
            # A full disk or a permission problem: keep the task alive and keep trying, loudly.
            log.error("%s outbox under %s: %s", sender.sink, getattr(err, "filename", None) or "?", err)
            await asyncio.sleep(error_backoff)
            error_backoff = min(error_backoff * 2, timing.max_backoff)
            continue
        await asyncio.sleep(timing.idle_poll)


async def _drain_one(
    sender: OutboxSender, outbox: Outbox, queue: _Queue, deadline: float, metrics: OutboxMetrics, timing: DrainTiming
) -> None:
    sink = sender.sink
    entries = await asyncio.to_thread(outbox.entries)
    for path in entries:
        body = await asyncio.to_thread(outbox.read, path)
        if body is None:
            continue  # dead-lettered to make room since the listing
        expired = time.time() - outbox.queued_at(path) >= deadline
        if expired and queue.last_failure is not None:
            # The sink is still refusing (nothing got through since it last did): no need to ask it again.
            await _bury(outbox, path, body, queue.last_failure, "deadline", metrics)
            continue
        failure = await sender.send(body)
        if failure is None:
            await asyncio.to_thread(outbox.remove, path)
            metrics.retried(sink, "delivered")
            queue.backoff, queue.last_failure = timing.first_backoff, None
            continue
        sender.observe(len(entries), failed=True)
        if failure.kind == "rejected":
            # This event, not the sink: it says nothing about the events behind it, which are tried at once.
            metrics.retried(sink, "rejected")
            await _bury(outbox, path, body, failure, "rejected", metrics)
            continue
        queue.last_failure = failure
        metrics.retried(sink, f"{failure.kind}_error")
        if expired:
            await _bury(outbox, path, body, failure, "deadline", metrics)
            continue
        level = logging.ERROR if failure.kind == "permanent" else logging.WARNING
        log.log(
            level,
            "%s delivery from outbox failed (%d waiting), next try in %gs: %s",
            sink,
            len(entries),
            queue.backoff,
            failure.error,
        )
        queue.next_try = asyncio.get_running_loop().time() + queue.backoff
        queue.backoff = min(queue.backoff * 2, timing.max_backoff)
        return


async def _bury(outbox: Outbox, path: Path, body: bytes, failure: Failure, reason: str, metrics: OutboxMetrics) -> None:
    event_id = await asyncio.to_thread(outbox.bury, path, body, failure.error, reason)
    metrics.dead_lettered(outbox.sink, reason)
    log.error(
        "%s gave up on event %s (%s), dead-lettered to %s; last error: %s",
        outbox.sink,
        event_id,
        "past events.outbox_deadline" if reason == "deadline" else "refused as malformed",
        outbox.dead_letters,
        failure.error,
    )


@asynccontextmanager
async def draining(
    senders: Sequence[OutboxSender], settings: EventSettings, meter: MetricMeter | None, timing: DrainTiming
) -> AsyncIterator[None]:
    """One delivery task per sink kind while the worker runs. What is left at shutdown stays on disk for the next
    start."""
    metrics = OutboxMetrics(meter)
    deadline = settings.outbox_deadline.total_seconds()
    tasks = [
        asyncio.create_task(drain(sender, deadline, metrics, timing), name=f"{sender.sink} outbox delivery")
        for sender in senders
    ]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
