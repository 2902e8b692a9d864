"""The group's liveness tracker against a real Temporal dev server, fed the way the ingest feeds it: heartbeats go
into a LivenessRelay, which forwards only news to the health workflows and sends the tracker batches of who was
heard when. Times are measured on the wall clock around the sends; the dev server runs on the same clock.

The group's threshold is 4 s (heartbeats every 4/3 s): the tracker's window is 4 s and its grace 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RetryConfig

from contract import names
from contract.groups import AutoRepair, CapacityGroup
from contract.health import CheckType, HealthState, HeartbeatLossInjection
from contract.ids import health_workflow_id, liveness_workflow_id
from contract.liveness import LivenessInput, LivenessReport, loss_grace
from contract.probe import Heartbeat
from node_probe.delivery.liveness_relay import LivenessRelay, LivenessRoute, routes_of
from node_probe.delivery.reporter import Reporter
from simulator.events import read_events
from simulator.servers import TemporalDevServer, free_port
from tests.harness import eventually, make_settings, running_worker, unique
from worker.settings import Settings
from workflows.models import HealthCheckResult, InstanceHealthView, LivenessView

THRESHOLD = timedelta(seconds=4)
T = THRESHOLD.total_seconds()
GRACE = loss_grace(THRESHOLD).total_seconds()
# The upper bound on noticing a loss that the tests hold the tracker to: generous, it asserts behaviour, not speed.
LATE = 60.0
# The clients reconnect at gRPC's own backoff after a server restart: room for it on a loaded machine.
RECONNECT = 90.0


@asynccontextmanager
async def watched_group(client: Client, aws_env: str, tmp_path: Path) -> AsyncIterator[Settings]:
    """A worker for a new group, monitor only (auto repair DISABLED): nothing a loss starts gets in the way."""
    group = unique("g")
    settings = make_settings(
        client,
        aws_env,
        tmp_path / "events.jsonl",
        group=group,
        cluster=group,
        auto_repair=AutoRepair.DISABLED,
        heartbeat_loss_threshold=THRESHOLD,
    )
    async with running_worker(settings, client):
        yield settings


def ingest_relay(client: Client, settings: Settings) -> LivenessRelay:
    """What the ingest runs: one relay for all hosts, sending its batches (and keepalives) on its own tick."""
    return LivenessRelay(Reporter(client), routes_of(settings.groups), settings.temporal.task_queue, relay=True)


class Probes:
    """Probes heartbeating into one relay, each every heartbeat interval while it is in `beating`."""

    def __init__(self, relay: LivenessRelay, settings: Settings) -> None:
        self.relay = relay
        self.group = settings.groups[0].name
        self.task_queue = settings.temporal.task_queue
        self.interval = settings.groups[0].heartbeat_interval.total_seconds()
        self.beating: set[str] = set()
        self.sent: dict[str, float] = {}  # wall time just before each one's last heartbeat: its receipt is later

    async def beat(self, instance: str) -> None:
        self.sent[instance] = time.time()
        beat = Heartbeat(instance_id=instance, group=self.group, sent_at=datetime.now(UTC))
        await self.relay.send_heartbeat(beat, self.task_queue)

    def stop(self, instance: str) -> float:
        """Silence one probe; returns a wall time no earlier than its last heartbeat's receipt."""
        self.beating.discard(instance)
        return time.time()

    async def _run(self) -> None:
        while True:
            for instance in sorted(self.beating):
                if instance in self.beating:
                    await self.beat(instance)
            await asyncio.sleep(self.interval)

    @asynccontextmanager
    async def running(self, *instances: str) -> AsyncIterator[Probes]:
        self.beating.update(instances)
        task = asyncio.create_task(self._run())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def health(client: Client, instance: str) -> InstanceHealthView:
    handle = client.get_workflow_handle(health_workflow_id(instance))
    return await handle.query(names.QUERY_HEALTH, result_type=InstanceHealthView)


def connectivity(view: InstanceHealthView) -> HealthCheckResult:
    return next(d for d in view.healthStatus.details if d.type is CheckType.AGENT_CONNECTIVITY)


def is_ok(view: InstanceHealthView) -> bool:
    return view.healthStatus.overallStatus is HealthState.OK


def is_lost(view: InstanceHealthView) -> bool:
    return connectivity(view).status is HealthState.IMPAIRED


async def tracker(client: Client, group: str) -> LivenessView:
    handle = client.get_workflow_handle(liveness_workflow_id(group))
    return await handle.query(names.QUERY_LIVENESS, result_type=LivenessView)


async def all_ok(client: Client, *instances: str) -> None:
    for instance in instances:
        await eventually(partial(health, client, instance), is_ok, within=30, every=0.2)


