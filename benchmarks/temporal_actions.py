"""Temporal Cloud actions: what a healthy instance costs per month, and what one repair costs, counted from the real
event histories of a simulated hour.

    .venv/bin/python -m benchmarks.temporal_actions [--compress 60] [--hours 2] [--sizes 12,100]
        [--replica-sizes 12,100] [--no-old] [--old-ref COMMIT] [--json FILE]       (repository root, ~3 min)

One Temporal dev server, moto, the worker in this process (and the old design's worker from git in a subprocess),
and these capacity groups side by side in one simulated hour, every duration divided by --compress (60: a 60 s
heartbeat every 1 s, a 10 min threshold 10 s, an hour 60 s; the ingest relay's flush tick too, but not the
tracker's loss grace, which never goes below 2 s: it moves deadlines, not how many there are):
  - ingest, one group per --sizes: heartbeats go through one LivenessRelay(relay=True), as the ingest sends them;
  - ingest with 2 replicas, one group per --replica-sizes: each heartbeat goes to one of two relays at random, as
    behind a round-robin load balancer; and 12 instances with session affinity (a host always reaches one replica);
  - probe direct (new design's trusted-lab mode, 12 instances): each probe its own LivenessRelay(relay=False);
  - direct signalling (the old design, 12 instances): every heartbeat a signal-with-start to the health workflow,
    served by the worker of commit OLD_REF (benchmarks.temporal_actions_old);
  - a repair: a SimulatedFleet of 3 instances whose real probes report through the ingest relay; one gets a
    critical Xid a few seconds into the hour and is repaired.
After the hour every run of every workflow is fetched and its billable actions counted
(benchmarks.temporal_actions_count); queries and activity heartbeats are counted as they are made. The hour is what
follows a warm-up in which every health workflow started: starts and first reads are reported per instance
lifetime, not multiplied by a month. benchmarks/ACTIONS.md records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

from benchmarks.probe_throughput import machine
from benchmarks.support import eventually
from benchmarks.temporal_actions_count import ActionCounter, fetch_executions
from benchmarks.temporal_actions_old import OLD_REF, OldWorker, old_tree
from benchmarks.temporal_actions_report import Measured, analyse, markdown
from contract import names
from contract.health import HealthState
from contract.probe import Heartbeat, ProbeSourceHealth
from simulator.events import repaired_instances
from simulator.fleet import SimTiming, SimulatedFleet
from simulator.probes import ProbeFleet, ProbeRunner

if TYPE_CHECKING:
    from contract.groups import CapacityGroup
    from node_probe.delivery.liveness_relay import LivenessRelay
    from simulator.nodes import SimNode

log = logging.getLogger("benchmarks.temporal_actions")

DEFAULT_HEARTBEAT = timedelta(seconds=60)
DEFAULT_THRESHOLD = timedelta(minutes=10)
SMALL = 12  # the size of the groups that compare designs
REPAIR_FLEET = 3
FAULT_AFTER_S = 2.0  # into the hour


@dataclass
class Fleet:
    """One capacity group of the hour: its design, its instances, the task queue its workflows run on."""

    label: str
    design: str
    group: str
    task_queue: str
    instances: list[str] = field(default_factory=list)


def heartbeat(instance_id: str, group: str) -> Heartbeat:
    """What a healthy probe sends: its GPU sources up, nothing new from one heartbeat to the next."""
    return Heartbeat(
        instance_id=instance_id,
        group=group,
        sent_at=datetime.now(UTC),
        sources=[ProbeSourceHealth(name="kmsg", state=HealthState.OK)],
    )


async def beat_forever(
    send: Callable[[Heartbeat], Awaitable[None]], instance_id: str, group: str, every: float, phase: float
) -> None:
    """A probe's heartbeats at a fixed rate from a random phase; a failed send is logged, as the probe would."""
    next_at = time.monotonic() + phase
    while True:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        next_at += every
        try:
            await send(heartbeat(instance_id, group))
        except Exception as err:
            log.warning("heartbeat of %s not sent: %s", instance_id, err)


def ingest_probe(relay: LivenessRelay) -> ProbeRunner:
    """The real probe on a simulated node, reporting through the ingest's relay (the HTTP hop changes no action)."""

    async def run(fleet: ProbeFleet, node: SimNode) -> None:
        from node_probe.probe import Probe, ProbeConfig

        config = ProbeConfig(
            instance_id=node.instance_id,
            group=fleet.group,
            kernel_log=node.kernel_log,
            heartbeat_interval=fleet.timing.heartbeat_interval,
            poll_interval=fleet.timing.probe_poll_interval,
            task_queue=fleet.task_queue,
            spool_dir=fleet.state_dir / "spool",
            retry_max_backoff=fleet.timing.heartbeat_interval,
        )
        await Probe(config, relay).run()

    return run


