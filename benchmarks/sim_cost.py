"""What the simulated fleet costs, beside what the engine it tests gets: the simulator as it was and as it is now,
side by side in one run, on the demo's own stack (simulator.demo.demo_stack: moto, a Temporal dev server, the engine
behind a FlakyAws proxy that injects nothing, the ingest, a probe per instance).

    .venv/bin/python -m benchmarks.sim_cost [--sizes 100,200] [--seconds 60] [--faults 2] [--json FILE]
                                                                               (repository root, ~3 min a run)

For each size, three runs on a fresh stack each, one after the other:
  - full (as it was): every watch tick (500 ms) describes the whole group (DescribeInstances, ListContainerInstances,
    DescribeContainerInstances), and the live summary takes a snapshot every second: the group's counts from AWS and
    a query to every live instance's health workflow;
  - incremental: the fleet follows the engine's calls through the proxy and describes only what they changed, plus
    the whole group every max(5 s, N/20 s); the summary takes a snapshot every max(1 s, N/50 s), health from Temporal
    visibility (two list calls);
  - incremental+filter (the demo now): the same, and the proxy applies ListContainerInstances' `ec2InstanceId ==`
    filter as ECS does (moto lists the whole cluster, so the engine's every lookup of one instance describes all).
Each run sets the fleet up, waits until every instance reports OK (at most --warmup s), injects --faults critical
Xids so the engine has work to do, and then measures for --seconds: the simulator's AWS calls per second (counted on
its boto3 clients), moto's requests per second (its access log: everyone's), moto's and Temporal's CPU and this
process's (worker, ingest, probes and fleet together), the wall time the fleet's watch loop spent in its ticks, the
engine's AWS calls as moto served them (time at the proxy), and a probe call the engine makes every repair
(DescribeContainerInstances of one instance, every 0.5 s through the proxy), timed end to end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import boto3
from rich.console import Console

from contract.groups import AutoRepair, Remediation
from simulator.aws_proxy import Answered
from simulator.demo import DEMO_CLUSTER, DemoPlan, DemoStack, demo_stack, snapshot_interval
from simulator.demo_env import logs_to_file, moto_credentials
from simulator.events import read_events
from simulator.servers import free_port

Mode = Literal["full", "incremental", "incremental+filter"]
MODES: tuple[Mode, ...] = ("full", "incremental", "incremental+filter")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROBE_EVERY_S = 0.5


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU of a process so far, from /proc (0 when unknown)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14 and 15 of stat)


def rss_mb(pid: int) -> float | None:
    """Resident memory of a process now, in MiB, from /proc (None when unknown)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return None


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def requests_logged(path: Path) -> int:
    """Requests in moto's access log (werkzeug: one line each)."""
    try:
        with path.open("rb") as handle:
            return sum(1 for line in handle if b'HTTP/1.1" ' in line)
    except OSError:
        return 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Counters:
    at: float
    sim_calls: dict[str, int]
    moto_requests: int
    moto_cpu: float
    temporal_cpu: float
    own_cpu: float
    watch_busy_s: float
    reconciles: int
    follows: int

    @classmethod
    def read(cls, demo: DemoStack) -> Counters:
        fleet = demo.fleet
        return cls(
            at=time.monotonic(),
            sim_calls=dict(fleet.aws.calls_made()),
            moto_requests=requests_logged(demo.moto.log_path),
            moto_cpu=cpu_seconds(demo.moto.pid),
            temporal_cpu=cpu_seconds(demo.temporal.pid),
            # The worker runs in a process of its own since this was first measured; counted with ours, as then.
            own_cpu=own_cpu_seconds() + cpu_seconds(demo.worker.pid),
            watch_busy_s=fleet.watch_busy_s,
            reconciles=fleet.reconciles,
            follows=fleet.follows,
        )


