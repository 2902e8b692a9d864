"""The webhook sink against a real HTTP receiver on loopback that fails, hangs or is absent before it accepts.

What must hold: publish_event returns within the webhook timeout whatever the receiver does, and every event reaches
the receiver, in order, at least once (the receiver drops redeliveries by event_id, as the docs tell it to). The
receiver verifies every request as docs/operations.md ("The webhook sink") tells receivers to: a signature over the
timestamp and the body, a fresh timestamp, event ids seen within the window dropped; so a tampered or replayed request
is refused. A redirect is never followed, and never counts as a delivery.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from pydantic import SecretStr
from temporalio.client import Client
from temporalio.runtime import Runtime

from activities.metrics import EVENT_RETRIES
from activities.webhook import EVENT_ID_HEADER, EVENT_TYPE_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from contract.config import AwsSettings, EventSettings
from contract.event_outbox import Sink, SinkTarget
from simulator.servers import free_port
from tests.harness import eventually
from tests.outbox_harness import Publisher, events, metered_client, metric, prometheus_runtime, publisher

__all__ = ["prometheus_runtime"]  # a fixture, used by name

SECRET = "webhook-test-secret"
TIMEOUT = timedelta(seconds=0.5)
# A publish may take the webhook timeout plus the thread hop and the outbox's fsync, never the receiver's slowness.
# The bound tells those two apart, not how fast this machine is: the margin is wide because a loaded 2-core CI
# runner once took 0.57 s over the timeout, and SLOW sits far above it.
PROMPT = TIMEOUT.total_seconds() + 3.0
SLOW = 10.0
TOLERANCE = 300  # seconds, as the docs recommend


# The receiver's side, as the docs' example has it; the clock is a parameter here so that a test can move it.
def verify(secret: bytes, headers: Message, body: bytes, now: float) -> int | None:
    """The request's timestamp if it is signed with `secret` and fresh, else None."""
    timestamp = headers.get(TIMESTAMP_HEADER, "")
    expected = "sha256=" + hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected.encode(), headers.get(SIGNATURE_HEADER, "").encode()):
        return None  # not signed with our secret, or body or timestamp changed on the way
    if abs(now - int(timestamp)) > TOLERANCE:
        return None  # too old (a replay) or too far ahead
    return int(timestamp)


