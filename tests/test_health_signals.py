"""The health workflow against a real Temporal dev server: bad input is dropped, liveness is measured (by the
group's liveness tracker, fed the way probes feed it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError

from contract.groups import AutoRepair
from contract.health import CheckType, HealthInput, HealthState
from contract.ids import health_workflow_id
from contract.probe import GpuFinding, GpuRef, Heartbeat, ProbeSourceHealth
from node_probe.delivery.liveness_relay import LivenessRelay, LivenessRoute
from node_probe.delivery.reporter import Reporter
from simulator.events import read_events
from simulator.servers import find_binary
from tests.harness import eventually, make_settings, running_worker, unique
from worker.settings import Settings
from workflows.models import InstanceHealthView


def heartbeat(instance: str, group: str) -> Heartbeat:
    return Heartbeat(instance_id=instance, group=group, sent_at=datetime.now(UTC))


def finding(instance: str, group: str, finding_id: str, *, code: int = 79, impairs: bool = True) -> GpuFinding:
    return GpuFinding(
        finding_id=finding_id,
        instance_id=instance,
        group=group,
        kind="xid",
        code=code,
        reason=f"XID_{code}",
        impairs=impairs,
        gpu=GpuRef(pci="0000:9b:00"),
        raw=f"NVRM: Xid (PCI:0000:9b:00): {code}, pid=1, name=python3, test",
        observed_at=datetime.now(UTC),
    )


@asynccontextmanager
async def monitor_only(
    client: Client, aws_env: str, tmp_path: Path, heartbeat_loss_threshold: timedelta = timedelta(seconds=6)
) -> AsyncIterator[tuple[Settings, str]]:
    """A worker for a new group with auto repair DISABLED: health is watched, nothing is ever repaired."""
    group = unique("g")
    settings = make_settings(
        client,
        aws_env,
        tmp_path / "events.jsonl",
        group=group,
        cluster=group,
        auto_repair=AutoRepair.DISABLED,
        heartbeat_loss_threshold=heartbeat_loss_threshold,
    )
    async with running_worker(settings, client):
        yield settings, group


async def start_health(client: Client, settings: Settings, instance: str) -> WorkflowHandle:
    group = settings.groups[0].name
    return await client.start_workflow(
        "InstanceHealthWorkflow",
        HealthInput(instance_id=instance, group=group),
        id=health_workflow_id(instance),
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        start_signal="heartbeat",
        start_signal_args=[heartbeat(instance, group)],
    )


async def health_of(handle: WorkflowHandle) -> InstanceHealthView:
    return await handle.query("health", result_type=InstanceHealthView)


def check(view: InstanceHealthView, kind: CheckType) -> HealthState:
    return next(d.status for d in view.healthStatus.details if d.type is kind)


async def temporal_cli(client: Client, *args: str) -> int:
    # Not subprocess.run: a blocking call here would stall the worker running on this event loop.
    proc = await asyncio.create_subprocess_exec(
        find_binary("temporal"),
        *args,
        "--address",
        client.service_client.config.target_host,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return proc.returncode


async def test_malformed_empty_and_duplicate_signals_are_counted_and_dropped(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    instance = unique("i")
    async with monitor_only(client, aws_env, tmp_path) as (settings, group):
        handle = await start_health(client, settings, instance)
        await eventually(lambda: health_of(handle), lambda v: v.healthStatus.overallStatus is HealthState.OK)

        wid = health_workflow_id(instance)
        await temporal_cli(client, "workflow", "signal", "--workflow-id", wid, "--name", "gpu_finding")
        await temporal_cli(
            client,
            "workflow",
            "signal",
            "--workflow-id",
            wid,
            "--name",
            "gpu_finding",
            "--input",
            '{"reason": 79}',
        )
        await temporal_cli(
            client,
            "workflow",
            "signal",
            "--workflow-id",
            wid,
            "--name",
            "heartbeat",
            "--input",
            '"not a heartbeat"',
        )
        await temporal_cli(
            client,
            "workflow",
            "signal",
            "--workflow-id",
            wid,
            "--name",
            "gpu_finding",
            "--input",
            "{}",
            "--input",
            "{}",
        )
        await temporal_cli(client, "workflow", "signal", "--workflow-id", wid, "--name", "no_such_signal")
        await handle.signal("gpu_finding", finding(instance, group, "f-1", code=13, impairs=False))
        await handle.signal("gpu_finding", finding(instance, group, "f-1", code=13, impairs=False))

        view = await eventually(lambda: health_of(handle), lambda v: v.rejected_signals >= 6)
        assert view.rejected_signals == 6
        assert view.healthStatus.overallStatus is HealthState.OK
        assert view.warning_counts == {"0000:9b:00/XID_13": 1}
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING

        # Still fully alive: a real critical finding impairs it, and DISABLED starts no repair.
        await handle.signal("gpu_finding", finding(instance, group, "f-2", code=79))
        view = await eventually(
            lambda: health_of(handle), lambda v: v.healthStatus.overallStatus is HealthState.IMPAIRED
        )
        accelerated = next(d for d in view.healthStatus.details if d.type is CheckType.ACCELERATED_COMPUTE)
        assert accelerated.statusReason == "XID_79"
        assert view.repair is None
        events = await eventually(
            lambda: asyncio.sleep(0, read_events(tmp_path / "events.jsonl")),
            lambda events: any(e["detail"].get("overall_status") == "IMPAIRED" for e in events),
        )
        impaired = next(e for e in events if e["detail"].get("overall_status") == "IMPAIRED")
        assert impaired["type"] == "HealthChanged" and impaired["instance_id"] == instance
        assert {d["type"]: d["status"] for d in impaired["detail"]["details"]}["ACCELERATED_COMPUTE"] == "IMPAIRED"
        assert not [e for e in events if e["type"] != "HealthChanged"]
        await handle.terminate("test over")


async def test_heartbeat_blip_changes_nothing_and_sustained_loss_impairs(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    """Heartbeats take a trusted-lab probe's real path: its LivenessRelay forwards to the health workflow only what
    changed and tells the group's liveness tracker that it was heard; only the tracker says an agent is lost."""
    blip, lost = unique("i-blip"), unique("i-lost")
    threshold = timedelta(seconds=4)
    async with monitor_only(client, aws_env, tmp_path, threshold) as (settings, group):
        task_queue = settings.temporal.task_queue
        route = LivenessRoute.for_probe(settings.groups[0].heartbeat_interval)
        probes = {
            instance: LivenessRelay(Reporter(client), lambda _: route, task_queue, relay=False)
            for instance in (blip, lost)
        }
        for instance, probe in probes.items():
            await probe.send_heartbeat(heartbeat(instance, group), task_queue)
        blip_handle = client.get_workflow_handle(health_workflow_id(blip))
        lost_handle = client.get_workflow_handle(health_workflow_id(lost))
        for handle in (blip_handle, lost_handle):
            await eventually(partial(health_of, handle), lambda v: v.healthStatus.overallStatus is HealthState.OK)

        # The blip instance pauses 3 s (three quarters of the threshold) between heartbeats; the lost one never beats
        # again.
        for _ in range(4):
            await asyncio.sleep(0.75 * threshold.total_seconds())
            await probes[blip].send_heartbeat(heartbeat(blip, group), task_queue)
        view = await eventually(
            lambda: health_of(lost_handle),
            lambda v: check(v, CheckType.AGENT_CONNECTIVITY) is HealthState.IMPAIRED,
        )
        reason = next(d.statusReason for d in view.healthStatus.details if d.type is CheckType.AGENT_CONNECTIVITY)
        assert reason is not None and reason.startswith("Agent disconnected since ")

        blip_view = await health_of(blip_handle)
        assert blip_view.healthStatus.overallStatus is HealthState.OK
        blip_changes = [e for e in read_events(tmp_path / "events.jsonl") if e["instance_id"] == blip]
        assert [e["detail"]["overall_status"] for e in blip_changes] == ["OK"]  # INITIALIZING -> OK, nothing after
        # Only the first heartbeat said something new: the others reached the tracker alone.
        assert probes[blip].heartbeats_forwarded == 1 and probes[blip].batches_sent == 5

        # A heartbeat after the loss reconnects the agent.
        await probes[lost].send_heartbeat(heartbeat(lost, group), task_queue)
        await eventually(lambda: health_of(lost_handle), lambda v: v.healthStatus.overallStatus is HealthState.OK)
        assert probes[lost].heartbeats_forwarded == 1
        lost_changes = await eventually(
            lambda: asyncio.sleep(0, [e for e in read_events(tmp_path / "events.jsonl") if e["instance_id"] == lost]),
            lambda events: len(events) >= 3,
        )
        assert [e["detail"]["overall_status"] for e in lost_changes] == ["OK", "IMPAIRED", "OK"]
        for handle in (blip_handle, lost_handle):
            await handle.terminate("test over")


