"""What the event-sink tests share: events to publish, a worker that runs only the event outboxes, what an outbox holds
(its `outbox` query while it runs, its result once it ended), and metrics read from a Prometheus endpoint."""

from __future__ import annotations

import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Worker

from activities.aws import AwsClients
from activities.events import EventActivities
from activities.models import FleetEvent
from contract import event_types as ev
from contract import names
from contract.config import AwsSettings, EventSettings, TemporalSettings
from contract.event_outbox import OutboxView, SinkTarget, outbox_workflow_id
from contract.temporal_client import connect
from simulator.servers import free_port
from tests.harness import unique
from worker.main import SANDBOX
from workflows.event_outbox import EventOutboxWorkflow


def events(count: int, *, instance_ids: bool = False) -> list[FleetEvent]:
    run = uuid.uuid4().hex[:8]
    steps: list[ev.EventDetail] = [ev.RepairStarted(reason="XID_79"), ev.DrainPermitGranted(), ev.Draining()]
    return [
        FleetEvent.of(
            steps[i % len(steps)],
            event_id=f"evt-{run}-{i:03d}",
            time=datetime.now(UTC),
            group="gpu-a",
            instance_id=f"i-{i:017x}" if instance_ids else "i-0123456789abcdef0",
            workflow_id=f"repair/i-{i:017x}" if instance_ids else "repair/i-0123456789abcdef0",
        )
        for i in range(count)
    ]


@dataclass
class Publisher:
    """The event activities of one test: their own task queue, so their outboxes are theirs alone."""

    client: Client
    aws: AwsSettings
    settings: EventSettings
    task_queue: str

    def activities(self, settings: EventSettings | None = None) -> EventActivities:
        return EventActivities(AwsClients(self.aws), settings or self.settings, self.client, self.task_queue)

    async def publish(self, batch: list[FleetEvent]) -> list[float]:
        """Publish one after another, as a workflow does; returns how long each publish took."""
        acts = self.activities()
        took = []
        runtime = self.client.service_client.config.runtime
        for event in batch:
            env = ActivityEnvironment()
            if runtime is not None:
                env.metric_meter = runtime.metric_meter  # counted where the worker's activities count
            started = time.monotonic()
            await env.run(acts.publish_event, event)
            took.append(time.monotonic() - started)
        return took

    @asynccontextmanager
    async def outbox_worker(self, settings: EventSettings | None = None) -> AsyncIterator[None]:
        """A worker that runs the event outboxes (and nothing else) with these event settings."""
        async with Worker(
            self.client,
            task_queue=self.task_queue,
            workflows=[EventOutboxWorkflow],
            activities=self.activities(settings).activities(),
            workflow_runner=SANDBOX,
        ):
            yield

    async def outbox(self, target: SinkTarget) -> tuple[OutboxView | None, bool]:
        """What the target's outbox holds and whether it still runs; (None, False) when there never was one. A running
        outbox answers its query (a worker must be running); an ended one gives its result."""
        handle = self.client.get_workflow_handle(outbox_workflow_id(target, self.task_queue), result_type=OutboxView)
        try:
            described = await handle.describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return None, False
            raise
        if described.status == WorkflowExecutionStatus.RUNNING:
            return await handle.query(names.QUERY_OUTBOX, result_type=OutboxView), True
        return await handle.result(), False

    async def waiting_ids(self, target: SinkTarget) -> list[str]:
        view, running = await self.outbox(target)
        return [] if view is None or not running else view.waiting_event_ids


def publisher(client: Client, aws: AwsSettings, settings: EventSettings) -> Publisher:
    return Publisher(client=client, aws=aws, settings=settings, task_queue=unique("events"))


@pytest.fixture(scope="module")
def prometheus_runtime() -> Iterator[tuple[Runtime, int]]:
    """A runtime whose metrics are served on a Prometheus endpoint, as the worker's are; and that endpoint's port."""
    port = free_port()
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"127.0.0.1:{port}")))
    yield runtime, port  # the endpoint lives as long as the runtime
    del runtime


async def metered_client(client: Client, runtime: Runtime) -> Client:
    """The test server's client again, on a runtime whose metrics a test can read."""
    settings = TemporalSettings(address=client.service_client.config.target_host, namespace=client.namespace)
    return await connect(settings, runtime=runtime)


def metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
