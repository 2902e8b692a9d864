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
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from datetime import UTC, datetime, timedelta
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from temporalio.common import MetricMeter
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.testing import ActivityEnvironment

from activities.aws import AwsClients
from activities.events import EventActivities, event_delivery
from activities.metrics import WEBHOOK_DELIVERY_FAILURES
from activities.models import EventType, FleetEvent
from activities.webhook import (
    EVENT_ID_HEADER,
    EVENT_TYPE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    DrainTiming,
    Outbox,
    sign,
)
from contract.config import AwsSettings, EventSettings
from simulator.servers import free_port
from tests.harness import eventually

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


def webhook_settings(port: int, outbox: Path, max_events: int = 10_000) -> EventSettings:
    return EventSettings(
        eventbridge=False,
        webhook_url=f"http://127.0.0.1:{port}/autorepair",
        webhook_secret=SecretStr(SECRET),
        webhook_timeout=TIMEOUT,
        webhook_outbox_dir=outbox,
        webhook_outbox_max_events=max_events,
    )


def events(count: int) -> list[FleetEvent]:
    run = uuid.uuid4().hex[:8]
    steps = [EventType.REPAIR_STARTED, EventType.DRAIN_PERMIT_GRANTED, EventType.DRAINING]
    return [
        FleetEvent(
            event_id=f"evt-{run}-{i:03d}",
            time=datetime.now(UTC),
            type=steps[i % len(steps)],
            group="gpu-a",
            instance_id=f"i-{i:017x}",
            workflow_id=f"repair/i-{i:017x}",
            fields={"reason": "XID_79"},
        )
        for i in range(count)
    ]


async def publish_all(acts: EventActivities, batch: list[FleetEvent]) -> list[float]:
    """Publish one after another, as a workflow does; returns how long each publish took."""
    took = []
    for event in batch:
        started = time.monotonic()
        await ActivityEnvironment().run(acts.publish_event, event)
        took.append(time.monotonic() - started)
    return took


def fast_delivery(settings: EventSettings) -> AbstractAsyncContextManager[None]:
    """The worker's delivery task, polling and backing off in tenths of seconds rather than seconds."""
    return event_delivery(settings, timing=DrainTiming(idle_poll=0.05, first_backoff=0.1, max_backoff=0.5))


@pytest.fixture
def aws() -> AwsClients:
    return AwsClients(AwsSettings(region="us-east-1"))  # EventBridge is off: never called


async def test_failing_then_slow_receiver_gets_every_event_in_order_and_publish_stays_prompt(
    aws: AwsClients, tmp_path: Path
) -> None:
    port = free_port()
    settings = webhook_settings(port, tmp_path / "outbox")
    acts = EventActivities(aws, settings)
    batch = events(12)
    # The first event's own try meets a slow receiver that stores it but answers too late; redeliveries from the
    # outbox then meet a refusal, a dropped connection and another slow answer before the receiver recovers.
    with receiving(port, ["slow-ok", "fail", "drop", "slow-fail", "fail"]) as receiver:
        async with fast_delivery(settings):
            took = await publish_all(acts, batch)
            await eventually(lambda: asyncio.sleep(0, receiver.ids()), lambda ids: len(ids) == len(batch), within=60)

    assert max(took) < PROMPT, took
    assert receiver.ids() == [e.event_id for e in batch]
    # At least once: the slow receiver's copy of the first event and its redelivery both arrived.
    assert [e["event_id"] for e in receiver.received[:2]] == [batch[0].event_id] * 2
    assert receiver.rejected == 0 and receiver.bad_event_id_headers == 0
    # Each event acted on once, the first one's redelivery dropped as a duplicate.
    assert [e["event_id"] for e in receiver.handled] == [e.event_id for e in batch]
    assert receiver.received[0]["type"] == "RepairStarted" and receiver.received[0]["reason"] == "XID_79"
    assert Outbox(settings.webhook_outbox_dir, 10).is_empty()


async def test_events_published_while_the_receiver_is_down_survive_a_worker_restart(
    aws: AwsClients, tmp_path: Path
) -> None:
    port = free_port()  # nothing listens here yet: connection refused
    settings = webhook_settings(port, tmp_path / "outbox")
    batch = events(5)
    # A worker whose delivery task never ran (it died): the events wait on disk.
    took = await publish_all(EventActivities(aws, settings), batch)
    assert max(took) < PROMPT, took
    assert len(Outbox(settings.webhook_outbox_dir, 10).entries()) == 5

    # The next worker process drains what the last one left.
    with receiving(port, []) as receiver:
        async with fast_delivery(settings):
            await eventually(lambda: asyncio.sleep(0, receiver.ids()), lambda ids: len(ids) == 5, within=30)
    assert receiver.ids() == [e.event_id for e in batch]
    assert len(receiver.received) == 5
    assert Outbox(settings.webhook_outbox_dir, 10).is_empty()


async def test_a_hanging_receiver_costs_one_timeout_then_events_queue_behind_it(
    aws: AwsClients, tmp_path: Path
) -> None:
    port = free_port()
    settings = webhook_settings(port, tmp_path / "outbox")
    batch = events(4)
    with receiving(port, ["slow-fail"] * 10) as receiver:
        took = await publish_all(EventActivities(aws, settings), batch)
        # Only the first event waited for the receiver, one timeout and not its slowness; the rest went straight
        # behind it into the outbox without a request of their own.
        assert TIMEOUT.total_seconds() <= took[0] < PROMPT, took
        assert max(took[1:]) < PROMPT, took
        assert receiver.requests == 1
    assert len(Outbox(settings.webhook_outbox_dir, 10).entries()) == 4


