"""Fleet scale, measured: a fifth of a fleet failing at once, at growing fleet sizes (issue 23, parts 1 and 4).

    .venv/bin/python -m benchmarks.scale [--sizes 100,200,1000] [--share 20] [--time-limit 900] [--json F]

Runs `autorepair demo --instances N --faults N*share/100 --until-repaired --exit` from this checkout at each size in
turn: moto, the Temporal dev server, `autorepair worker`, `autorepair ingest` and the simulated fleet (`autorepair
sim`: a real probe per instance up to 300, a probe stand-in above) each in a process of its own. The drain cap is
the default 20 % and the breaker's threshold 30 %, so every fault is repaired at once; the demo exits 1 if the drain
semaphore ever held more permits than its cap.

Per size: whether every repair completed, the makespan (first fault written -> last RepairCompleted) against the
physical floor (the simulator's boot delay, drain grace and longest task stop timeout: what no engine can beat),
p50 / p99 of fault written -> IMPAIRED, permit wait, a repair's own steps (drain + launch + terminate), the whole
repair, and our overhead per repair (the repair less its WaitingForReplacement and StoppingTasks phases, where it
waits on the boot and the stop timeouts); the CPU seconds and peak memory of each process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.demo_timings import REPO, Run, faults_written, run_demo
from contract.repair import RepairPhase
from simulator.demo_summary import percentile
from simulator.fleet import SimTiming
from simulator.fleet_aws import SimWorkload

# The repair waits on these, for the world's sake: not our overhead.
WAITS = (RepairPhase.WAITING_FOR_REPLACEMENT.value, RepairPhase.STOPPING_TASKS.value)
ROLES = ("demo", "sim", "worker", "ingest", "moto", "temporal")


def physical_floor_s() -> float:
    """The slowest single repair the simulated world allows: a replacement's boot, the scheduler's grace after
    DRAINING, and a stubborn task's longest stop timeout."""
    timing = SimTiming()
    return timing.boot_delay.total_seconds() + timing.drain_grace.total_seconds() + max(SimWorkload().stop_timeouts_s)


def _at(text: Any) -> datetime:
    return datetime.fromisoformat(str(text).replace("Z", "+00:00"))


def waits_s(timeline: Any) -> float:
    """Seconds a repair spent in WAITS, each step lasting until the next began."""
    if not isinstance(timeline, list):
        return 0.0
    steps = [(str(s.get("phase")), _at(s.get("started_at"))) for s in timeline if isinstance(s, dict)]
    return sum((nxt - at).total_seconds() for (phase, at), (_, nxt) in itertools.pairwise(steps) if phase in WAITS)


@dataclass
class Size:
    instances: int
    faults: int
    run: Run
    completed: int
    makespan_s: float | None
    overhead_s: list[float]
    drain_cap: str
    label: str = ""  # " +latency": the engine's AWS calls answered as slowly as AWS answers them
    surge_cores: dict[str, float] | None = None  # each role's mean CPU cores from the first fault to the last repair


def surge_cores(run: Run, begin: datetime, end: datetime) -> dict[str, float] | None:
    """Each role's mean CPU cores between the timeline's readings nearest inside [begin, end]."""
    inside = [(at, used) for at, used in run.cpu_timeline if begin.timestamp() <= at <= end.timestamp()]
    if len(inside) < 2:
        return None
    (t0, first), (t1, last) = inside[0], inside[-1]
    return {r: round((last.get(r, 0.0) - first.get(r, 0.0)) / (t1 - t0), 2) for r in ROLES}


