"""A repair survives a SIGKILLed worker in each of its phases, and a restarted Temporal server, and still ends
exactly once: one replacement launched and one instance terminated per impaired instance (counted in moto's EC2:
instances, tags, states), each step's event once, one repair execution, and no drain permit left held.

Real servers: a Temporal dev server of this module's own with its state in a SQLite file (so it can be restarted),
moto over HTTP, the simulated fleet running the real probe, and `autorepair worker` as a child process. The engine
talks to AWS through `HoldingAws`, which can hold back the answer to one call after moto has carried it out.

How each phase is made long enough to be hit, with settings and the simulated world only:
- waiting for the permit: another repair holds the group's only permit, in a long stop timeout;
- draining, launching, terminating: the step's AWS call is done and its answer held; the kill lands while the
  activity is in flight, so the new worker must run it again (after the activity's 60 s start-to-close timeout,
  CALL_TIMEOUT) and find the work already done. One kill serves the three, each in a repair of its own;
- waiting for the replacement: the replacement takes 15 s to register in ECS;
- stopping tasks: a task that ignores the drain, with a 15 s stop timeout (the durable timer).

Before each kill the test waits until nothing is in flight on the task queue but the step under test, so the kill
costs no other workflow an activity timeout. Every wait is a poll with a generous bound: behaviour, not speed.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from contract.repair import RepairPhase
from simulator.fleet import SimTiming, SimulatedFleet
from simulator.fleet_aws import SimWorkload
from simulator.servers import TemporalDevServer, free_port
from tests.durability_harness import (
    DurableFleet,
    assert_group_whole,
    assert_instance_repaired_once,
    assert_repaired_exactly_once,
    durable_fleet,
    in_flight,
    in_phase,
    quiet_but,
    recorded_phase,
    repair_id,
)
from tests.harness import eventually
from workflows.repair import RUNBOOK

# About half the instances run one task that ignores the drain (only StopTask after its LONG_STOP s stop timeout
# ends it); the others' tasks all leave when drained. The tests pick the instances whose plan fits their phase.
LONG_STOP = 15
WORKLOAD = SimWorkload(stop_timeouts_s=(LONG_STOP,), stubborn_fraction=0.5)
# One look every 10 s: a kill in STOPPING_TASKS meets the wait's one call (a look at 10 s, another at the LONG_STOP
# timeout), whose heartbeat timeout (four looks: 40 s) hands it to the restarted worker.
GROUP = {"task_poll_interval": timedelta(seconds=10)}
STARTED = "PENDING_ACTIVITY_STATE_STARTED"
OUTAGE = SimTiming.compressed().heartbeat_loss_threshold + timedelta(seconds=2)


def stop_time(sim: SimulatedFleet, instance_id: str) -> int:
    """How long the instance's STOPPING_TASKS will last: the stop timeout of its task that ignores the drain."""
    plan = sim.node(instance_id).task_plan or []
    return max((timeout for timeout, stubborn in plan if stubborn), default=0)


def pick(sim: SimulatedFleet, *, long: bool, taken: tuple[str, ...] = ()) -> str:
    """An instance whose tasks stop late (`long`) or at once; the seed makes the plans the same on every run."""
    fits = [i for i in sim.live_instances() if i not in taken and (stop_time(sim, i) == LONG_STOP) == long]
    assert fits, f"no instance with {'a long' if long else 'no long'} stop timeout among {sim.live_instances()}"
    return fits[0]


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("durability")


@pytest.fixture(scope="module")
async def server(state_dir: Path) -> AsyncIterator[TemporalDevServer]:
    """This module's dev server, its state in a file: a restart on the same file and port loses nothing."""
    dev = TemporalDevServer(
        state_dir / "temporal",
        port=free_port(),
        ui_port=free_port(),
        extra_args=["--headless", "--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=200"],
    )
    await dev.start()
    try:
        yield dev
    finally:
        await dev.stop()


@pytest.fixture(scope="module")
async def temporal(server: TemporalDevServer) -> Client:
    return await Client.connect(server.address, data_converter=pydantic_data_converter)


# --- killed while waiting: the permit, the replacement, the stop timeouts ---------------------------------------


@dataclass(frozen=True)
class Wait:
    phase: RepairPhase
    timing: dict[str, Any] = field(default_factory=dict)
    activity: str | None = None  # the one call in flight at the kill, if the wait is a call


