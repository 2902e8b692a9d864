"""What AWS itself says of an instance (issue 14): EC2 status checks, EC2 scheduled events, the ECS agent's connection.

On the real dev server and moto over HTTP; moto says every status check is "ok", with no event, and every ECS agent
connected, so the engine's calls go through the fault proxy, which edits moto's answers (tests/aws_says.py). The
worker's per-group reader (worker/aws_watch.py) runs as `autorepair worker` runs it, reading every second.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import boto3
from temporalio.client import Client

from activities.aws import AwsClients
from contract import names
from contract.breaker import MaintenanceWindow
from contract.formats import iso
from contract.groups import AutoRepair
from contract.health import CheckType, HealthState
from contract.ids import health_workflow_id
from simulator.aws_proxy import FlakyAws
from tests.aws_says import AwsSays, Check, Event
from tests.fleet import START_BEFORE_STOP, Fleet, assert_start_before_stop, simulated_fleet
from tests.harness import eventually, make_settings, running_worker, unique
from tests.test_health_signals import health_of, start_health, temporal_cli
from worker.aws_watch import aws_watch
from workflows.models import HealthCheckResult, InstanceHealthView

INTERVAL = timedelta(seconds=1)
GRACE = timedelta(seconds=8)
LEAD = timedelta(hours=1)


def aws_settings(**update: Any) -> dict[str, Any]:
    return {
        "aws_status_interval": INTERVAL,
        "status_check_grace": GRACE,
        "agent_disconnect_grace": GRACE,
        "scheduled_event_lead": LEAD,
    } | update


def at(event: dict[str, Any], key: str = "time") -> datetime:
    return datetime.fromisoformat(event[key])


def check_of(view: InstanceHealthView, kind: CheckType) -> HealthCheckResult | None:
    return next((d for d in view.healthStatus.details if d.type is kind), None)


async def history_counts(client: Client, instance_id: str) -> tuple[int, int]:
    """aws_status signals the instance's health workflow received, and breaker reports it made."""
    history = await client.get_workflow_handle(health_workflow_id(instance_id)).fetch_history()
    signals = reports = 0
    for event in history.events:
        if event.HasField("workflow_execution_signaled_event_attributes"):
            signals += event.workflow_execution_signaled_event_attributes.signal_name == names.SIGNAL_AWS_STATUS
        if event.HasField("activity_task_scheduled_event_attributes"):
            reports += event.activity_task_scheduled_event_attributes.activity_type.name == "report_impairment"
    return signals, reports


def not_now() -> MaintenanceWindow:
    """A one-minute window half a day away: outside it, only critical repairs get a drain permit."""
    start = datetime.now(UTC) + timedelta(hours=12)
    return MaintenanceWindow(start=start.time(), end=(start + timedelta(minutes=1)).time())


