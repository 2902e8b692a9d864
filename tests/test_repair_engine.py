"""The repair engine end to end: real Temporal dev server, moto over HTTP, the simulated fleet running the real probe.

These tests assert behaviour (order of steps, the cap, exactly-once effects), never timing: every wait is a poll with
a generous bound.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowExecutionStatus

from contract import names
from contract.groups import AutoRepair
from contract.health import HealthState
from contract.ids import health_workflow_id, repair_workflow_id
from simulator.engine_process import engine_environment
from tests.fleet import assert_start_before_stop, simulated_fleet
from tests.harness import eventually
from worker.settings import Settings
from workflows import repair_patches
from workflows.models import InstanceHealthView


def max_concurrently_draining(events: list[dict[str, Any]]) -> int:
    """From the event stream: how many instances were between Draining and Terminated at the same time."""
    marks = sorted(
        (e["time"], 1 if e["type"] == "Draining" else -1) for e in events if e["type"] in ("Draining", "Terminated")
    )
    current = peak = 0
    for _, step in sorted(marks, key=lambda m: (m[0], m[1])):
        current += step
        peak = max(peak, current)
    return peak


async def patch_markers(client: Client, workflow_id: str) -> list[str]:
    """The patch ids a run recorded, in order (sdk-core's `core_patch` markers)."""
    ids = []
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED:
            marker = event.marker_recorded_event_attributes
            if marker.marker_name == "core_patch":
                ids.append(json.loads(marker.details["patch-data"].payloads[0].data)["id"])
    return ids


async def news_sent(client: Client, workflow_id: str) -> tuple[list[str], list[str]]:
    """The activities a run scheduled for its news, and the signals it sent other workflows itself."""
    activities, signals = [], []
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            if name.startswith("publish_"):
                activities.append(name)
        elif event.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            signals.append(event.signal_external_workflow_execution_initiated_event_attributes.signal_name)
    return activities, signals


async def test_six_instances_drain_one_at_a_time(client: Client, aws_env: str, tmp_path: Path) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=6) as fleet:
        await fleet.all_healthy(6)
        faulty = fleet.sim.rng.sample(fleet.sim.live_instances(), 3)
        for instance_id in faulty:
            fleet.sim.inject_fault(instance_id)

        assert len(await fleet.repairs_finished(3, within=300)) == 3
        for instance_id in faulty:
            await assert_start_before_stop(fleet, instance_id)
        assert max_concurrently_draining(fleet.events()) == 1
        assert (await fleet.semaphore()).max_holders_seen == 1
        # Each event links to the Web UI page of the workflow that sent it.
        completed = fleet.events("RepairCompleted")[0]
        # One patch marker for every patch a repair asks (each is a billed marker and a TemporalChangeVersion upsert).
        assert await patch_markers(client, completed["workflow_id"]) == [repair_patches.CURRENT]
        # Its news went in batches, each one activity (fewer than its events), and only its last progress went as a
        # signal of its own; the release of its permit is the other.
        activities, signals = await news_sent(client, completed["workflow_id"])
        published = [e for e in fleet.events() if e.get("workflow_id") == completed["workflow_id"]]
        assert set(activities) == {"publish_news"} and 0 < len(activities) < len(published)
        assert sorted(signals) == sorted([names.SIGNAL_REPAIR_PROGRESS, names.SIGNAL_RELEASE])
        assert completed["workflow_url"] == (
            f"{fleet.settings.temporal.ui_url}/namespaces/default/workflows/repair%2F{completed['instance_id']}%2F1"
        )


async def test_disabled_group_impairs_but_never_drains(client: Client, aws_env: str, tmp_path: Path) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=4, auto_repair=AutoRepair.DISABLED) as fleet:
        await fleet.all_healthy(4)
        faulty = fleet.sim.live_instances()[:2]
        for instance_id in faulty:
            fleet.sim.inject_fault(instance_id)

        snapshot = await eventually(fleet.sim.snapshot, lambda s: s.impaired == 2)
        assert {i for i, status in snapshot.health.items() if status is HealthState.IMPAIRED} == set(faulty)
        # Give a repair every chance to (wrongly) start: several heartbeat intervals and watch ticks.
        await asyncio.sleep(5)
        snapshot = await fleet.sim.snapshot()
        assert snapshot.container_draining == 0
        assert snapshot.running == 4 and snapshot.impaired == 2
        assert [e for e in fleet.events() if e["type"] != "HealthChanged"] == []


async def test_heartbeat_blip_repairs_nothing_and_sustained_loss_repairs(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=5) as fleet:
        await fleet.all_healthy(5)
        lost, blipped = fleet.sim.live_instances()[:2]
        await fleet.sim.heartbeat_loss(lost)
        await fleet.sim.blip(blipped)

        assert len(await fleet.repairs_finished(1, within=300)) == 1
        [started] = fleet.events("RepairStarted")
        assert started["instance_id"] == lost
        assert started["detail"]["reason"].startswith("Agent disconnected since ")
        await assert_start_before_stop(fleet, lost)
        assert [e for e in fleet.events() if e["instance_id"] == blipped and e["type"] != "HealthChanged"] == []
        assert [
            e["detail"]["overall_status"] for e in fleet.events("HealthChanged") if e["instance_id"] == blipped
        ] == ["OK"]