def read_size(instances: int, faults: int, run: Run, state: Path, label: str = "") -> Size:
    written = faults_written(state / "demo.log")
    completed: dict[str, dict[str, Any]] = {}
    for line in (state / "events.jsonl").read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("type") == "RepairCompleted" and event.get("instance_id") in written:
            completed.setdefault(str(event["instance_id"]), event)
    overhead = []
    for event in completed.values():
        started = [s for s in (event.get("detail") or {}).get("timeline") or [] if isinstance(s, dict)]
        if started:
            whole = (_at(event["time"]) - _at(started[0]["started_at"])).total_seconds()
            overhead.append(whole - waits_s(started))
    makespan = cores = None
    if completed and written:
        last = max(_at(e["time"]) for e in completed.values())
        makespan = (last - min(written.values())).total_seconds()
        cores = surge_cores(run, min(written.values()), last)
    output = state.with_name(state.name + ".out").read_text(errors="replace")
    cap = next((line for line in output.splitlines() if line.startswith("drain cap:")), "drain cap: not printed")
    return Size(instances, faults, run, len(completed), makespan, overhead, cap, label, cores)


def p50_p99(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{percentile(values, 50):.1f} / {percentile(values, 99):.1f}"


def table(sizes: list[Size], floor: float) -> str:
    measures = list(sizes[0].run.timings) if sizes else []
    head = ["instances / faults", "repairs done", "makespan s (x floor)", *measures, "our overhead per repair"]
    head += ["workflow task wait after the faults", "workflow tasks timed out"]
    head += [f"CPU s {r}" for r in ROLES] + [f"peak MB {r}" for r in ROLES] + ["drain cap", "exit, wall s"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for size in sizes:
        run = size.run
        makespan = "-" if size.makespan_s is None else f"{size.makespan_s:.1f} ({size.makespan_s / floor:.2f})"
        cells = [f"{size.instances} / {size.faults}{size.label}", f"{size.completed} of {size.faults}", makespan]
        cells += [p50_p99(run.timings[m]) for m in measures] + [p50_p99(size.overhead_s)]
        cells += [p50_p99(run.surge_task_waits), str(run.task_timeouts)]
        cells += [f"{run.cpu_seconds.get(r, 0):.0f}" for r in ROLES] + [f"{run.rss_mb.get(r, 0):.0f}" for r in ROLES]
        cells += [size.drain_cap.removeprefix("drain cap: "), f"{run.exit}, {run.seconds:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "CPU cores, mean from the first fault to the last repair: " + ", ".join(ROLES)]
    for size in sizes:
        cores = size.surge_cores or {}
        shares = ", ".join(f"{cores.get(r, '-')}" for r in ROLES)
        lines.append(f"- {size.instances} / {size.faults}{size.label}: {shares}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100,200,1000", help="fleet sizes, comma separated")
    parser.add_argument("--share", type=int, default=20, help="percent of each fleet faulted at once")
    parser.add_argument("--time-limit", type=int, default=900, help="each demo gives up after this (s)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--aws-latency", action="store_true", help="each size also run with AWS's latency on the engine's calls"
    )
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="scale-"))
    floor = physical_floor_s()
    sizes: list[Size] = []
    variants = [("", ())] + ([(" +latency", ("--aws-latency",))] if args.aws_latency else [])
    for instances in (int(n) for n in args.sizes.split(",")):
        faults = max(1, instances * args.share // 100)
        # Side by side in one run: the same size without and with AWS's latency.
        for label, extra in variants:
            state = scratch / f"n{instances}{label.strip().replace('+', '-')}"
            run = run_demo("HEAD", REPO, instances, faults, state, time_limit=args.time_limit, extra=extra)
            sizes.append(read_size(instances, faults, run, state, label))
            print(f"{instances} / {faults}{label}: exit {run.exit} in {run.seconds} s ({state})", flush=True)
    when = datetime.now(UTC).isoformat(timespec="minutes")
    print(f"\n{when}; {os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}")
    print(f"{' '.join(sys.argv)}; physical floor {floor:g} s; p50 / p99 seconds\n")
    print(table(sizes, floor))
    if args.json is not None:
        args.json.write_text(json.dumps({"when": when, "floor_s": floor, "sizes": [asdict(s) for s in sizes]}))


if __name__ == "__main__":
    main()