async def test_an_impaired_status_check_and_a_scheduled_retirement_are_replaced_and_a_blip_is_not(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    with FlakyAws(aws_env) as proxy:
        says = AwsSays(proxy)
        settings = aws_settings(maintenance_windows=[not_now()])
        async with simulated_fleet(
            client, aws_env, tmp_path, instances=4, engine_proxy=proxy, group_settings=settings
        ) as fleet:
            await fleet.all_healthy(4)
            broken, blip, retiring, healthy = fleet.sim.live_instances()
            async with AwsClients(fleet.settings.aws) as aws, aws_watch(fleet.settings, client, aws):
                t0 = datetime.now(UTC).replace(microsecond=0)
                not_before = t0 + LEAD + timedelta(seconds=6)
                says.status(broken, system=Check("impaired", since=t0))
                says.status(blip, instance=Check("impaired", since=t0))
                says.events(retiring, Event("instance-retirement", not_before, "instance-event-0123456789abcdef0"))
                await asyncio.sleep(4)
                says.status(blip)  # ok again, well before its grace
                assert sorted(await fleet.repairs_finished(2, within=240)) == sorted([broken, retiring])
                await asyncio.sleep(2)  # the blip's grace would have ended long since

            # The status check: IMPAIRED once impaired for the grace (counted from EC2's ImpairedSince), replaced.
            await assert_start_before_stop(fleet, broken)
            impaired = [e for e in fleet.events("HealthChanged", broken) if e["detail"]["overall_status"] == "IMPAIRED"]
            assert impaired and at(impaired[0]) >= t0 + GRACE
            [started] = fleet.events("RepairStarted", broken)
            assert (
                started["detail"]["reason"]
                == f"EC2 system status check impaired since {iso(t0, 'seconds')} (reachability failed)"
            )

            # The retirement: found at once with its deadline, repaired once inside the lead time, before NotBefore.
            assert fleet.steps(retiring) == ["ScheduledEventFound", *START_BEFORE_STOP]
            await assert_start_before_stop(fleet, retiring, tolerating={"ScheduledEventFound"})
            [found] = fleet.events("ScheduledEventFound", retiring)
            # EC2's event id is in detail; the envelope's event_id stays the event's own (the dedupe id).
            assert found["detail"]["code"] == "instance-retirement"
            assert found["detail"]["ec2_event_id"] == "instance-event-0123456789abcdef0" != found["event_id"]
            assert (
                at(found["detail"], "deadline") == not_before and at(found["detail"], "repair_at") == not_before - LEAD
            )
            assert at(found) < not_before - LEAD
            [started] = fleet.events("RepairStarted", retiring)
            assert (
                started["detail"]["reason"]
                == f"EC2 scheduled instance-retirement not before {iso(not_before, 'seconds')}"
            )
            assert at(started) >= not_before - LEAD
            assert at(fleet.events("RepairCompleted", retiring)[0]) < not_before

            # Both critical (outside every maintenance window, granted anyway); only the status check is counted.
            semaphore = await fleet.semaphore()
            assert semaphore.breaker.in_maintenance_window is False
            assert semaphore.breaker.impaired_in_window == 1
            assert (await history_counts(client, broken))[1] == 1
            assert (await history_counts(client, retiring))[1] == 0

            # The blip changed nothing: no EC2_STATUS check, no health change, no repair. A healthy instance was
            # never signalled; the blip twice (impaired, ok), not once a read.
            assert_nothing_happened(fleet, blip)
            view = await health_of(client.get_workflow_handle(health_workflow_id(blip)))
            assert check_of(view, CheckType.EC2_STATUS) is None and view.healthStatus.overallStatus is HealthState.OK
            assert (await history_counts(client, blip))[0] == 2
            assert (await history_counts(client, healthy))[0] == 0


def assert_nothing_happened(fleet: Fleet, instance_id: str) -> None:
    assert fleet.steps(instance_id) == []
    assert all(e["detail"]["overall_status"] != "IMPAIRED" for e in fleet.events("HealthChanged", instance_id))


def register(moto: str, cluster: str, count: int) -> list[str]:
    """`count` running EC2 instances with connected container instances in `cluster`, in moto."""
    ec2 = boto3.client("ec2", endpoint_url=moto, region_name="us-east-1")
    ecs = boto3.client("ecs", endpoint_url=moto, region_name="us-east-1")
    ecs.create_cluster(clusterName=cluster)
    launched = ec2.run_instances(ImageId="ami-12c6146b", MinCount=count, MaxCount=count)["Instances"]
    ids = sorted(i["InstanceId"] for i in launched)
    for instance_id in ids:
        document = {"instanceId": instance_id, "region": "us-east-1", "availabilityZone": "us-east-1a"}
        ecs.register_container_instance(cluster=cluster, instanceIdentityDocument=json.dumps(document))
    return ids


async def test_insufficient_data_alternating_reasons_and_the_ecs_agent(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    group = unique("g")
    settings = make_settings(
        client, aws_env, tmp_path / "events.jsonl", group=group, cluster=group, auto_repair=AutoRepair.DISABLED
    )
    grace = timedelta(seconds=10)
    settings.groups = [settings.groups[0].model_copy(update=aws_settings(status_check_grace=grace))]
    unknown, alternating, agent_down, agent_blip, healthy = register(aws_env, group, 5)
    with FlakyAws(aws_env) as proxy:
        says = AwsSays(proxy)
        settings.aws = settings.aws.model_copy(update={"endpoint_url": proxy.url})
        async with running_worker(settings, client):
            handles = {i: await start_health(client, settings, i) for i in (unknown, alternating, agent_down)}
            handles |= {i: await start_health(client, settings, i) for i in (agent_blip, healthy)}
            for handle in handles.values():
                await eventually(partial(health_of, handle), lambda v: v.healthStatus.overallStatus is HealthState.OK)
            async with AwsClients(settings.aws) as aws, aws_watch(settings, client, aws) as [watch]:
                t0 = datetime.now(UTC).replace(microsecond=0)
                says.status(unknown, instance=Check("insufficient-data"))
                says.status(alternating, system=Check("impaired", since=t0))
                says.agent(agent_down, connected=False)
                says.agent(agent_blip, connected=False)
                await temporal_cli(
                    client, "workflow", "signal", "--workflow-id", health_workflow_id(healthy), "--name", "aws_status"
                )
                await asyncio.sleep(4)
                says.agent(agent_blip, connected=True)  # back before its grace
                await asyncio.sleep(1)
                # Another reason, with a later ImpairedSince, while the check stays bad; then the first one again.
                says.status(alternating, instance=Check("impaired", since=t0 + timedelta(seconds=5)))
                await asyncio.sleep(2)
                says.status(alternating, system=Check("impaired", since=t0 + timedelta(seconds=7)))

                # The grace ran from the first reason's start: not restarted by the second (t0 + 5 s + grace).
                # IMPAIRED, and not repaired: the group is DISABLED.
                view = await eventually(
                    lambda: health_of(handles[alternating]),
                    lambda v: v.healthStatus.overallStatus is HealthState.IMPAIRED and v.repair_withheld is not None,
                    within=60,
                )
                ec2 = check_of(view, CheckType.EC2_STATUS)
                assert ec2 is not None and ec2.status is HealthState.IMPAIRED
                assert t0 + grace <= ec2.lastStatusChange < t0 + grace + timedelta(seconds=4.5)
                assert (
                    ec2.statusReason
                    == f"EC2 system status check impaired since {iso(t0, 'seconds')} (reachability failed)"
                )
                assert view.repair is None

                # The ECS agent, apart from the probe's heartbeat loss: its own reason; back, OK again.
                view = await eventually(
                    lambda: health_of(handles[agent_down]),
                    lambda v: v.healthStatus.overallStatus is HealthState.IMPAIRED,
                    within=60,
                )
                agent = check_of(view, CheckType.AGENT_CONNECTIVITY)
                assert agent is not None and (agent.statusReason or "").startswith("ECS agent disconnected since ")
                assert agent.lastStatusChange >= t0 + GRACE
                says.agent(agent_down, connected=True)
                await eventually(
                    lambda: health_of(handles[agent_down]),
                    lambda v: v.healthStatus.overallStatus is HealthState.OK,
                    within=30,
                )

                # insufficient-data: INSUFFICIENT_DATA, and still so well past the grace, never IMPAIRED.
                await asyncio.sleep(max(0.0, (t0 + grace + timedelta(seconds=3) - datetime.now(UTC)).total_seconds()))
                view = await health_of(handles[unknown])
                ec2 = check_of(view, CheckType.EC2_STATUS)
                assert ec2 is not None and ec2.status is HealthState.INSUFFICIENT_DATA
                assert view.healthStatus.overallStatus is HealthState.INSUFFICIENT_DATA

                # The agent's blip changed nothing; the healthy instance was never told anything, and the empty
                # signal sent to it by hand was dropped, counted.
                view = await health_of(handles[agent_blip])
                assert [d.status for d in view.healthStatus.details] == [HealthState.OK, HealthState.OK]
                assert (await history_counts(client, agent_blip))[0] == 2
                view = await health_of(handles[healthy])
                assert view.rejected_signals == 1 and view.healthStatus.overallStatus is HealthState.OK
                assert (await history_counts(client, healthy))[0] == 1  # the one sent by hand
                assert watch.rounds >= 10

    events = [e for e in _events(tmp_path) if e["type"] == "HealthChanged"]
    assert not any(
        e["detail"]["overall_status"] == "IMPAIRED" for e in events if e["instance_id"] in (unknown, agent_blip)
    )


def _events(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