def capacity_group(name: str, heartbeat_s: float, threshold_s: float, compress: float) -> CapacityGroup:
    from contract.groups import AutoRepair, CapacityGroup

    return CapacityGroup(
        name=name,
        cluster=name,
        launch_template=f"{name}-lt",
        auto_repair=AutoRepair.ENABLED,
        heartbeat_interval=timedelta(seconds=heartbeat_s),
        heartbeat_loss_threshold=timedelta(seconds=threshold_s),
        # Only the repair's group uses these: scaled like the rest, but workflow timers below 1 s are not kept.
        task_poll_interval=timedelta(seconds=max(15 / compress, 1.0)),
        permit_reclaim_interval=timedelta(seconds=max(60 / compress, 1.0)),
        replacement_ready_timeout=timedelta(seconds=60),
    )


def old_settings_json(settings: Any, group: CapacityGroup, task_queue: str, events: Path) -> dict[str, Any]:
    """The old worker's settings: the same servers, its own queue and events file, its group; only what was set
    (the old schema forbids keys it does not know, and the settings have grown since)."""
    return {
        "temporal": {"address": settings.temporal.address, "task_queue": task_queue},
        "aws": settings.aws.model_dump(mode="json", exclude_defaults=True),
        "events": {"jsonl_path": str(events)},
        "groups": [group.model_dump(mode="json", exclude_defaults=True, exclude={"liveness_shards"})],
    }


async def warmed_up(client: Any, expected: int, within: float) -> None:
    """Every health workflow started and saw its first heartbeat (its HealthStatus is OK): visibility, no query."""
    query = f"WorkflowType = '{names.HEALTH_WORKFLOW}' AND HealthStatus = 'OK' AND ExecutionStatus = 'Running'"

    async def count() -> int:
        return int((await client.count_workflows(query)).count)

    await eventually(count, lambda n: n >= expected, within=within, every=0.5)