async def test_health_workflow_continues_as_new_carrying_its_state(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    # The test server suggests continue-as-new at 200 history events (see conftest), so a few hundred signals
    # take the workflow through at least one new run.
    instance = unique("i")
    async with monitor_only(client, aws_env, tmp_path) as (settings, group):
        handle = await start_health(client, settings, instance)
        latest = client.get_workflow_handle(health_workflow_id(instance))
        first_run = (await latest.describe()).run_id
        await handle.signal("gpu_finding", finding(instance, group, "warn-1", code=31, impairs=False))
        await temporal_cli(client, "workflow", "signal", "--workflow-id", health_workflow_id(instance), "--name", "x")
        ok_since = (
            (await eventually(lambda: health_of(handle), lambda v: v.healthStatus.overallStatus is HealthState.OK))
            .healthStatus.details[0]
            .lastStatusChange
        )
        for _ in range(300):
            await handle.signal("heartbeat", heartbeat(instance, group))
        await handle.signal("gpu_finding", finding(instance, group, "warn-1", code=31, impairs=False))

        view = await eventually(lambda: health_of(handle), lambda v: v.rejected_signals == 2)
        assert (await latest.describe()).run_id != first_run
        assert view.warning_counts == {"0000:9b:00/XID_31": 1}
        assert view.healthStatus.overallStatus is HealthState.OK
        assert view.healthStatus.details[0].lastStatusChange == ok_since
        await handle.terminate("test over")


async def test_initializing_until_first_heartbeat_and_insufficient_data_when_gpu_sources_are_down(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    instance = unique("i")
    async with monitor_only(client, aws_env, tmp_path) as (settings, group):
        # Started by a warning finding, before the probe's first heartbeat.
        handle = await client.start_workflow(
            "InstanceHealthWorkflow",
            HealthInput(instance_id=instance, group=group),
            id=health_workflow_id(instance),
            task_queue=settings.temporal.task_queue,
            start_signal="gpu_finding",
            start_signal_args=[finding(instance, group, "w-1", code=43, impairs=False)],
        )
        view = await eventually(lambda: health_of(handle), lambda v: v.warning_counts != {})
        assert view.healthStatus.overallStatus is HealthState.INITIALIZING

        sources = [
            ProbeSourceHealth(name="kmsg", state=HealthState.OK),
            ProbeSourceHealth(name="nvml", state=HealthState.INSUFFICIENT_DATA, reason="NVML: driver not loaded"),
            ProbeSourceHealth(name="daemons", state=HealthState.OK, gpu_source=False),
        ]
        blind = heartbeat(instance, group).model_copy(
            update={
                "gpu_health": HealthState.INSUFFICIENT_DATA,
                "gpu_health_reason": "NVML: driver not loaded",
                "sources": sources,
            }
        )
        await handle.signal("heartbeat", blind)
        view = await eventually(
            lambda: health_of(handle), lambda v: v.healthStatus.overallStatus is HealthState.INSUFFICIENT_DATA
        )
        accelerated = next(d for d in view.healthStatus.details if d.type is CheckType.ACCELERATED_COMPUTE)
        assert accelerated.statusReason == "NVML: driver not loaded"
        assert check(view, CheckType.AGENT_CONNECTIVITY) is HealthState.OK
        # Each of the probe's sources, as its last heartbeat reported them, for `describe-instances`.
        assert view.probe_sources == sources

        # The source comes back: nothing latches.
        await handle.signal("heartbeat", heartbeat(instance, group))
        await eventually(lambda: health_of(handle), lambda v: v.healthStatus.overallStatus is HealthState.OK)
        events = await eventually(
            lambda: asyncio.sleep(0, read_events(tmp_path / "events.jsonl")), lambda events: len(events) >= 2
        )
        assert [e["detail"]["overall_status"] for e in events] == ["INSUFFICIENT_DATA", "OK"]
        await handle.terminate("test over")


async def test_critical_daemon_down_is_an_impaired_daemon_check(client: Client, aws_env: str, tmp_path: Path) -> None:
    instance = unique("i")
    async with monitor_only(client, aws_env, tmp_path) as (settings, group):
        handle = await start_health(client, settings, instance)
        await eventually(lambda: health_of(handle), lambda v: v.healthStatus.overallStatus is HealthState.OK)
        persistenced = finding(instance, group, "d-1", impairs=False).model_copy(
            update={"kind": "daemon", "code": None, "reason": "DAEMON_nvidia-persistenced", "gpu": GpuRef()}
        )
        fabric = persistenced.model_copy(
            update={"finding_id": "d-2", "reason": "DAEMON_nvidia-fabricmanager", "impairs": True}
        )
        await handle.signal("gpu_finding", persistenced)
        await handle.signal("gpu_finding", fabric)

        # Monitor only: impaired, and the repair decision recorded as withheld.
        view = await eventually(lambda: health_of(handle), lambda v: v.repair_withheld is not None)
        daemon = next(d for d in view.healthStatus.details if d.type is CheckType.DAEMON)
        assert (daemon.status, daemon.statusReason) == (HealthState.IMPAIRED, "DAEMON_nvidia-fabricmanager")
        assert check(view, CheckType.ACCELERATED_COMPUTE) is HealthState.OK
        assert view.warning_counts == {"unknown/DAEMON_nvidia-persistenced": 1}

        # A second critical unit goes down; the first comes back: still IMPAIRED, now for the second.
        dcgm = fabric.model_copy(update={"finding_id": "d-3", "reason": "DAEMON_nvidia-dcgm"})
        await handle.signal("gpu_finding", dcgm)
        await handle.signal("gpu_finding", recovered(fabric, "d-4"))
        view = await eventually(
            lambda: health_of(handle),
            lambda v: any(d.statusReason == "DAEMON_nvidia-dcgm" for d in v.healthStatus.details),
        )
        assert check(view, CheckType.DAEMON) is HealthState.IMPAIRED

        # Both back: nothing latches, and the withheld repair decision is void.
        await handle.signal("gpu_finding", recovered(dcgm, "d-5"))
        view = await eventually(lambda: health_of(handle), lambda v: v.healthStatus.overallStatus is HealthState.OK)
        assert check(view, CheckType.DAEMON) is HealthState.OK
        assert view.repair_withheld is None and view.repair is None
        assert view.warning_counts == {"unknown/DAEMON_nvidia-persistenced": 1}  # a recovery is not a warning
        events = await eventually(
            lambda: asyncio.sleep(0, read_events(tmp_path / "events.jsonl")), lambda events: len(events) >= 4
        )
        assert [e["detail"]["overall_status"] for e in events][-1] == "OK"
        await handle.terminate("test over")


async def test_a_daemon_back_up_after_its_repair_began_stays_impaired(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    """A repair that started finishes: the host lost its fabric manager once and may again."""
    instance, group = unique("i"), unique("g")
    # Repairs ENABLED. The instance is not in ECS, so the repair begins and then fails at its drain step: all this
    # test needs of it is that it began.
    settings = make_settings(client, aws_env, tmp_path / "events.jsonl", group=group, cluster=group)
    async with running_worker(settings, client):
        handle = await start_health(client, settings, instance)
        fabric = finding(instance, group, "d-1").model_copy(
            update={"kind": "daemon", "code": None, "reason": "DAEMON_nvidia-fabricmanager", "gpu": GpuRef()}
        )
        await handle.signal("gpu_finding", fabric)
        view = await eventually(lambda: health_of(handle), lambda v: v.repair is not None)
        await handle.signal("gpu_finding", recovered(fabric, "d-2"))
        view = await eventually(lambda: health_of(handle), lambda v: len(v.recent_findings) == 2)
        daemon = next(d for d in view.healthStatus.details if d.type is CheckType.DAEMON)
        assert (daemon.status, daemon.statusReason) == (HealthState.IMPAIRED, "DAEMON_nvidia-fabricmanager")
        assert view.repair is not None and view.repair.reason == "DAEMON_nvidia-fabricmanager"
        for workflow_id in (view.repair.workflow_id, f"drain-semaphore/{group}", health_workflow_id(instance)):
            with contextlib.suppress(RPCError):  # the repair may already have failed
                await client.get_workflow_handle(workflow_id).terminate("test over")


def recovered(down: GpuFinding, finding_id: str) -> GpuFinding:
    return down.model_copy(update={"finding_id": finding_id, "kind": "daemon_recovered", "impairs": False})