async def test_a_full_outbox_drops_the_oldest_and_says_so(
    aws: AwsClients, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    settings = webhook_settings(port, tmp_path / "outbox", max_events=3)
    batch = events(5)
    with caplog.at_level(logging.WARNING, logger="activities.webhook"):
        await publish_all(EventActivities(aws, settings), batch)
    assert len([r for r in caplog.records if "full: dropped the oldest" in r.getMessage()]) == 2

    with receiving(port, []) as receiver:
        async with fast_delivery(settings):
            await eventually(lambda: asyncio.sleep(0, receiver.ids()), lambda ids: len(ids) == 3, within=30)
    assert receiver.ids() == [e.event_id for e in batch[2:]]


def test_webhook_settings_validate() -> None:
    with pytest.raises(ValueError):
        EventSettings(webhook_url="ftp://example.com/hook")
    with pytest.raises(ValueError):
        EventSettings(webhook_url="https://example.com/hook", webhook_timeout=timedelta(0))
    parsed = EventSettings.model_validate({"webhook_url": "https://example.com/hook", "webhook_timeout": "PT3S"})
    assert parsed.webhook_timeout == timedelta(seconds=3)
    assert parsed.webhook_secret is None


async def test_a_receiver_verifying_as_documented_accepts_a_delivery_and_refuses_tampered_or_replayed_copies(
    aws: AwsClients, tmp_path: Path
) -> None:
    port = free_port()
    settings = webhook_settings(port, tmp_path / "outbox")
    [event] = events(1)
    with receiving(port, []) as receiver:
        before = int(time.time())
        took = await publish_all(EventActivities(aws, settings), [event])
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


async def test_each_attempt_is_signed_with_its_own_time(aws: AwsClients, tmp_path: Path) -> None:
    port = free_port()
    settings = webhook_settings(port, tmp_path / "outbox")
    [event] = events(1)
    # The event's own try and the outbox's first are refused; the second outbox try, over a second later, gets in.
    with receiving(port, ["fail", "fail"]) as receiver:
        async with event_delivery(settings, timing=DrainTiming(idle_poll=0.05, first_backoff=1.1, max_backoff=1.1)):
            await publish_all(EventActivities(aws, settings), [event])
            await eventually(
                lambda: asyncio.sleep(0, receiver.ids()), lambda ids: ids == [event.event_id], within=30, every=0.1
            )
    stamps = receiver.timestamps()
    assert len(stamps) == 3 and receiver.rejected == 0, stamps
    assert stamps[0] <= stamps[1] < stamps[2], stamps


@pytest.fixture(scope="module")
def prometheus() -> Iterator[tuple[MetricMeter, int]]:
    """A metric meter exported on a Prometheus endpoint, as the worker's is; yields it and the endpoint's port."""
    port = free_port()
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"127.0.0.1:{port}")))
    yield runtime.metric_meter, port  # the endpoint lives as long as the runtime: hold it until the module is done
    del runtime


def delivery_failures(metrics_port: int, case: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(WEBHOOK_DELIVERY_FAILURES + "{") and f'case="{case}"' in line
    )


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_a_redirect_is_a_failed_delivery_and_the_event_waits_for_the_right_url(
    aws: AwsClients,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    prometheus: tuple[MetricMeter, int],
    status: int,
) -> None:
    meter, metrics_port = prometheus
    case = f"{status}-{uuid.uuid4().hex[:8]}"
    port, right_port = free_port(), free_port()
    location = f"http://127.0.0.1:{right_port}/autorepair"
    outbox = tmp_path / "outbox"
    [event] = events(1)
    # The receiver the redirect points at accepts anything, a GET too: following the redirect would "deliver".
    with receiving(right_port, []) as right:
        with redirecting(port, status, location) as redirected, caplog.at_level(logging.WARNING, "activities.webhook"):
            settings = webhook_settings(port, outbox)
            took = await publish_all(EventActivities(aws, settings), [event])
            async with event_delivery(
                settings,
                meter.with_additional_attributes({"case": case}),
                timing=DrainTiming(idle_poll=0.05, first_backoff=0.1, max_backoff=0.2),
            ):
                await eventually(
                    lambda: asyncio.to_thread(delivery_failures, metrics_port, case),
                    lambda failures: failures >= 2,
                    within=30,
                    every=0.1,
                )
        assert max(took) < PROMPT, took
        assert len(redirected) >= 3 and set(redirected) == {"POST"}, redirected
        assert right.requests == 0 and right.not_posts == 0 and right.received == []
        assert [p.name for p in Outbox(outbox, 10).entries()] != []
        assert json.loads(Outbox(outbox, 10).entries()[0].read_bytes())["event_id"] == event.event_id
        failures = [r.getMessage() for r in caplog.records if "webhook delivery" in r.getMessage()]
        assert len(failures) >= 3  # the event's own try, then each try from the outbox
        assert all(f"HTTP {status}" in m and location in m for m in failures), failures

        # With the URL fixed, the next start of the delivery task sends what waited.
        fixed = webhook_settings(right_port, outbox)
        async with fast_delivery(fixed):
            await eventually(
                lambda: asyncio.sleep(0, right.ids()), lambda ids: ids == [event.event_id], within=30, every=0.1
            )
        assert right.rejected == 0 and right.not_posts == 0
        assert [e["event_id"] for e in right.handled] == [event.event_id]
        assert Outbox(outbox, 10).is_empty()