async def simulated_hour(state: Path, args: argparse.Namespace) -> dict[str, Any]:
    from contract.config import AwsSettings, EventSettings, TemporalSettings
    from contract.temporal_client import connect
    from node_probe.delivery.liveness_relay import LivenessRelay, LivenessRoute, routes_of
    from node_probe.delivery.reporter import Reporter
    from simulator.servers import MotoServer, TemporalDevServer, free_port
    from worker.main import run_worker
    from worker.settings import Settings

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    compress: float = args.compress
    hb_s = DEFAULT_HEARTBEAT.total_seconds() / compress
    threshold_s = DEFAULT_THRESHOLD.total_seconds() / compress
    hour_s = 3600 * args.hours / compress
    rng = random.Random(11)

    def ids(count: int) -> list[str]:
        return [f"i-{rng.getrandbits(68):017x}" for _ in range(count)]

    tag = uuid.uuid4().hex[:6]
    tq, tq_old = f"tq-{tag}", f"tq-old-{tag}"

    fleets = [Fleet(f"ingest, {n} instances", "ingest", f"ingest{n}-{tag}", tq, ids(n)) for n in args.sizes]
    fleets += [
        Fleet(f"ingest x2 replicas, {n} instances", "ingest x2", f"ingest{n}x2-{tag}", tq, ids(n))
        for n in args.replica_sizes
    ]
    sticky = Fleet(f"ingest x2 replicas, sticky, {SMALL} instances", "ingest x2 sticky", f"sticky-{tag}", tq)
    sticky.instances = ids(SMALL)
    fleets.append(sticky)
    fleets.append(Fleet(f"probe direct, {SMALL} instances", "probe direct", f"probe-{tag}", tq, ids(SMALL)))
    old = None
    if not args.no_old:
        old = Fleet(f"direct signalling (old), {SMALL} instances", "old", f"old-{tag}", tq_old, ids(SMALL))
        fleets.append(old)
    repair = Fleet("repair (ingest)", "repair", f"repair-{tag}", tq)

    groups = {f.group: capacity_group(f.group, hb_s, threshold_s, compress) for f in [*fleets, repair]}
    counter = ActionCounter()
    # The counts hold only while the worker keeps up: other work on the machine shows here (1, 5, 15 min).
    load = {"start": os.getloadavg()}
    events_path = state / "events.jsonl"
    started = time.perf_counter()
    async with (
        MotoServer(state / "moto", port=free_port()) as moto,
        TemporalDevServer(state / "temporal", port=free_port(), ui_port=free_port()) as temporal,
    ):
        settings = Settings(
            temporal=TemporalSettings(address=temporal.address, task_queue=tq),
            aws=AwsSettings(endpoint_url=moto.endpoint_url, region="us-east-1"),
            events=EventSettings(jsonl_path=events_path),
            groups=[g for name, g in groups.items() if old is None or name != old.group],
        )
        client = await connect(settings.temporal, interceptors=[counter])
        worker = asyncio.create_task(run_worker(settings, client), name="worker")
        stack = contextlib.AsyncExitStack()
        stack.enter_context(relay_tick_compressed(compress))
        try:
            if old is not None:
                tree = old_tree(args.old_ref, state / "old-tree")
                if tree is None:
                    fleets.remove(old)
                    old = None
                else:
                    old_json = old_settings_json(settings, groups[old.group], tq_old, state / "events-old.jsonl")
                    await stack.enter_async_context(OldWorker(tree, old_json, state / "old-worker.log"))
            reporter = Reporter(client)
            routes = routes_of(list(groups.values()))
            ingest = [LivenessRelay(reporter, routes, tq, relay=True) for _ in range(2)]
            for relay in ingest:
                await stack.enter_async_context(relay.running())
            probe_route = LivenessRoute.for_probe(timedelta(seconds=hb_s))
            timing = SimTiming(
                heartbeat_interval=timedelta(seconds=hb_s),
                heartbeat_loss_threshold=timedelta(seconds=threshold_s),
                boot_delay=timedelta(seconds=2),
                drain_grace=timedelta(seconds=1),
            )
            sim = SimulatedFleet(
                group=repair.group,
                cluster=repair.group,
                state_dir=state / "fleet",
                instances=REPAIR_FLEET,
                seed=5,
                launch_template=f"{repair.group}-lt",
                endpoint_url=moto.endpoint_url,
                client=client,
                task_queue=tq,
                timing=timing,
                probe_runner=ingest_probe(ingest[0]),
            )
            await stack.enter_async_context(sim)
            repair.instances = await sim.setup()

            beats: list[asyncio.Task[None]] = []
            stack.callback(lambda: [task.cancel() for task in beats])
            for fleet in fleets:
                for instance_id in fleet.instances:
                    send = _sender(fleet, instance_id, ingest, reporter, probe_route, rng)
                    phase = rng.uniform(0, hb_s)
                    beat = beat_forever(send, instance_id, fleet.group, hb_s, phase)
                    beats.append(asyncio.create_task(beat, name=f"heartbeats {instance_id}"))
            expected = sum(len(f.instances) for f in fleets) + REPAIR_FLEET
            await warmed_up(client, expected, within=args.warmup_timeout)
            # The first HealthChanged of the last ones to start, and one batch interval, so every tracker is armed.
            await asyncio.sleep(max(2.0, threshold_s / 2))
            t0 = datetime.now(UTC)
            relay_t0 = [(r.batches_sent, r.heartbeats_forwarded) for r in ingest]
            warmup_s = time.perf_counter() - started
            await asyncio.sleep(FAULT_AFTER_S)
            faulty = sim.live_instances()[0]
            fault_at = datetime.now(UTC)
            sim.inject_fault(faulty, xid=79)
            await asyncio.sleep(max(0.0, (t0 - datetime.now(UTC)).total_seconds() + hour_s))
            t1 = datetime.now(UTC)
            relay_t1 = [(r.batches_sent, r.heartbeats_forwarded) for r in ingest]
            # The repair's tail: its end, then the impaired instance's tracker noticing it is gone (one window).
            repaired = await eventually(
                lambda: asyncio.sleep(0, repaired_instances(events_path, repair.group)),
                bool,
                within=120,
            )
            done = max(_event_time(events_path, repair.group, "RepairCompleted"), t1)
            tail = (done - datetime.now(UTC)).total_seconds() + threshold_s * 1.25 + 2 * hb_s + 3
            await asyncio.sleep(max(0.0, tail))
            repair_end = datetime.now(UTC)
            for task in beats:
                task.cancel()
            await asyncio.gather(*beats, return_exceptions=True)
            load["end"] = os.getloadavg()
        finally:
            await stack.aclose()
            # Stopped before the histories are read: nothing after the hour matters, and a worker sharing the event
            # loop with thousands of history pages would wake the trackers late.
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        executions = await fetch_executions(client)

    measured = Measured(
        compress=compress,
        heartbeat_s=hb_s,
        threshold_s=threshold_s,
        t0=t0,
        t1=t1,
        fleets=[asdict(f) for f in fleets],
        repair={
            **asdict(repair),
            "faulty": faulty,
            "fault_at": fault_at.isoformat(),
            "end": repair_end.isoformat(),
            "repaired": repaired,
        },
        executions=executions,
        queries=counter.query_actions(),
        heartbeats=counter.heartbeat_actions(),
        relays={"t0": relay_t0, "t1": relay_t1},
    )
    results = analyse(measured)
    results["hour_from"], results["hour_to"] = t0.isoformat(), t1.isoformat()
    results["load_average"] = load
    results["wall_s"] = round(time.perf_counter() - started, 1)
    results["warmup_s"] = round(warmup_s, 1)
    return results