@dataclass
class Run:
    size: int
    mode: Mode
    seconds: float = 0.0
    setup_s: float = 0.0
    all_ok_s: float | None = None  # setup done -> every instance OK (None: not within the warm-up)
    sim_calls_per_s: float = 0.0
    sim_calls_by_api: dict[str, float] = field(default_factory=dict)
    moto_requests_per_s: float = 0.0
    moto_cpu_pct: float = 0.0
    temporal_cpu_pct: float = 0.0
    own_cpu_pct: float = 0.0
    watch_busy_pct: float = 0.0  # share of wall time the watch loop spent in ticks
    reconciles: int = 0
    follows: int = 0
    snapshots: int = 0
    snapshot_s_p50: float = 0.0
    health_calls_per_snapshot: float = 0.0  # Temporal calls for health: a query per instance, or two lists
    engine_calls: int = 0
    engine_moto_ms_p50: float = 0.0
    engine_moto_ms_p95: float = 0.0
    probe_ms_p50: float = 0.0
    probe_ms_p95: float = 0.0
    probe_ms_max: float = 0.0
    repairs_completed: int = 0


async def measure(size: int, mode: Mode, *, seconds: float, faults: int, warmup: float, root: Path) -> Run:
    state_dir = root / f"{mode}-{size}"
    state_dir.mkdir(parents=True)
    plan = DemoPlan(
        instances=size,
        faults=faults,
        heartbeat_loss=0,
        blips=0,
        auto_repair=AutoRepair.ENABLED,
        remediation=Remediation.REPLACE,
        seed=7,
        time_limit_s=seconds,
        state_dir=state_dir,
        events_path=state_dir / "events.jsonl",
        exit_when_done=True,
        temporal_port=free_port(),
        ui_port=free_port(),
        moto_port=free_port(),
        ingest_port=free_port(),
    )
    run = Run(size=size, mode=mode)
    incremental = mode != "full"
    quiet = Console(quiet=True)
    with logs_to_file(state_dir / "demo.log"), moto_credentials():
        async with demo_stack(plan, quiet, follow_engine=incremental, ecs_filter=mode == "incremental+filter") as demo:
            fleet = demo.fleet
            started = time.monotonic()
            instances = await fleet.setup()
            run.setup_s = time.monotonic() - started
            started = time.monotonic()
            while time.monotonic() - started < warmup:
                snap = await fleet.snapshot(from_visibility=True)
                if snap.healthy == size:
                    run.all_ok_s = time.monotonic() - started
                    break
                await asyncio.sleep(2)

            served: list[float] = []
            probe_arn = next(n.container_instance_arn for n in fleet.nodes.values() if n.container_instance_arn)

            def heard(answered: Answered) -> None:
                if probe_arn.encode() not in answered.request.body:  # the engine's calls, not the probe's
                    served.append(answered.elapsed_s)

            unlisten = demo.proxy.listen(heard)
            probe_ms: list[float] = []
            probing = asyncio.create_task(probe_engine_call(demo.proxy.url, probe_arn, probe_ms))
            before = Counters.read(demo)
            for instance_id in fleet.rng.sample(instances, faults):
                fleet.inject_fault(instance_id)

            every = snapshot_interval(size) if incremental else 1.0
            took: list[float] = []
            health_calls = 0
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                looked = time.monotonic()
                snap = await fleet.snapshot(from_visibility=incremental)
                took.append(time.monotonic() - looked)
                health_calls += 2 if incremental else len(snap.health)
                await asyncio.sleep(max(0.0, every - (time.monotonic() - looked)))
            after = Counters.read(demo)
            probing.cancel()
            await asyncio.gather(probing, return_exceptions=True)
            unlisten()
            engine_samples = list(served)

    wall = after.at - before.at
    calls = {api: after.sim_calls.get(api, 0) - before.sim_calls.get(api, 0) for api in after.sim_calls}
    run.seconds = round(wall, 1)
    run.sim_calls_per_s = sum(calls.values()) / wall
    run.sim_calls_by_api = {api: round(n / wall, 2) for api, n in sorted(calls.items(), key=lambda kv: -kv[1]) if n}
    run.moto_requests_per_s = (after.moto_requests - before.moto_requests) / wall
    run.moto_cpu_pct = 100 * (after.moto_cpu - before.moto_cpu) / wall
    run.temporal_cpu_pct = 100 * (after.temporal_cpu - before.temporal_cpu) / wall
    run.own_cpu_pct = 100 * (after.own_cpu - before.own_cpu) / wall
    run.watch_busy_pct = 100 * (after.watch_busy_s - before.watch_busy_s) / wall
    run.reconciles = after.reconciles - before.reconciles
    run.follows = after.follows - before.follows
    run.snapshots = len(took)
    run.snapshot_s_p50 = statistics.median(took) if took else float("nan")
    run.health_calls_per_snapshot = health_calls / len(took) if took else 0.0
    run.engine_calls = len(engine_samples)
    run.engine_moto_ms_p50 = 1000 * percentile(engine_samples, 0.5)
    run.engine_moto_ms_p95 = 1000 * percentile(engine_samples, 0.95)
    run.probe_ms_p50 = percentile(probe_ms, 0.5)
    run.probe_ms_p95 = percentile(probe_ms, 0.95)
    run.probe_ms_max = max(probe_ms, default=float("nan"))
    run.repairs_completed = sum(1 for e in read_events(plan.events_path) if e.get("type") == "RepairCompleted")
    return run