WAITS = [
    Wait(RepairPhase.WAITING_FOR_PERMIT),
    Wait(RepairPhase.WAITING_FOR_REPLACEMENT, {"boot_delay": timedelta(seconds=15)}, "await_container_instance_active"),
    Wait(RepairPhase.STOPPING_TASKS, activity="wait_for_tasks_to_stop"),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", WAITS, ids=[w.phase.value for w in WAITS])
async def test_worker_killed_while_waiting(case: Wait, temporal: Client, aws_env: str, tmp_path: Path) -> None:
    async with durable_fleet(
        temporal, aws_env, tmp_path, timing=case.timing, workload=WORKLOAD, group_settings=GROUP
    ) as d:
        task_queue = d.fleet.settings.temporal.task_queue
        if case.phase is RepairPhase.WAITING_FOR_PERMIT:
            # The group's one permit (5 instances at 20%) goes to a repair that then waits out a long stop timeout.
            holder = pick(d.sim, long=True)
            target = pick(d.sim, long=False, taken=(holder,))
            d.sim.inject_fault(holder)
            holding = await repair_id(d, holder)
            await in_phase(temporal, holding, RepairPhase.STOPPING_TASKS)
            # The holder waits out its stop timeout in its one call.
            calls = {holding: "wait_for_tasks_to_stop"}
            impaired = [holder, target]
        else:
            target = pick(d.sim, long=case.phase is RepairPhase.STOPPING_TASKS)
            calls = {}
            impaired = [target]
        d.sim.inject_fault(target)
        repair = await repair_id(d, target)
        await in_phase(temporal, repair, case.phase)
        if case.phase is RepairPhase.WAITING_FOR_PERMIT:
            await eventually(d.fleet.semaphore, lambda s: [w.instance_id for w in s.waiters] == [target])
        await quiet_but(temporal, task_queue, calls | ({repair: case.activity} if case.activity else {}))

        await d.worker.kill()
        assert await recorded_phase(temporal, repair) == case.phase.value
        await d.worker.start()

        assert sorted(await d.fleet.repairs_finished(len(impaired), within=120)) == sorted(impaired)
        await assert_repaired_exactly_once(d, impaired)
        if case.phase is RepairPhase.STOPPING_TASKS:
            # Its task that ignores the drain was stopped at its timeout, and the drain went on to the end. (By
            # event_id: a sink may write an event twice across the kill.)
            stopped = {e["event_id"]: e["detail"] for e in d.fleet.events("TasksStopped", target)}
            assert list(stopped.values()) == [{"tasks": 1, "forced": 1}]


# --- killed mid-call: draining, launching, terminating, one kill for the three -----------------------------------

# The phase, its activity, and the AWS call whose answer is held.
MID_CALL = {
    RepairPhase.DRAINING: ("set_draining", "UpdateContainerInstancesState"),
    RepairPhase.LAUNCHING_REPLACEMENT: ("launch_replacement", "RunInstances"),
    RepairPhase.TERMINATING: ("terminate_instance", "TerminateInstances"),
}


@dataclass
class MidCallKill:
    """One SIGKILL that found three repairs each with its phase's AWS call done and its answer held."""

    durable: DurableFleet
    instances: dict[RepairPhase, str]
    needles: dict[RepairPhase, str]  # what names the instance in its held call
    repairs: dict[RepairPhase, str]
    recorded: dict[RepairPhase, str | None]  # the phase the server had on record once the worker was dead
    in_flight: dict[str, list[tuple[str, str]]]  # pending activities on the task queue just before the kill


@pytest.fixture(scope="module")
async def mid_call_kill(temporal: Client, aws_env: str, state_dir: Path) -> AsyncIterator[MidCallKill]:
    # Three permits at once (60% of 5); three impaired are not more than the breaker's min_impaired (3).
    tmp_path = state_dir / "mid-call"
    tmp_path.mkdir()
    group = {**GROUP, "max_draining_percent": 60}
    async with durable_fleet(temporal, aws_env, tmp_path, workload=WORKLOAD, group_settings=group) as d:
        # The one that must get as far as terminating stops its tasks at once.
        terminating = pick(d.sim, long=False)
        others = [i for i in d.sim.live_instances() if i != terminating]
        instances = {
            RepairPhase.DRAINING: others[0],
            RepairPhase.LAUNCHING_REPLACEMENT: others[1],
            RepairPhase.TERMINATING: terminating,
        }
        drained_arn = d.sim.node(others[0]).container_instance_arn
        assert drained_arn is not None
        needles = {phase: instances[phase] for phase in MID_CALL} | {RepairPhase.DRAINING: drained_arn}
        held = [d.aws.hold(MID_CALL[phase][1], needles[phase]) for phase in MID_CALL]
        for instance_id in instances.values():
            d.sim.inject_fault(instance_id)
        repairs = {phase: await repair_id(d, instance_id) for phase, instance_id in instances.items()}
        for phase, repair in repairs.items():
            await in_phase(temporal, repair, phase)
        for call in held:
            assert await asyncio.to_thread(call.arrived.wait, 30), f"{call.action} on {call.needle} never came"
        task_queue = d.fleet.settings.temporal.task_queue
        await quiet_but(temporal, task_queue, {repairs[phase]: MID_CALL[phase][0] for phase in MID_CALL})
        before = await in_flight(temporal, task_queue)

        await d.worker.kill()
        d.aws.release_all()  # to a dead socket: the answers are lost with the worker
        recorded = {phase: await recorded_phase(temporal, repair) for phase, repair in repairs.items()}
        await d.worker.start()

        # The three calls are run again once their attempts time out (CALL_TIMEOUT, 60 s): well within the bound.
        assert sorted(await d.fleet.repairs_finished(3, within=180)) == sorted(instances.values())
        yield MidCallKill(d, instances, needles, repairs, recorded, before)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("phase", list(MID_CALL), ids=[p.value for p in MID_CALL])
async def test_worker_killed_mid_call(phase: RepairPhase, mid_call_kill: MidCallKill) -> None:
    kill = mid_call_kill
    activity, action = MID_CALL[phase]
    instance_id, repair = kill.instances[phase], kill.repairs[phase]
    assert kill.recorded[phase] == phase.value
    assert kill.in_flight[repair] == [(activity, STARTED)]
    await assert_instance_repaired_once(kill.durable, instance_id)
    await assert_group_whole(kill.durable, list(kill.instances.values()))
    # What the new worker's run of the step did, given that AWS had done it already:
    # Found it done (DRAINING already; a replacement tagged for it; terminated in EC2) and called nothing again.
    assert kill.durable.aws.requests(action, kill.needles[phase]) == 1


# --- the Temporal server restarted mid-repair --------------------------------------------------------------------


@pytest.mark.timeout(150)
async def test_temporal_restarted_mid_launch(
    server: TemporalDevServer, temporal: Client, aws_env: str, tmp_path: Path
) -> None:
    """The server is SIGKILLed while the launch is done in EC2 and its answer not yet given, and started again on the
    same file and port after an outage longer than the heartbeat-loss threshold; the same worker reconnects, reports
    the launch, the repair ends once, and no other instance is repaired."""
    async with durable_fleet(temporal, aws_env, tmp_path, workload=WORKLOAD, group_settings=GROUP) as d:
        target = pick(d.sim, long=False)
        held = d.aws.hold("RunInstances", target)
        d.sim.inject_fault(target)
        repair = await repair_id(d, target)
        await in_phase(temporal, repair, RepairPhase.LAUNCHING_REPLACEMENT)
        assert await asyncio.to_thread(held.arrived.wait, 30)
        worker_pid = d.worker.pid

        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        await server.stop()
        # Down for longer than the group's heartbeat-loss threshold: an outage of Temporal is nobody's loss.
        await asyncio.sleep(OUTAGE.total_seconds())
        await server.start()
        # Read once the client has reconnected (gRPC's own backoff): the server kept the phase in its file.
        launching = RepairPhase.LAUNCHING_REPLACEMENT.value
        assert await eventually(lambda: recorded_phase(temporal, repair), lambda p: p == launching, within=90)
        d.aws.release_all()

        assert await d.fleet.repairs_finished(1, within=120) == [target]
        assert d.worker.alive and d.worker.pid == worker_pid and d.worker.starts == 1
        await assert_repaired_exactly_once(d, [target])
        assert d.aws.requests("RunInstances", target) == 1


def _phases() -> Iterator[RepairPhase]:
    yield from (w.phase for w in WAITS)
    yield from MID_CALL


def test_every_phase_of_the_runbook_is_killed_in() -> None:
    """The kills above cover each phase a repair can be in before it ends."""
    assert sorted(_phases()) == sorted(phase for phase, _ in RUNBOOK)