def _sender(
    fleet: Fleet,
    instance_id: str,
    ingest: list[LivenessRelay],
    reporter: Any,
    probe_route: Any,
    rng: random.Random,
) -> Callable[[Heartbeat], Awaitable[None]]:
    from node_probe.delivery.liveness_relay import LivenessRelay

    tq = fleet.task_queue
    if fleet.design == "ingest":
        return lambda beat: ingest[0].send_heartbeat(beat, tq)
    if fleet.design == "ingest x2":  # round robin: any replica, each time
        return lambda beat: rng.choice(ingest).send_heartbeat(beat, tq)
    if fleet.design == "ingest x2 sticky":  # session affinity: a host always reaches the same replica
        relay = ingest[fleet.instances.index(instance_id) % len(ingest)]
        return lambda beat: relay.send_heartbeat(beat, tq)
    if fleet.design == "probe direct":
        own = LivenessRelay(reporter, lambda group: probe_route, tq, relay=False)
        return lambda beat: own.send_heartbeat(beat, tq)
    return lambda beat: reporter.send_heartbeat(beat, tq)  # the old design: every heartbeat a signal


def _event_time(path: Path, group: str, kind: str) -> datetime:
    from simulator.events import group_events

    return max(datetime.fromisoformat(e["time"]) for e in group_events(path, group, kind))


@contextlib.contextmanager
def relay_tick_compressed(compress: float) -> Iterator[None]:
    """The relay's flush tick compressed like every other duration. Left alone it would be a tenth of the
    compressed interval (0.8 s, i.e. 48 s of simulated time) instead of production's 5 s cap, and every batch would
    come up to 43 simulated seconds later than in production: about 5 % fewer batches and tracker timers."""
    from contract.liveness import flush_tick
    from node_probe.delivery import liveness_relay

    def compressed(every: timedelta) -> timedelta:
        return flush_tick(every * compress) / compress

    with mock.patch.object(liveness_relay, "flush_tick", compressed):
        yield


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compress", type=float, default=60.0, help="simulated seconds per wall second")
    parser.add_argument("--sizes", default="12,100", help="sizes of the ingest groups (comma separated)")
    parser.add_argument("--replica-sizes", default="12,100", help="sizes of the groups behind 2 ingest replicas")
    parser.add_argument("--hours", type=float, default=2.0, help="simulated hours measured (after the warm-up)")
    parser.add_argument("--no-old", action="store_true", help="skip running the old design from git")
    parser.add_argument("--old-ref", default=OLD_REF, help="the commit whose worker is the old design")
    parser.add_argument("--warmup-timeout", type=float, default=240.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    args.sizes = [int(n) for n in args.sizes.split(",") if n.strip()]
    args.replica_sizes = [int(n) for n in args.replica_sizes.split(",") if n.strip()]
    if args.compress < 6 or not args.sizes or args.hours <= 0:
        parser.error("--compress must be at least 6 (a timer under 1 s is not kept), --sizes non-empty, --hours > 0")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="actions-bench-") as tmp:
        results = asyncio.run(simulated_hour(Path(tmp), args))
    results["machine"] = machine()
    results["at"] = datetime.now(UTC).isoformat(timespec="seconds")
    results["command"] = " ".join(["python -m benchmarks.temporal_actions", *sys.argv[1:]])
    print(markdown(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
