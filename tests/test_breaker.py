"""The breaker end to end: real Temporal dev server, moto over HTTP, the simulated fleet running the real probe, and
the operator's CLI. Behaviour, not timing: every wait is a poll with a generous bound."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.testing import ActivityEnvironment

from activities.breaker_ops import BreakerOps
from activities.models import FleetReports
from contract import names
from contract.breaker import FleetBreakerConfig, FleetBreakerView, ImpairmentReport
from contract.health import HealthState
from contract.ids import fleet_breaker_workflow_id, semaphore_workflow_id
from contract.repair import RepairPhase
from contract.semaphore import SemaphoreInput
from tests.fleet import Fleet, assert_start_before_stop, simulated_fleet
from tests.harness import eventually, make_settings, running_worker, unique
from tests.test_ops_cli import autorepair, cli_env, cli_json, described_instances
from tests.test_repair_engine import max_concurrently_draining
from workflows.models import InstanceHealthView, SemaphoreView


async def held(fleet: Fleet) -> SemaphoreView:
    return await eventually(fleet.semaphore, lambda view: view.breaker.held is not None, within=120)


async def settled_while_held(fleet: Fleet, repairs: int) -> set[str]:
    """Once every repair is either waiting (held) or finished with the permit it got before the trip (none, when the
    impairments were counted together): the instances that drained."""

    async def look() -> tuple[SemaphoreView, set[str], set[str]]:
        granted = {e["instance_id"] for e in fleet.events("DrainPermitGranted")}
        completed = {e["instance_id"] for e in fleet.events("RepairCompleted")}
        return await fleet.semaphore(), granted, completed

    _, granted, _ = await eventually(
        look,
        lambda seen: seen[0].holders == [] and len(seen[0].waiters) + len(seen[1]) == repairs and seen[1] == seen[2],
        within=400,
    )
    return granted


async def health_of(fleet: Fleet, instance_id: str) -> InstanceHealthView:
    handle = fleet.client.get_workflow_handle(f"health/{instance_id}")
    return await handle.query("health", result_type=InstanceHealthView)


@pytest.mark.timeout(600)  # ten repairs of a 20-instance fleet on a 2-core machine
async def test_ten_of_twenty_faulted_trip_the_breaker_at_most_six_drain_and_resume_lets_the_rest_through(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=20) as fleet:
        await fleet.all_healthy(20)
        faulty = fleet.sim.rng.sample(fleet.sim.live_instances(), 10)
        for instance_id in faulty:
            fleet.sim.inject_fault(instance_id)
        # A second finding on an already impaired instance must not start a second repair.
        fleet.sim.inject_fault(faulty[0], xid=48)

        view = await held(fleet)
        hold = view.breaker.held
        assert hold is not None and hold.cause == "impaired_percent"
        # Strictly more than 30% of 20; the reports that arrived together are counted together.
        assert 7 <= hold.count <= 10 and hold.threshold == 6
        # Every impaired instance gets a repair, but only the permits granted before the trip drain.
        await eventually(lambda: asyncio.sleep(0, fleet.events("RepairStarted")), lambda e: len(e) == 10)
        [event] = await eventually(lambda: asyncio.sleep(0, fleet.events("RepairsHeld")), lambda e: len(e) == 1)
        assert (
            event["detail"]["count"] == hold.count
            and event["detail"]["cause"] == "impaired_percent"
            and event["instance_id"] == ""
        )
        assert set(event["detail"]["instances"]) <= set(faulty) and len(event["detail"]["instances"]) == hold.count

        described = await cli_json(fleet.settings, "group", "describe", "--name", fleet.group)
        assert described["breaker"]["held"]["count"] == hold.count
        code, out, _ = await autorepair(cli_env(fleet.settings), "group", "describe", "--name", fleet.group)
        assert code == 0 and "HELD by the group's breaker" in out
        waiting = await eventually(
            lambda: described_instances(fleet.settings, "--group", fleet.group, "--status", "IMPAIRED"),
            lambda entries: any(e.get("repairHeld") for e in entries),
        )
        assert all(e["repairHeld"] == hold.message for e in waiting if e["repair"]["phase"] == "WaitingForPermit")

        granted_before = await settled_while_held(fleet, 10)
        assert len(granted_before) <= 6
        view = await fleet.semaphore()
        assert view.breaker.held is not None and view.holders == []
        assert len(view.waiters) == 10 - len(granted_before)  # held, not dropped

        code, out, err = await autorepair(cli_env(fleet.settings), "group", "update", "--name", fleet.group, "--resume")
        assert code == 0, err
        assert "repairs resumed" in out
        assert len(await fleet.repairs_finished(10, within=400)) == 10
        await fleet.all_healthy(20)
        [resumed] = fleet.events("RepairsResumed")
        assert (
            resumed["detail"]["discard_held"] is False
            and resumed["detail"]["held"]["count"] == hold.count
            and resumed["detail"]["requested_by"]
        )

        for instance_id in faulty:
            await assert_start_before_stop(fleet, instance_id)
        assert len(fleet.events("RepairStarted")) == 10
        assert max_concurrently_draining(fleet.events()) <= 4
        view = await fleet.semaphore()
        assert view.breaker.held is None and view.breaker.last_resume is not None
        assert 1 <= view.max_holders_seen <= 4
        # Resuming what is not held is refused in one line.
        code, _, err = await autorepair(cli_env(fleet.settings), "group", "update", "--name", fleet.group, "--resume")
        assert code == 2 and "not held" in err


@pytest.mark.timeout(600)  # ten repairs of a 20-instance fleet on a 2-core machine
async def test_discard_held_repairs_only_the_instances_whose_fault_is_seen_again(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=20, seed=23) as fleet:
        await fleet.all_healthy(20)
        faulty = fleet.sim.rng.sample(fleet.sim.live_instances(), 10)
        for instance_id in faulty:
            fleet.sim.inject_fault(instance_id)
        await held(fleet)
        granted = await settled_while_held(fleet, 10)
        assert len(granted) <= 6
        waiting = {w.instance_id for w in (await fleet.semaphore()).waiters}
        assert waiting == set(faulty) - granted

        await cli_json(fleet.settings, "group", "update", "--name", fleet.group, "--resume", "--discard-held")
        discarded = await eventually(
            lambda: asyncio.sleep(0, {e["instance_id"] for e in fleet.events("RepairDiscarded")}),
            lambda ids: ids == waiting,
        )
        for instance_id in discarded:
            view = await eventually(
                lambda i=instance_id: health_of(fleet, i),  # type: ignore[misc]
                lambda v: v.repair is not None and v.repair.phase is RepairPhase.DISCARDED,
            )
            # Never touched, and back to OK until its fault is seen again.
            assert fleet.ec2_state(instance_id) == "running" and fleet.replacements_of(instance_id) == []
            assert view.healthStatus.overallStatus is HealthState.OK

        again = sorted(discarded)[:2]
        for instance_id in again:
            fleet.sim.inject_fault(instance_id)
        await eventually(
            lambda: asyncio.sleep(0, {e["instance_id"] for e in fleet.events("RepairCompleted")}),
            lambda ids: ids == granted | set(again),
            within=400,
        )
        for instance_id in sorted(discarded - set(again)):
            assert fleet.ec2_state(instance_id) == "running" and fleet.replacements_of(instance_id) == []
        [resumed] = fleet.events("RepairsResumed")
        assert resumed["detail"]["discard_held"] is True


async def test_the_fleet_breaker_holds_every_group_on_a_surge_across_groups(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    groups = [unique("fleet-a"), unique("fleet-b")]
    settings = make_settings(client, aws_env, tmp_path / "events.jsonl", group=groups[0], cluster=groups[0])
    settings.groups.append(settings.groups[0].model_copy(update={"name": groups[1], "cluster": groups[1]}))
    fleet_id = fleet_breaker_workflow_id(settings.temporal.task_queue)
    async with running_worker(settings, client):
        # Three impairments per group: under each group's own breaker (more than 3), over the fleet's (more than 5).
        for group in groups:
            for k in range(3):
                report = ImpairmentReport(instance_id=f"i-{group}-{k}", group=group, at=datetime.now(UTC))
                await client.start_workflow(
                    names.SEMAPHORE_WORKFLOW,
                    SemaphoreInput(group=group),
                    id=semaphore_workflow_id(group),
                    task_queue=settings.temporal.task_queue,
                    id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                    start_signal=names.SIGNAL_IMPAIRED,
                    start_signal_args=[report],
                )
        described = await eventually(
            lambda: cli_json(settings, "fleet", "describe"), lambda d: d["running"] and d["breaker"]["held"]
        )
        assert described["breaker"]["held"]["count"] == 6 and sorted(described["breaker"]["groups"]) == groups
        for group in groups:
            view = await eventually(
                lambda g=group: client.get_workflow_handle(semaphore_workflow_id(g)).query(  # type: ignore[misc]
                    "state", result_type=SemaphoreView
                ),
                lambda v: v.breaker.fleet_held is not None,
            )
            assert view.breaker.held is None  # neither group's own breaker tripped
        # The group's own resume is not the way out; the fleet's is.
        code, _, err = await autorepair(cli_env(settings), "group", "update", "--name", groups[0], "--resume")
        assert code == 2 and "fleet resume" in err
        code, out, err = await autorepair(cli_env(settings), "fleet", "resume")
        assert code == 0 and "resumed" in out, err
        for group in groups:
            await eventually(
                lambda g=group: client.get_workflow_handle(semaphore_workflow_id(g)).query(  # type: ignore[misc]
                    "state", result_type=SemaphoreView
                ),
                lambda v: v.breaker.fleet_held is None,
            )
        fleet_view = await client.get_workflow_handle(fleet_id).query("fleet_breaker")
        assert fleet_view["held"] is None and fleet_view["last_resume"]["held"]["count"] == 6


async def test_impairments_counted_together_reach_the_fleet_breaker_each_once(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    """The semaphore's batch of a surge's impairments (one activity): each reaches the fleet breaker, started by the
    first; the activity's retry sends them all again and none counts twice."""
    group = unique("fleet-c")
    settings = make_settings(client, aws_env, tmp_path / "events.jsonl", group=group, cluster=group)
    ops = BreakerOps(client, settings.temporal.task_queue, FleetBreakerConfig(groups=[group]))
    now = datetime.now(UTC)
    batch = FleetReports(
        reports=[ImpairmentReport(instance_id=f"i-{group}-{k}", group=group, at=now, group_size=100) for k in range(5)]
    )
    handle = client.get_workflow_handle(fleet_breaker_workflow_id(settings.temporal.task_queue))
    async with running_worker(settings, client):
        await ActivityEnvironment().run(ops.report_many_to_fleet_breaker, batch)
        await ActivityEnvironment().run(ops.report_many_to_fleet_breaker, batch)  # as a retry would
        view = await eventually(
            lambda: handle.query(names.QUERY_FLEET_BREAKER, result_type=FleetBreakerView),
            lambda v: v.impaired_in_window >= 5,
        )
        assert view.impaired_in_window == 5 and view.groups == {group: 100}
        events = [e async for e in handle.fetch_history_events()]
        signals = [e for e in events if e.HasField("workflow_execution_signaled_event_attributes")]
        assert len(signals) == 10  # every report went, twice: the breaker, not the wire, takes a repeat as one