async def test_an_instance_terminated_on_purpose_retires_without_a_repair(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=4) as fleet:
        await fleet.all_healthy(4)
        left = fleet.sim.live_instances()[0]
        # An operator (or a scale-in) terminates it: its probe falls silent with it, which is not a fault.
        fleet.ec2().terminate_instances(InstanceIds=[left])
        [retired] = await eventually(
            lambda: asyncio.sleep(0, fleet.events("InstanceRetired")), lambda found: len(found) == 1, within=120
        )
        assert retired["instance_id"] == left
        assert retired["detail"]["reason"].startswith(("terminated in EC2: ", "shutting-down in EC2: ")), retired
        handle = client.get_workflow_handle(health_workflow_id(left), result_type=InstanceHealthView)
        view = await handle.result()
        assert view.retired and view.retired_reason == retired["detail"]["reason"]
        assert view.healthStatus.overallStatus is HealthState.OK  # never IMPAIRED, never repaired
        assert fleet.events("RepairStarted") == [] and fleet.replacements_of(left) == []
        assert [e["detail"]["overall_status"] for e in fleet.events("HealthChanged") if e["instance_id"] == left] == [
            "OK"
        ]


async def test_operator_terminating_a_permit_holder_frees_its_permit(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=6) as fleet:
        await fleet.all_healthy(6)
        first, second = fleet.sim.live_instances()[:2]
        fleet.sim.inject_fault(first)
        await eventually(fleet.semaphore, lambda s: [p.instance_id for p in s.holders] == [first])
        fleet.sim.inject_fault(second)
        await eventually(fleet.semaphore, lambda s: [w.instance_id for w in s.waiters] == [second])
        await eventually(lambda: asyncio.sleep(0, fleet.events("Draining", first)), lambda found: len(found) == 1)

        await client.get_workflow_handle(repair_workflow_id(first)).terminate("operator takes over")

        # The permit is back at once, but the instance the repair left DRAINING is still out of service, and the cap
        # (one at a time below 9 instances) counts it: the second waits until the operator finishes the takeover.
        await eventually(
            fleet.semaphore,
            lambda s: s.holders == [] and s.out_of_service == 1 and [w.instance_id for w in s.waiters] == [second],
        )
        fleet.ec2().terminate_instances(InstanceIds=[first])  # docs/operations.md section 4, step 7

        assert await fleet.repairs_finished(1) == [second]
        await assert_start_before_stop(fleet, second)
        semaphore = await fleet.semaphore()
        assert semaphore.holders == [] and semaphore.waiters == []


async def test_permanent_launch_error_fails_the_repair_clearly_and_keeps_the_instance(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(
        client, aws_env, tmp_path, instances=3, engine_launch_template="no-such-template"
    ) as fleet:
        await fleet.all_healthy(3)
        [faulty] = fleet.sim.live_instances()[:1]
        fleet.sim.inject_fault(faulty)

        [failed] = await eventually(lambda: asyncio.sleep(0, fleet.events("RepairFailed")), lambda e: len(e) == 1)
        assert "no-such-template" in failed["detail"]["error"]
        handle = client.get_workflow_handle(repair_workflow_id(faulty))
        # The event comes first; the workflow fails once it has handed its permit back.
        await eventually(handle.describe, lambda d: d.status == WorkflowExecutionStatus.FAILED)
        # Never stop before start: without a replacement the impaired instance stays, drained but running.
        assert fleet.ec2_state(faulty) == "running"
        assert fleet.replacements_of(faulty) == []
        await eventually(lambda: asyncio.sleep(0, fleet.events("DrainPermitReleased")), lambda e: len(e) == 1)
        semaphore = await fleet.semaphore()
        assert semaphore.holders == [] and semaphore.waiters == []


async def start_worker_process(settings: Settings, log_path: Path) -> asyncio.subprocess.Process:
    log = log_path.open("ab")
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "operator_cli.main",
        "worker",
        env=engine_environment(settings),
        stdout=log,
        stderr=log,
    )


async def test_worker_killed_mid_repair_finishes_with_one_launch_and_one_termination(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=5, in_process_worker=False) as fleet:
        log_path = tmp_path / "worker.log"
        worker = await start_worker_process(fleet.settings, log_path)
        try:
            await fleet.all_healthy(5)
            [faulty] = fleet.sim.live_instances()[:1]
            fleet.sim.inject_fault(faulty)
            await eventually(lambda: asyncio.sleep(0, fleet.events("ReplacementLaunched")), lambda e: len(e) == 1)
            worker.send_signal(signal.SIGKILL)
            await worker.wait()

            worker = await start_worker_process(fleet.settings, log_path)
            assert await fleet.repairs_finished(1) == [faulty]
            await assert_start_before_stop(fleet, faulty)
            assert len({e["event_id"] for e in fleet.events("Terminated")}) == 1
            await fleet.all_healthy(5)
        finally:
            if worker.returncode is None:
                worker.terminate()
                await worker.wait()
