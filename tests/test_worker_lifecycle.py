"""The worker as an orchestrator runs it: stopped with SIGTERM in a rolling update, replicas that die at any moment.

- SIGTERM mid-repair: the worker stops polling, lets the activity in flight finish (within
  `graceful_shutdown_timeout`), exits 0, and the next worker completes the repair exactly once.
- Stateless: with the webhook down, two worker replicas repair an instance; the repair's events wait in Temporal
  (the webhook's event outbox), not on a replica's disk; one replica is SIGKILLed; the webhook comes back and gets
  every event the repair published.

Real servers: a Temporal dev server, moto over HTTP behind the answer-holding proxy, the simulated fleet with the real
probe, `autorepair worker` as child processes, a real HTTP receiver.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from contract.event_outbox import OutboxView, Sink, SinkTarget, outbox_workflow_id
from contract.repair import RepairPhase
from simulator.servers import free_port
from tests.durability_harness import (
    assert_repaired_exactly_once,
    durable_fleet,
    in_phase,
    repair_id,
)
from tests.harness import eventually, worker_process
from workflows.event_outbox import EventOutboxWorkflow


@pytest.mark.timeout(240)
async def test_sigterm_mid_repair_lets_the_step_in_flight_finish_exits_0_and_the_next_worker_completes_it(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with durable_fleet(client, aws_env, tmp_path, instances=5) as d:
        [target] = d.sim.live_instances()[:1]
        # TerminateInstances done by moto, its answer held: the step is in flight when SIGTERM comes.
        held = d.aws.hold("TerminateInstances", target)
        d.sim.inject_fault(target)
        repair = await repair_id(d, target)
        await in_phase(client, repair, RepairPhase.TERMINATING, within=120)
        assert await asyncio.to_thread(held.arrived.wait, 60)

        stopping = asyncio.create_task(d.worker.terminate(within=90))
        await asyncio.sleep(2)  # the worker has stopped polling and waits for its activity
        assert not stopping.done(), d.worker.log_tail()
        held.released.set()  # AWS answers within the grace: the activity completes on the worker that began it
        assert await stopping == 0, d.worker.log_tail()
        log = d.worker.log_tail(200)
        assert "worker shutting down" in log and "worker stopped" in log, log

        # A rolling update's new replica takes over what is left of the repair.
        await d.worker.start()
        await eventually(
            lambda: asyncio.sleep(0, d.fleet.events("DrainPermitReleased", target)), bool, within=120, every=0.5
        )
        await assert_repaired_exactly_once(d, [target])
    # The step was not run again: the old worker finished it, so EC2 was asked to terminate the instance once.
    assert d.aws.requests("TerminateInstances", target) == 1


class Receiver:
    """A webhook receiver that stores each event's id, in arrival order."""

    def __init__(self, port: int) -> None:
        self.ids: list[str] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.ids.append(json.loads(body)["event_id"])
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True

    def received(self) -> list[str]:
        with self.lock:
            return list(self.ids)


@contextmanager
def receiving(port: int) -> Iterator[Receiver]:
    receiver = Receiver(port)
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


@pytest.mark.timeout(300)
async def test_no_event_is_lost_when_a_replica_dies_while_the_sink_is_down(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    port = free_port()  # the webhook: nothing listens yet
    webhook = {"webhook_url": f"http://127.0.0.1:{port}/events", "webhook_timeout": timedelta(seconds=1)}
    async with (
        durable_fleet(client, aws_env, tmp_path, instances=5, events=webhook) as d,
        worker_process(d.fleet.settings, tmp_path / "worker-2.log"),
    ):
        [target] = d.sim.live_instances()[:1]
        d.sim.inject_fault(target)
        await eventually(
            lambda: asyncio.sleep(0, d.fleet.events("DrainPermitReleased", target)), bool, within=180, every=0.5
        )
        # Every event of the group reached the JSON-lines file; the webhook's copies wait in Temporal.
        published = [e["event_id"] for e in d.fleet.events()]
        outbox = client.get_workflow_handle(
            outbox_workflow_id(SinkTarget(sink=Sink.WEBHOOK), d.fleet.settings.temporal.task_queue),
            result_type=OutboxView,
        )

        async def waiting() -> OutboxView:
            return await outbox.query(EventOutboxWorkflow.outbox)

        view = await eventually(waiting, lambda v: set(published) <= set(v.waiting_event_ids), within=60)
        assert view.dead_letters == []

        await d.worker.kill()  # one replica dies, whatever it held

        with receiving(port) as receiver:
            got = await eventually(
                lambda: asyncio.sleep(0, receiver.received()),
                lambda ids: set(published) <= set(ids),
                within=180,
                every=0.5,
            )
            result = await asyncio.wait_for(outbox.result(), timeout=120)
    # Every event the repair published arrived (at least once), and the outbox ended with nothing given up on.
    assert set(published) <= set(got)
    assert result.waiting == 0 and result.dead_letters == [] and result.dead_lettered == 0
