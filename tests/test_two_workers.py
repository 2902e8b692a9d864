"""Two worker replicas share one task queue, and so the load: several repairs run at once, both workers run their
workflow and activity tasks, one worker is SIGKILLed while the repairs are in flight, and every repair still completes
exactly once on the worker that is left.

Real servers: a Temporal dev server, moto over HTTP (behind the harness's proxy, which holds nothing here), the
simulated fleet with the real probe, `autorepair worker` as two child processes. Every wait is a poll with a generous
bound: this asserts behaviour, not speed.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.client import Client

from tests.durability_harness import (
    DurableFleet,
    assert_repaired_exactly_once,
    durable_fleet,
    in_flight_by_worker,
    pollers,
    task_identities,
    worker_identity,
)
from tests.harness import eventually, worker_process

# The drain cap is max(1, floor(15 x 20%)) = 3: three repairs run at once and the fourth waits for a permit. Four of
# fifteen impaired (27%) stays below the breaker's "more than 30%", so nothing is held.
INSTANCES = 15
FAULTS = 4
# Far above the simulated boot (2 s to ACTIVE): a replacement slow on a loaded machine (its wait retried on the other
# worker after the kill) must not be abandoned, which would launch a second one. Not longer: the wait's heartbeat
# timeout is a quarter of it (25 s), and a wait killed with its worker is taken again only after that.
GROUP = {"replacement_ready_timeout": timedelta(seconds=100)}


def permits(d: DurableFleet) -> tuple[set[str], set[str]]:
    """The instances whose repair was granted a drain permit, and those whose repair handed it back."""
    granted = {e["instance_id"] for e in d.fleet.events("DrainPermitGranted")}
    released = {e["instance_id"] for e in d.fleet.events("DrainPermitReleased")}
    return granted, released


@pytest.mark.timeout(480)
async def test_two_workers_share_the_repairs_and_a_sigkill_of_one_mid_run_repairs_each_instance_once(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with durable_fleet(client, aws_env, tmp_path, instances=INSTANCES, group_settings=GROUP) as d:
        task_queue = d.fleet.settings.temporal.task_queue
        async with worker_process(d.fleet.settings, tmp_path / "worker-2.log") as other:
            workers = {worker_identity(d.worker): d.worker, worker_identity(other): other}
            # Both replicas poll the queue, for workflow tasks and for activity tasks, before any fault.
            await eventually(
                lambda: pollers(client, task_queue),
                lambda seen: all(set(workers) <= ids for ids in seen.values()),
                within=120,
                every=1,
            )

            faulted = d.sim.live_instances()[:FAULTS]
            for instance_id in faulted:
                d.sim.inject_fault(instance_id)

            # Several repairs in flight at once (past their permit, not finished), and both workers have run tasks.
            async def look() -> tuple[set[str], set[str], set[str]]:
                granted, released = permits(d)
                ran = await task_identities(client, task_queue) if len(granted - released) >= 2 else Counter()
                return granted, released, {identity for identity in ran if identity in workers}

            granted, released, ran = await eventually(
                look, lambda seen: len(seen[0] - seen[1]) >= 2 and seen[2] == set(workers), within=240, every=0.5
            )
            assert ran == set(workers), f"only {ran} ran tasks before the kill"
            assert len(granted - released) >= 2 and len(released) < FAULTS, (granted, released)

            # Kill the replica running the most activities now (the first, if neither runs one at this instant).
            running = await in_flight_by_worker(client, task_queue)
            victim_identity = max(workers, key=lambda identity: running[identity])
            victim = workers[victim_identity] if running[victim_identity] else d.worker
            survivor = other if victim is d.worker else d.worker
            await victim.kill()
            at_kill = permits(d)
            assert len(at_kill[1]) < FAULTS, f"every repair finished before the kill: {at_kill}"

            # The survivor takes over what the dead replica held: every repair ends, each once.
            await eventually(
                lambda: asyncio.sleep(0, permits(d)[1]), lambda done: done == set(faulted), within=300, every=1
            )
            assert survivor.alive, survivor.log_tail()
            assert not victim.alive
            await assert_repaired_exactly_once(d, faulted)