async def probe_engine_call(endpoint: str, arn: str, samples: list[float]) -> None:
    """A call the engine makes in every repair (DescribeContainerInstances of one instance), through the engine's
    proxy every PROBE_EVERY_S, timed end to end: what the engine waits for while the simulator runs."""
    ecs = boto3.client("ecs", region_name="us-east-1", endpoint_url=endpoint)

    def call() -> float:
        started = time.monotonic()
        ecs.describe_container_instances(cluster=DEMO_CLUSTER, containerInstances=[arn])
        return 1000 * (time.monotonic() - started)

    while True:
        samples.append(await asyncio.to_thread(call))
        await asyncio.sleep(PROBE_EVERY_S)


def table(runs: list[Run]) -> str:
    rows = [
        ("simulator AWS calls/s", lambda r: f"{r.sim_calls_per_s:.1f}"),
        ("moto requests/s (everyone's)", lambda r: f"{r.moto_requests_per_s:.1f}"),
        ("moto CPU (% of a core)", lambda r: f"{r.moto_cpu_pct:.0f}"),
        ("Temporal CPU (% of a core)", lambda r: f"{r.temporal_cpu_pct:.0f}"),
        ("demo process CPU (% of a core)", lambda r: f"{r.own_cpu_pct:.0f}"),
        ("watch loop busy (% of wall)", lambda r: f"{r.watch_busy_pct:.0f}"),
        ("full looks / follow looks", lambda r: f"{r.reconciles} / {r.follows}"),
        ("snapshots (p50 s each)", lambda r: f"{r.snapshots} ({r.snapshot_s_p50:.2f})"),
        ("Temporal health calls per snapshot", lambda r: f"{r.health_calls_per_snapshot:.0f}"),
        (
            "engine calls, moto time p50/p95 ms",
            lambda r: f"{r.engine_calls}: {r.engine_moto_ms_p50:.0f}/{r.engine_moto_ms_p95:.0f}",
        ),
        (
            "engine-like call p50/p95/max ms",
            lambda r: f"{r.probe_ms_p50:.0f}/{r.probe_ms_p95:.0f}/{r.probe_ms_max:.0f}",
        ),
        (
            "setup s / all OK after s",
            lambda r: f"{r.setup_s:.0f} / {'-' if r.all_ok_s is None else f'{r.all_ok_s:.0f}'}",
        ),
        ("repairs completed in the window", lambda r: str(r.repairs_completed)),
    ]
    head = "| | " + " | ".join(f"{r.size} {r.mode}" for r in runs) + " |"
    lines = [head, "|---" * (len(runs) + 1) + "|"]
    lines += ["| " + name + " | " + " | ".join(cell(r) for r in runs) + " |" for name, cell in rows]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[Run]:
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="sim-cost-") as tmp:
        for size in args.sizes:
            for mode in MODES:
                print(f"{size} instances, {mode} ...", file=sys.stderr, flush=True)
                run = await measure(
                    size, mode, seconds=args.seconds, faults=args.faults, warmup=args.warmup, root=Path(tmp)
                )
                print(json.dumps(asdict(run)), file=sys.stderr, flush=True)
                runs.append(run)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[100, 200])
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window of each run")
    parser.add_argument("--faults", type=int, default=2, help="critical Xids injected as the window opens")
    parser.add_argument("--warmup", type=float, default=120.0, help="at most this long for every instance OK")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's numbers here")
    args = parser.parse_args()
    runs = asyncio.run(main_async(args))
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {machine}")
    print(table(runs))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=2) + "\n")


if __name__ == "__main__":
    main()