async def tracked(client: Client, group: str, instances: int) -> LivenessView:
    """Once the group's tracker has heard of that many instances (a relay's first batch follows its first tick) and
    has read its group's threshold (until then it judges by the default's, a window of minutes)."""
    return await eventually(
        lambda: tracker(client, group), lambda v: v.instances == instances and v.window_s == T, within=30, every=0.2
    )


async def statuses(events: Path, instance: str, at_least: int) -> list[str]:
    """The instance's published overall statuses, once `at_least` are there (publishing follows the change), read as
    a consumer reads them: once per event_id (delivery is at least once: a publish whose completion a Temporal restart
    lost is run again, and writes the same event, with the same id, again)."""

    def changes() -> list[dict[str, Any]]:
        ours = [e for e in read_events(events) if e["instance_id"] == instance]
        return list({e["event_id"]: e for e in ours}.values())

    found = await eventually(
        lambda: asyncio.sleep(0, changes()),
        lambda changes: len(changes) >= at_least,
        within=30,
    )
    return [e["detail"]["overall_status"] for e in found]


def disconnected_since(view: InstanceHealthView) -> float:
    reason = connectivity(view).statusReason
    assert reason is not None and reason.startswith("Agent disconnected since "), reason
    return datetime.fromisoformat(reason.removeprefix("Agent disconnected since ")).timestamp()


