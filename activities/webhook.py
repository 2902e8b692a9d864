"""The webhook sink, for teams without EventBridge: POST each event's JSON line, at least once, oldest first.

`publish_event` tries the webhook once with a short timeout. When that fails, or when older events are still waiting,
the event goes to a durable outbox: one file per event (its JSON line) under `events.webhook_outbox_dir`, named so
that sorting the names gives the order they were queued in. A background task in the worker process
(`webhook_delivery`) sends the outbox oldest first, with backoff, and deletes each file once the receiver accepted it
(any 2xx). So a slow or dead receiver costs a repair at most one timeout per event (none while a backlog waits), never
fails the activity, and loses nothing unless the outbox is full (`webhook_outbox_max_events`: the oldest event gives
way, and a warning says which).

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
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http.client import HTTPMessage
from pathlib import Path
from typing import IO

from temporalio.common import MetricMeter

from activities.metrics import WEBHOOK_DELIVERY_FAILURES, WEBHOOK_OUTBOX_EVENTS
from contract.config import EventSettings

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Autorepair-Signature"
TIMESTAMP_HEADER = "X-Autorepair-Timestamp"
EVENT_ID_HEADER = "X-Autorepair-Event-Id"
EVENT_TYPE_HEADER = "X-Autorepair-Event-Type"

OUTBOX_SUFFIX = ".json"
IDLE_POLL_SECONDS = 0.5
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 300.0


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


class Outbox:
    """Events waiting for the webhook, one file each. The directory is the only state, so the activities and the
    delivery task need no shared object, and a restarted worker carries on where the last one stopped."""

    def __init__(self, directory: Path, max_events: int) -> None:
        self.directory = directory
        self._max_events = max_events
        self._last_ns = 0

    def entries(self) -> list[Path]:
        """Oldest first. Files being written (`.tmp`) are not entries yet."""
        try:
            names = sorted(e.name for e in os.scandir(self.directory) if e.name.endswith(OUTBOX_SUFFIX))
        except FileNotFoundError:
            return []
        return [self.directory / name for name in names]

    def is_empty(self) -> bool:
        return not self.entries()

    def put(self, body: bytes) -> list[str]:
        """Queue one event durably; returns the names of the oldest entries dropped to make room."""
        self.directory.mkdir(parents=True, exist_ok=True)
        dropped: list[str] = []
        entries = self.entries()
        for oldest in entries[: max(len(entries) - self._max_events + 1, 0)]:
            with contextlib.suppress(FileNotFoundError):  # delivered meanwhile: that is room made too
                oldest.unlink()
                dropped.append(oldest.name)
        # Nanoseconds that never go backwards within this process, so names sort in the order events were queued
        # even if the wall clock is stepped back; the random tail keeps names unique across processes.
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        name = f"{self._last_ns:020d}-{uuid.uuid4().hex[:12]}"
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
    """The activity's side: one quick try, else the outbox. Never raises: a webhook must not hold up a repair."""

    def __init__(self, settings: EventSettings) -> None:
        self._client = WebhookClient(settings)
        self._outbox = Outbox(settings.webhook_outbox_dir, settings.webhook_outbox_max_events)

    async def publish(self, event_id: str, body: bytes) -> list[str]:
        """Returns the outbox entries dropped to make room (normally none)."""
        try:
            # Behind a backlog the event queues too: sent directly it would overtake the older ones.
            if await asyncio.to_thread(self._outbox.is_empty):
                error = await self._client.post(body)
                if error is None:
                    return []
                log.warning("webhook delivery of event %s failed, queued for retry: %s", event_id, error)
            dropped = await asyncio.to_thread(self._outbox.put, body)
        except OSError as err:
            log.error("webhook outbox %s unusable, event %s not queued: %s", self._outbox.directory, event_id, err)
            return []
        for name in dropped:
            log.warning("webhook outbox %s full: dropped the oldest event %s", self._outbox.directory, name)
        return dropped


async def deliver_outbox(
    settings: EventSettings,
    meter: MetricMeter | None = None,
    *,
    idle_poll: float = IDLE_POLL_SECONDS,
    first_backoff: float = FIRST_BACKOFF_SECONDS,
    max_backoff: float = MAX_BACKOFF_SECONDS,
) -> None:
    """Send the outbox oldest first until cancelled; on a failure, wait (doubling) and start again from the oldest."""
    outbox = Outbox(settings.webhook_outbox_dir, settings.webhook_outbox_max_events)
    client = WebhookClient(settings)
    meter = meter or MetricMeter.noop
    depth = meter.create_gauge(WEBHOOK_OUTBOX_EVENTS, "Events waiting in the webhook outbox of this worker")
    failures = meter.create_counter(WEBHOOK_DELIVERY_FAILURES, "Failed webhook deliveries from the outbox")
    backoff = first_backoff
    while True:
        try:
            entries = await asyncio.to_thread(outbox.entries)
            depth.set(len(entries))
            if not entries:
                await asyncio.sleep(idle_poll)
                continue
            for path in entries:
                body = await asyncio.to_thread(outbox.read, path)
                if body is None:
                    continue  # dropped to make room since the listing
                error = await client.post(body)
                if error is not None:
                    failures.add(1)
                    log.warning(
                        "webhook delivery from outbox failed (%d waiting), next try in %gs: %s",
                        len(entries),
                        backoff,
                        error,
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, max_backoff)
                    break
                await asyncio.to_thread(outbox.remove, path)
                backoff = first_backoff
        except OSError as err:
            # A full disk or a permission problem: keep the task alive and keep trying, loudly.
            log.error("webhook outbox %s: %s", outbox.directory, err)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_backoff)


@asynccontextmanager
async def webhook_delivery(
    settings: EventSettings,
    meter: MetricMeter | None = None,
    *,
    idle_poll: float = IDLE_POLL_SECONDS,
    first_backoff: float = FIRST_BACKOFF_SECONDS,
    max_backoff: float = MAX_BACKOFF_SECONDS,
) -> AsyncIterator[None]:
    """Run the outbox delivery task while the worker runs (a no-op without a webhook). What is left in the outbox
    at shutdown stays on disk for the next start."""
    if not settings.webhook_url:
        yield
        return
    task = asyncio.create_task(
        deliver_outbox(settings, meter, idle_poll=idle_poll, first_backoff=first_backoff, max_backoff=max_backoff),
        name="webhook outbox delivery",
    )
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