class Receiver:
    """Answers the first valid requests as `script` says (ok, fail, drop, slow-ok, slow-fail), then accepts everything.
    Every request is verified first (`verify`, then duplicates dropped by the event id in the body, as the docs say);
    one that fails verification is answered 401 and counted in `rejected`. An event counts as received when the
    receiver decides to accept it, on arrival, as a real one would store it before answering; so a slow-ok is received
    even though its sender gave up waiting. `handled` has each event once: what a receiver acts on."""

    def __init__(self, port: int, script: list[str]) -> None:
        self.port = port
        self.script = deque(script)
        self.received: list[dict[str, Any]] = []
        self.handled: list[dict[str, Any]] = []
        self.captured: list[tuple[Message, bytes]] = []  # every POST as it came, to replay
        self.seen: dict[str, int] = {}  # event id -> newest verified timestamp
        self.clock_offset = 0.0  # seconds added to the receiver's clock
        self.requests = 0
        self.rejected = 0
        self.bad_event_id_headers = 0
        self.not_posts = 0  # a GET, say: what a followed redirect turns the POST into
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.requests += 1
                    receiver.captured.append((self.headers, body))
                    now = time.time() + receiver.clock_offset
                    timestamp = verify(SECRET.encode(), self.headers, body, now)
                    if timestamp is None:
                        receiver.rejected += 1
                        action = "reject"
                    else:
                        action = receiver.script.popleft() if receiver.script else "ok"
                        event = json.loads(body)
                        if self.headers[EVENT_ID_HEADER] != event["event_id"]:
                            receiver.bad_event_id_headers += 1
                        if action in ("ok", "slow-ok"):
                            receiver.received.append(event)
                            for old in [i for i, t in receiver.seen.items() if t + TOLERANCE < now]:
                                del receiver.seen[old]
                            if event["event_id"] not in receiver.seen:  # else a replay or a redelivery
                                receiver.handled.append(event)
                            receiver.seen[event["event_id"]] = max(receiver.seen.get(event["event_id"], 0), timestamp)
                if action == "drop":
                    self.close_connection = True
                    return
                if action.startswith("slow"):
                    time.sleep(SLOW)
                self.send_response(401 if action == "reject" else 200 if action.endswith("ok") else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                with receiver.lock:
                    receiver.not_posts += 1
                self.send_response(200)  # the trap: a sender that followed a redirect would call this delivered
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_HEAD = do_PUT = do_DELETE = do_GET

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        # A sender that gave up on a slow answer closed its socket; the broken pipe is expected, not news.
        self.server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        self.server.daemon_threads = True

    def ids(self) -> list[str]:
        """Received event ids, redeliveries dropped, in the order of first arrival."""
        with self.lock:
            return list(dict.fromkeys(e["event_id"] for e in self.received))

    def timestamps(self) -> list[int]:
        with self.lock:
            return [int(headers[TIMESTAMP_HEADER]) for headers, _ in self.captured]


@contextmanager
def receiving(port: int, script: list[str]) -> Iterator[Receiver]:
    receiver = Receiver(port, script)
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


@contextmanager
def redirecting(port: int, status: int, location: str) -> Iterator[list[str]]:
    """A receiver at the wrong address: answers every request `status` with `location`; yields the methods it got."""
    methods: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            methods.append(self.command)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = do_PUT = do_POST

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield methods
    finally:
        server.shutdown()
        server.server_close()


def post(port: int, headers: dict[str, str], body: bytes) -> int:
    """Send a request as a replaying attacker would, with the given headers; returns the status."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/autorepair", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        err.close()
        return err.code


WEBHOOK = SinkTarget(sink=Sink.WEBHOOK)


def webhook_settings(port: int, max_events: int = 1_000) -> EventSettings:
    return EventSettings(
        eventbridge=False,
        webhook_url=f"http://127.0.0.1:{port}/autorepair",
        webhook_secret=SecretStr(SECRET),
        webhook_timeout=TIMEOUT,
        outbox_max_events=max_events,
    )


def webhook_of(client: Client, port: int, max_events: int = 1_000) -> Publisher:
    # EventBridge is off: AWS is never called.
    return publisher(client, AwsSettings(region="us-east-1"), webhook_settings(port, max_events))


async def ended(events_of: Publisher) -> Any:
    """The webhook outbox's last view, once it ended (nothing left waiting)."""
    view, _ = await eventually(lambda: events_of.outbox(WEBHOOK), lambda found: not found[1], within=60)
    return view


async def test_failing_then_slow_receiver_gets_every_event_in_order_and_publish_stays_prompt(client: Client) -> None:
    port = free_port()
    events_of = webhook_of(client, port)
    batch = events(12, instance_ids=True)
    # The first event's own try meets a slow receiver that stores it but answers too late; redeliveries from the
    # outbox then meet a refusal, a dropped connection and another slow answer before the receiver recovers.
    with receiving(port, ["slow-ok", "fail", "drop", "slow-fail", "fail"]) as receiver:
        async with events_of.outbox_worker():
            took = await events_of.publish(batch)
            await eventually(lambda: asyncio.sleep(0, receiver.ids()), lambda ids: len(ids) == len(batch), within=120)
            view = await ended(events_of)

    assert max(took) < PROMPT, took
    assert receiver.ids() == [e.event_id for e in batch]
    # At least once: the slow receiver's copy of the first event and its redelivery both arrived.
    assert [e["event_id"] for e in receiver.received[:2]] == [batch[0].event_id] * 2
    assert receiver.rejected == 0 and receiver.bad_event_id_headers == 0
    # Each event acted on once, the first one's redelivery dropped as a duplicate.
    assert [e["event_id"] for e in receiver.handled] == [e.event_id for e in batch]
    assert receiver.received[0]["type"] == "RepairStarted" and receiver.received[0]["detail"]["reason"] == "XID_79"
    assert view.delivered == len(batch) and view.dead_letters == []


async def test_events_published_while_no_worker_runs_wait_in_temporal_and_the_next_worker_sends_them(
    client: Client,
) -> None:
    port = free_port()  # nothing listens here yet: connection refused
    events_of = webhook_of(client, port)
    batch = events(5, instance_ids=True)
    # No worker runs the outbox (they all died): the events wait in Temporal, on no worker's disk.
    took = await events_of.publish(batch)
    assert max(took) < PROMPT, took

    # Any worker that starts later sends what waited.
    with receiving(port, []) as receiver:
        async with events_of.outbox_worker():
            await eventually(lambda: asyncio.sleep(0, receiver.ids()), lambda ids: len(ids) == 5, within=60)
            view = await ended(events_of)
    assert receiver.ids() == [e.event_id for e in batch]
    assert len(receiver.received) == 5 and view.delivered == 5


async def test_a_hanging_receiver_costs_one_timeout_then_events_queue_behind_it(client: Client) -> None:
    port = free_port()
    events_of = webhook_of(client, port)
    batch = events(4, instance_ids=True)
    with receiving(port, ["slow-fail"] * 10) as receiver:
        took = await events_of.publish(batch)
        # Only the first event waited for the receiver, one timeout and not its slowness; the rest went straight
        # behind it into the outbox without a request of their own.
        assert TIMEOUT.total_seconds() <= took[0] < PROMPT, took
        assert max(took[1:]) < PROMPT, took
        assert receiver.requests == 1
        async with events_of.outbox_worker():
            assert await events_of.waiting_ids(WEBHOOK) == [e.event_id for e in batch]


async def test_a_full_outbox_drops_the_oldest_and_says_so(client: Client, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    events_of = webhook_of(client, port, max_events=3)
    batch = events(5, instance_ids=True)
    await events_of.publish(batch)
    with caplog.at_level(logging.ERROR, logger="activities.events"), receiving(port, []) as receiver:
        async with events_of.outbox_worker():
            await eventually(lambda: asyncio.sleep(0, receiver.ids()), lambda ids: len(ids) == 3, within=60)
            view = await ended(events_of)
    assert receiver.ids() == [e.event_id for e in batch[2:]]
    assert [(d.entry.event_id, d.reason) for d in view.dead_letters] == [(e.event_id, "outbox_full") for e in batch[:2]]
    assert len([r for r in caplog.records if "dead-lettered (outbox_full)" in r.getMessage()]) == 2


def test_webhook_settings_validate() -> None:
    with pytest.raises(ValueError):
        EventSettings(webhook_url="ftp://example.com/hook")
    with pytest.raises(ValueError):
        EventSettings(webhook_url="https://example.com/hook", webhook_timeout=timedelta(0))
    parsed = EventSettings.model_validate({"webhook_url": "https://example.com/hook", "webhook_timeout": "PT3S"})
    assert parsed.webhook_timeout == timedelta(seconds=3)
    assert parsed.webhook_secret is None


async def test_a_receiver_verifying_as_documented_accepts_a_delivery_and_refuses_tampered_or_replayed_copies(
    client: Client,
) -> None:
    port = free_port()
    events_of = webhook_of(client, port)
    [event] = events(1)
    with receiving(port, []) as receiver:
        before = int(time.time())
        took = await events_of.publish([event])
        after = int(time.time())
        assert max(took) < PROMPT, took
        assert receiver.rejected == 0 and [e["event_id"] for e in receiver.handled] == [event.event_id]
        [(captured, body)] = receiver.captured
        timestamp = captured[TIMESTAMP_HEADER]
        assert before <= int(timestamp) <= after
        assert captured[SIGNATURE_HEADER] == sign(SECRET, timestamp, body)
        names = (TIMESTAMP_HEADER, SIGNATURE_HEADER, EVENT_ID_HEADER, EVENT_TYPE_HEADER, "Content-Type")
        sent = {name: captured[name] for name in names}

        def replay(headers: dict[str, str], data: bytes = body) -> Any:
            return asyncio.to_thread(post, port, headers, data)

        # Replayed at once, the request is signed and fresh, but its event was handled already: answered 200 (so a
        # genuine redelivery does not hold up the outbox) and not acted on again, whatever the unsigned id header says.
        assert await replay(sent) == 200
        assert await replay({**sent, EVENT_ID_HEADER: "evt-not-seen-yet"}) == 200
        assert [e["event_id"] for e in receiver.handled] == [event.event_id]

        changed = body.replace(b"XID_79", b"XID_48")
        assert changed != body
        assert await replay(sent, changed) == 401
        assert await replay({**sent, TIMESTAMP_HEADER: str(int(timestamp) + 1)}) == 401
        assert await replay({**sent, TIMESTAMP_HEADER: str(int(timestamp) - 1)}) == 401
        assert await replay({k: v for k, v in sent.items() if k != SIGNATURE_HEADER}) == 401
        assert await replay({**sent, SIGNATURE_HEADER: sign("another-secret", timestamp, body)}) == 401

        # Well signed but stale or from the future: refused even for an event never seen.
        [other] = events(1)
        other_body = other.model_dump_json().encode()
        for skew in (-TOLERANCE - 5, TOLERANCE + 5):
            stamp = str(int(time.time()) + skew)
            headers = {**sent, TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: sign(SECRET, stamp, other_body)}
            assert await replay(headers, other_body) == 401
        assert receiver.rejected == 7

        # The captured request replayed once the tolerance has passed (the receiver's clock moved on).
        receiver.clock_offset = TOLERANCE + 1
        assert await replay(sent) == 401
        assert receiver.rejected == 8
        assert [e["event_id"] for e in receiver.handled] == [event.event_id]


async def test_each_attempt_is_signed_with_its_own_time(client: Client) -> None:
    port = free_port()
    events_of = webhook_of(client, port)
    [event] = events(1)
    # The event's own try and the outbox's first are refused; the outbox's second, a second later, gets in.
    with receiving(port, ["fail", "fail"]) as receiver:
        async with events_of.outbox_worker():
            await events_of.publish([event])
            await eventually(
                lambda: asyncio.sleep(0, receiver.ids()), lambda ids: ids == [event.event_id], within=60, every=0.1
            )
    stamps = receiver.timestamps()
    assert len(stamps) == 3 and receiver.rejected == 0, stamps
    assert stamps[0] <= stamps[1] < stamps[2], stamps


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_a_redirect_is_a_failed_delivery_and_the_event_waits_for_the_right_url(
    client: Client, caplog: pytest.LogCaptureFixture, prometheus_runtime: tuple[Runtime, int], status: int
) -> None:
    runtime, metrics_port = prometheus_runtime
    port, right_port = free_port(), free_port()
    location = f"http://127.0.0.1:{right_port}/autorepair"
    events_of = webhook_of(await metered_client(client, runtime), port)
    [event] = events(1)
    # The receiver the redirect points at accepts anything, a GET too: following the redirect would "deliver".
    with receiving(right_port, []) as right:
        with redirecting(port, status, location) as redirected, caplog.at_level(logging.WARNING, "activities.events"):
            took = await events_of.publish([event])
            async with events_of.outbox_worker():
                await eventually(
                    lambda: asyncio.sleep(0, len(redirected)), lambda posts: posts >= 3, within=60, every=0.1
                )
                assert await events_of.waiting_ids(WEBHOOK) == [event.event_id]
        assert max(took) < PROMPT, took
        assert set(redirected) == {"POST"}, redirected
        assert right.requests == 0 and right.not_posts == 0 and right.received == []
        assert metric(metrics_port, EVENT_RETRIES, sink="webhook", outcome="transient_error") >= 2
        failures = [r.getMessage() for r in caplog.records if "webhook" in r.getMessage() and "HTTP" in r.getMessage()]
        assert len(failures) >= 3  # the event's own try, then each try from the outbox
        assert all(f"HTTP {status}" in m and location in m for m in failures), failures

        # With the URL fixed, the next worker sends what waited: the outbox names no URL, the worker's settings do.
        async with events_of.outbox_worker(webhook_settings(right_port)):
            await eventually(
                lambda: asyncio.sleep(0, right.ids()), lambda ids: ids == [event.event_id], within=60, every=0.1
            )
            view = await ended(events_of)
        assert right.rejected == 0 and right.not_posts == 0
        assert [e["event_id"] for e in right.handled] == [event.event_id]
        assert view.delivered == 1 and view.dead_letters == []