async def test_a_silent_instance_is_lost_within_its_bounds_while_a_blip_and_the_rest_stay_healthy(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    """Three probes behind one ingest: one falls silent, one pauses for three quarters of the threshold once, one
    never stops. Only the silent one is lost: no earlier than the threshold after its last heartbeat (the lower
    bound is exact), not long after; and it is connected again once heard."""
    steady, blip, lost = unique("i-steady"), unique("i-blip"), unique("i-lost")
    async with watched_group(client, aws_env, tmp_path) as settings:
        relay = ingest_relay(client, settings)
        probes = Probes(relay, settings)
        async with relay.running(), probes.running(steady, blip, lost):
            await all_ok(client, steady, blip, lost)
            last_before = probes.sent[lost]
            last_after = probes.stop(lost)

            # Meanwhile a blip of three quarters of the threshold between two heartbeats.
            await asyncio.sleep(0.5)
            probes.stop(blip)
            blip_from = probes.sent[blip]
            await asyncio.sleep(blip_from + 0.75 * T - time.time())
            await probes.beat(blip)
            gap = probes.sent[blip] - blip_from
            probes.beating.add(blip)
            assert 0.7 * T <= gap < T

            view = await eventually(
                lambda: health(client, lost), is_lost, within=last_after + T + LATE - time.time(), every=0.2
            )
            noticed = time.time()
            impaired_at = connectivity(view).lastStatusChange.timestamp()
            # Never before the threshold has passed since the last heartbeat; not long after.
            assert last_before + T <= impaired_at <= noticed <= last_after + T + LATE
            # The last receipt the tracker knew of, in whole seconds never earlier than the receipt.
            assert int(last_before) <= disconnected_since(view) <= last_after + 1

            for instance in (steady, blip):
                assert is_ok(await health(client, instance))
            liveness = await tracker(client, settings.groups[0].name)
            assert (liveness.lost, liveness.declared_lost, liveness.instances) == ([lost], 1, 3)
            assert (liveness.window_s, liveness.grace_s) == (T, GRACE)

            # Heard again: connected again.
            probes.beating.add(lost)
            await eventually(lambda: health(client, lost), is_ok, within=30, every=0.2)
            liveness = await tracker(client, settings.groups[0].name)
            assert (liveness.lost, liveness.recovered) == ([], 1)

        events = tmp_path / "events.jsonl"
        for instance in (steady, blip):
            assert await statuses(events, instance, 1) == ["OK"]  # INITIALIZING -> OK and nothing after
        assert await statuses(events, lost, 3) == ["OK", "IMPAIRED", "OK"]
        # The health workflows heard one heartbeat each: nothing in the others was new.
        assert relay.heartbeats_forwarded == 3


async def test_a_silent_pipeline_declares_nobody_lost_and_then_gives_a_full_window(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    """The ingest goes down (its relay stops: no batches at all) for longer than the threshold: no instance is
    lost for that. Once an ingest is back, a probe still silent is lost, but not before a full window."""
    talks, silent = unique("i-talks"), unique("i-silent")
    async with watched_group(client, aws_env, tmp_path) as settings:
        group = settings.groups[0].name
        first = ingest_relay(client, settings)
        async with first.running(), Probes(first, settings).running(talks, silent):
            await all_ok(client, talks, silent)
            await tracked(client, group, 2)
        down_from = time.time()

        # Down past every instance's deadline (threshold and grace). The tracker sets no timer while every relay has
        # promised a batch before the next deadline: it learns of the silence when batches come again.
        await asyncio.sleep(max(down_from + T + 3 * GRACE - time.time(), 0))
        liveness = await tracker(client, group)
        assert (liveness.lost, liveness.declared_lost) == ([], 0)
        for instance in (talks, silent):
            assert is_ok(await health(client, instance))

        # An ingest again (a new process: a new relay). Only one of the two probes talks to it.
        second = ingest_relay(client, settings)
        probes = Probes(second, settings)
        async with second.running(), probes.running(talks):
            resumed = time.time()
            view = await eventually(
                lambda: health(client, silent), is_lost, within=resumed + 2 * T + LATE - time.time(), every=0.2
            )
            assert connectivity(view).lastStatusChange.timestamp() >= resumed + T
            assert disconnected_since(view) < down_from + 1
            liveness = await tracker(client, group)
            assert liveness.floor is not None and liveness.floor.timestamp() >= resumed + T
            assert (liveness.lost, liveness.declared_lost, liveness.silent_since) == ([silent], 1, None)
            # The silence is on record: from the last batch before it to the first after it.
            assert liveness.last_silence_from is not None and liveness.last_silence_to is not None
            assert (
                liveness.last_silence_from.timestamp() <= down_from + 1
                and liveness.last_silence_to.timestamp() >= resumed - 1
            )
            # The other probe, heard all along since, is fine.
            assert is_ok(await health(client, talks)) and probes.sent[talks] > resumed + T - 2 * probes.interval

        events = tmp_path / "events.jsonl"
        assert await statuses(events, talks, 1) == ["OK"]
        assert await statuses(events, silent, 2) == ["OK", "IMPAIRED"]


async def test_a_game_day_heartbeat_loss_impairs_while_heartbeats_continue_and_heals_after(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    instance = unique("i")
    # Well over the window and its grace (and a second of rounding): the tracker does declare the loss.
    duration = timedelta(seconds=3 * T)
    async with watched_group(client, aws_env, tmp_path) as settings:
        relay = ingest_relay(client, settings)
        probes = Probes(relay, settings)
        async with relay.running(), probes.running(instance):
            await all_ok(client, instance)
            await tracked(client, settings.groups[0].name, 1)
            handle = client.get_workflow_handle(health_workflow_id(instance))
            injected = time.time()
            await handle.signal(
                names.SIGNAL_INJECT_HEARTBEAT_LOSS,
                HeartbeatLossInjection(duration=duration, requested_by="test game day"),
            )
            view = await eventually(
                lambda: health(client, instance), is_lost, within=injected + T + LATE - time.time(), every=0.2
            )
            # As if the probe had fallen silent then: its last heartbeat before the game day came at most an interval
            # earlier, and counts.
            assert connectivity(view).lastStatusChange.timestamp() >= injected + T - probes.interval
            assert view.heartbeats_ignored_until is not None
            until = view.heartbeats_ignored_until.timestamp()
            assert probes.sent[instance] > injected  # the probe kept heartbeating

            view = await eventually(
                lambda: health(client, instance), is_ok, within=until + LATE - time.time(), every=0.2
            )
            assert connectivity(view).lastStatusChange.timestamp() >= until
            assert probes.sent[instance] >= until - 2 * probes.interval  # and still does
            liveness = await tracker(client, settings.groups[0].name)
            assert (liveness.lost, liveness.declared_lost, liveness.recovered) == ([], 1, 1)

        assert await statuses(tmp_path / "events.jsonl", instance, 3) == ["OK", "IMPAIRED", "OK"]


async def test_bad_input_to_the_tracker_is_counted_and_never_wedges_it(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    instance = unique("i")
    async with watched_group(client, aws_env, tmp_path) as settings:
        group = settings.groups[0].name
        task_queue = settings.temporal.task_queue
        # A trusted-lab probe: its one heartbeat starts its health workflow and the group's tracker.
        route = LivenessRoute.for_probe(settings.groups[0].heartbeat_interval)
        probe = LivenessRelay(Reporter(client), lambda _: route, task_queue, relay=False)
        heard_before = time.time()
        await probe.send_heartbeat(Heartbeat(instance_id=instance, group=group, sent_at=datetime.now(UTC)), task_queue)
        await all_ok(client, instance)

        handle = client.get_workflow_handle(liveness_workflow_id(group))
        now = datetime.now(UTC)
        batch = LivenessReport(group=group, reporter="test", at=now, report_every=THRESHOLD / 2, relay=False)
        bad: list[tuple[str, list[Any]]] = [
            (names.SIGNAL_LIVENESS_REPORT, []),  # empty
            (names.SIGNAL_LIVENESS_REPORT, ["not a batch"]),
            (names.SIGNAL_LIVENESS_REPORT, [batch, batch]),  # two payloads
            (names.SIGNAL_LIVENESS_REPORT, [{"group": group, "reporter": "x", "at": "never", "report_every": 1}]),
            (names.SIGNAL_LIVENESS_REPORT, [{**batch.model_dump(mode="json"), "heard": {"i-x": -1}}]),
            (names.SIGNAL_LIVENESS_REPORT, [batch.model_copy(update={"group": unique("other")})]),
            (names.SIGNAL_IGNORE_HEARTBEATS, [{"instance_id": instance}]),
            (names.SIGNAL_GROUP_CHANGED, [CapacityGroup(name=unique("other"), cluster="c")]),
            (names.SIGNAL_GROUP_CHANGED, [42]),
            ("no_such_signal", [batch]),
        ]
        for name, args in bad:
            await handle.signal(name, args=args)
        # The workflow id of a tracker, but a start that carries another group's batch: refused the same way.
        await client.start_workflow(
            names.LIVENESS_WORKFLOW,
            LivenessInput(group=group),
            id=liveness_workflow_id(group),
            task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal=names.SIGNAL_LIVENESS_REPORT,
            start_signal_args=[batch.model_copy(update={"group": unique("other"), "heard": {instance: 0}})],
        )

        liveness = await eventually(
            lambda: tracker(client, group), lambda v: v.rejected_signals >= len(bad) + 1, within=30, every=0.2
        )
        assert liveness.rejected_signals == len(bad) + 1
        assert (liveness.instances, liveness.lost, len(liveness.reporters)) == (1, [], 1)
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING

        # Still doing its job: the probe, silent since, is lost in time, and nothing else was heard of.
        view = await eventually(
            lambda: health(client, instance), is_lost, within=heard_before + T + LATE - time.time(), every=0.2
        )
        assert connectivity(view).lastStatusChange.timestamp() >= heard_before + T
        liveness = await tracker(client, group)
        assert (liveness.lost, liveness.instances, liveness.rejected_signals) == ([instance], 1, len(bad) + 1)


async def test_a_temporal_restart_declares_nobody_lost(
    aws_env: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A dev server with its state in a file, stopped for longer than the threshold and started again on the same
    file and ports: the relay keeps the receipts it could not send and sends them once Temporal is back, the
    tracker's late timer holds its fire for a window, and no instance heartbeating all along is lost."""
    server = TemporalDevServer(tmp_path / "temporal", port=free_port(), ui_port=free_port())
    await server.start()
    try:
        client = await Client.connect(server.address, data_converter=pydantic_data_converter)
        instances = [unique("i-a"), unique("i-b")]
        async with watched_group(client, aws_env, tmp_path) as settings:
            group = settings.groups[0].name
            # The ingest's client gives up within a second, as it does in an outage longer than its retries: the
            # relay itself then keeps the receipts and tries again.
            impatient = await Client.connect(
                server.address, data_converter=pydantic_data_converter, retry_config=RetryConfig(max_retries=2)
            )
            relay = ingest_relay(impatient, settings)
            async with relay.running(), Probes(relay, settings).running(*instances):
                await all_ok(client, *instances)
                await tracked(client, group, 2)
                await server.stop()
                down_from = time.time()
                sent_before = relay.batches_sent
                await asyncio.sleep(T + 2 * GRACE)
                await server.start()
                back = time.time()
                assert back - down_from > T + 2 * GRACE

                # Past the floor the tracker set itself (it woke late, or heard from the relay after a silence) and a
                # grace for its check at the floor: nobody lost.
                # The ingest's client reconnects at gRPC's own backoff, which on a loaded machine can take a while:
                # wait for its first batch after the restart, then for the tracker's answer to it.
                await eventually(
                    lambda: asyncio.sleep(0, relay.batches_sent), lambda sent: sent > sent_before, within=RECONNECT
                )
                # The worker's own client reconnects at the same backoff; until it does, the tracker cannot answer
                # (and the last answer is from before the outage). Behaviour, not speed: a generous bound.
                liveness = await eventually(
                    lambda: tracker(client, group),
                    lambda v: v.floor is not None and time.time() > max(back, v.floor.timestamp()) + GRACE,
                    within=RECONNECT,
                    every=0.2,
                )
                assert relay.batches_sent > sent_before
                assert any("not sent (kept, retrying)" in r.getMessage() for r in caplog.records)
                assert liveness.floor is not None and liveness.floor.timestamp() > down_from + T + GRACE
                assert liveness.last_report_at is not None and liveness.last_report_at.timestamp() > back
                assert (liveness.lost, liveness.declared_lost, liveness.instances) == ([], 0, 2)
                for instance in instances:
                    view = await health(client, instance)
                    assert is_ok(view) and connectivity(view).lastStatusChange.timestamp() < down_from
        for instance in instances:
            assert await statuses(tmp_path / "events.jsonl", instance, 1) == ["OK"]
    finally:
        await server.stop()
