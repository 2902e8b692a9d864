"""The webhook sink against a real HTTP receiver on loopback that fails, hangs or is absent before it accepts.

What must hold: publish_event returns within the webhook timeout whatever the receiver does, and every event reaches
the receiver, in order, at least once (the receiver drops redeliveries by event_id, as the docs tell it to).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from temporalio.testing import ActivityEnvironment

from activities.aws import AwsClients
from activities.events import EventActivities
from activities.models import EventType, FleetEvent
from activities.webhook import EVENT_ID_HEADER, SIGNATURE_HEADER, Outbox, webhook_delivery
from contract.config import AwsSettings, EventSettings
from simulator.servers import free_port
from tests.harness import eventually

SECRET = "webhook-test-secret"
TIMEOUT = timedelta(seconds=0.5)
# A publish may take the webhook timeout plus a little for the thread hop and the outbox write; never the receiver's
# slowness (SLOW) or the delivery backoff.
PROMPT = TIMEOUT.total_seconds() + 0.5
SLOW = 2.0


class Receiver:
    """Answers the first requests as `script` says (ok, fail, drop, slow-ok, slow-fail), then accepts everything.
    An event counts as received when the receiver decides to accept it, on arrival, as a real one would store it
    before answering; so a slow-ok is received even though its sender gave up waiting."""

    def __init__(self, port: int, script: list[str]) -> None:
        self.port = port
        self.script = deque(script)
        self.received: list[dict[str, Any]] = []
        self.requests = 0
        self.bad_signatures = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.requests += 1
                    action = receiver.script.popleft() if receiver.script else "ok"
                    expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
                    event = json.loads(body)
                    if self.headers[SIGNATURE_HEADER] != expected or self.headers[EVENT_ID_HEADER] != event["event_id"]:
                        receiver.bad_signatures += 1
                    if action in ("ok", "slow-ok"):
                        receiver.received.append(event)
                if action == "drop":
                    self.close_connection = True
                    return
                if action.startswith("slow"):
                    time.sleep(SLOW)
                self.send_response(200 if action.endswith("ok") else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

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
    return webhook_delivery(settings, idle_poll=0.05, first_backoff=0.1, max_backoff=0.5)


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
    assert receiver.bad_signatures == 0
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
        # Only the first event waited for the receiver; the rest went straight behind it into the outbox.
        assert TIMEOUT.total_seconds() <= took[0] < PROMPT, took
        assert max(took[1:]) < TIMEOUT.total_seconds(), took
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
