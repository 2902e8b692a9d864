"""The 200-instance demo's timings on several commits side by side, in one run (issue 23's demo goals).

    .venv/bin/python -m benchmarks.demo_timings REV [REV ...] [--runs 3] [--instances 200] [--faults 40]
        [--also-niced sim,...] [--json F]

Checks each REV out in a temporary git worktree and runs `autorepair demo --instances N --faults K --until-repaired
--exit` in each in turn (A, B, C, A, B, C, ...), so that all see the same machine in the same minutes. Each run's
events file and log are read by this checkout's code (simulator/demo_summary.py), so an older commit's demo, which
printed fewer figures, is measured the same way: fault written -> IMPAIRED, permit wait, a repair's own steps
(drain + launch + terminate) and the whole repair, p50/p90/max per run and over all runs of a commit. Beside them,
what the machine was doing: the CPU each process of the run used (the demo's: probes, fleet, ingest, and the worker
where it runs there; moto; Temporal; the worker where it has a process of its own), how long workflow tasks
waited for a worker (scheduled -> started, from the run's Temporal database), and how many of the repairs' own steps
finished while another task of their workflow was in flight, and waited it out before theirs was even scheduled.

`--also-niced ROLES` runs each commit a second time in every round with those processes of the demo (for example
`sim`, the simulated world) at the lowest CPU priority: on a machine too small for both, what the engine's measures
would be if it had the CPU first, as it has cores of its own in production.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.sim_cost import cpu_seconds, rss_mb
from simulator.demo_summary import EventLog, percentile, timings
from simulator.servers import find_binary, free_port

if TYPE_CHECKING:
    from temporalio.api.history.v1 import HistoryEvent

REPO = Path(__file__).resolve().parents[1]
# simulator/fleet.py logs each fault it writes; the demo's log has the time of day it was written, or, since the
# fleet is `autorepair sim` (a process of its own), sim.log beside it, in JSON lines.
INJECTED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*fleet-sim: injected Xid \d+ on (i-[0-9a-f]+)")
INJECTED_EVENT = re.compile(r"^fleet-sim: injected Xid \d+ on (i-[0-9a-f]+)")
# A child of the demo, by what its command line says it is (the sim first: its flags name moto's and the ingest's
# addresses).
ROLES = (
    ("operator_cli.main sim ", "sim"),
    ("moto_server", "moto"),
    ("moto_main", "moto"),
    ("temporal", "temporal"),
    (" worker", "worker"),
    (" ingest", "ingest"),
)


CPU_ROLES = ("demo", "sim", "worker", "moto", "temporal")
CPU_EVERY = 10.0  # seconds between two readings of the CPU timeline
# A repair's own steps (drain, launch, terminate): a completion whose workflow task is scheduled more than HELD_S
# after it waited for another task of its workflow (its news: an event published, a progress signal delivered).
STEP_ACTIVITIES = frozenset({"set_draining", "launch_replacement", "terminate_instance"})
HELD_S = 0.005


def faults_written(log: Path) -> dict[str, datetime]:
    found: dict[str, datetime] = {}
    for line in log.read_text(errors="replace").splitlines():
        match = INJECTED.match(line)
        if match:
            at = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=UTC)  # the demo logs in UTC
            found.setdefault(match[2], at)
    sim_log = log.with_name("sim.log")
    if sim_log.exists():
        for line in sim_log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                entry = json.loads(line)
                if injected := INJECTED_EVENT.match(str(entry.get("event", ""))):
                    found.setdefault(injected[1], datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")))
    return found


@dataclass
class Run:
    commit: str
    exit: int
    seconds: float
    timings: dict[str, list[float]]
    cpu_seconds: dict[str, float]
    rss_mb: dict[str, float] = field(default_factory=dict)  # each role's peak resident memory, sampled each second
    task_waits: list[float] = field(default_factory=list)  # every workflow task of the run
    surge_task_waits: list[float] = field(default_factory=list)  # those scheduled after the first fault was written
    task_timeouts: int = 0
    # Per completed step of a repair (STEP_ACTIVITIES): how long its workflow task waited to be scheduled at all.
    step_holdups: list[float] = field(default_factory=list)
    # Every CPU_EVERY s: (epoch seconds, each role's CPU seconds so far), to see who had the cores in the surge.
    cpu_timeline: list[tuple[float, dict[str, float]]] = field(default_factory=list)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def role(pid: int) -> str:
    try:
        command = (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")).decode(errors="replace")
    except OSError:
        return "other"
    return next((name for needle, name in ROLES if needle in command), "other")


def lowest_priority(pid: int) -> None:
    """Every thread of the process at nice 19 (Linux's niceness is per thread; one it starts later inherits it)."""
    with contextlib.suppress(OSError):
        for thread in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                os.setpriority(os.PRIO_PROCESS, int(thread.name), 19)


def run_demo(
    commit: str,
    tree: Path,
    instances: int,
    faults: int,
    state: Path,
    time_limit: int | None = None,
    extra: tuple[str, ...] = (),
    niced: frozenset[str] = frozenset(),
    label: str | None = None,
) -> Run:
    command = [sys.executable, "-m", "operator_cli.main", "demo", "--instances", str(instances), "--faults"]
    command += [str(faults), "--until-repaired", "--exit", "--state-dir", str(state), *extra]
    if time_limit is not None:
        command += ["--time-limit", str(time_limit)]
    began = time.monotonic()
    cpu: dict[str, dict[int, float]] = {}
    rss: dict[str, dict[int, float]] = {}
    timeline: list[tuple[float, dict[str, float]]] = []
    # Beside the state dir, which the demo wipes as it starts.
    with (
        state.with_name(state.name + ".out").open("wb") as out,
        subprocess.Popen(command, cwd=tree, stdout=out, stderr=subprocess.STDOUT) as demo,
    ):
        while demo.poll() is None:
            # The last reading of each process before it ends: the servers are gone once the demo exits.
            for pid, name in [(demo.pid, "demo"), *((child, role(child)) for child in children(demo.pid))]:
                if name in niced:
                    lowest_priority(pid)  # each second: threads started since
                cpu.setdefault(name, {})[pid] = max(cpu_seconds(pid), cpu.get(name, {}).get(pid, 0))
                rss.setdefault(name, {})[pid] = max(rss_mb(pid) or 0.0, rss.get(name, {}).get(pid, 0))
            if not timeline or time.time() - timeline[-1][0] >= CPU_EVERY:
                timeline.append((time.time(), {name: round(sum(by_pid.values()), 2) for name, by_pid in cpu.items()}))
            time.sleep(1.0)
    took = time.monotonic() - began
    if not (state / "temporal.db").exists():
        output = state.with_name(state.name + ".out").read_text(errors="replace")
        raise RuntimeError(f"the demo never started (exit {demo.returncode}):\n{output[-2000:]}")
    events = EventLog(state / "events.jsonl")
    events.read_new()
    written = faults_written(state / "demo.log")
    measured = timings(events, written)
    used = {name: round(sum(by_pid.values()), 1) for name, by_pid in sorted(cpu.items())}
    peak = {name: round(sum(by_pid.values()), 1) for name, by_pid in sorted(rss.items())}
    run = Run(label or commit, demo.returncode, round(took, 1), measured, used, peak, cpu_timeline=timeline)
    waits, run.task_timeouts, run.step_holdups = asyncio.run(workflow_task_waits(state / "temporal.db"))
    first_fault = min(written.values(), default=datetime.max.replace(tzinfo=UTC)).timestamp()
    run.task_waits = [wait for _, wait in waits]
    run.surge_task_waits = [wait for at, wait in waits if at >= first_fault]
    return run


async def workflow_task_waits(db: Path) -> tuple[list[tuple[float, float]], int, list[float]]:
    """Every workflow task's (time scheduled, wait from scheduled to started), how many timed out, and each repair
    step's hold-up (step_holdups), from a run's Temporal database (a dev server started on a copy of it)."""
    from temporalio.api.enums.v1 import EventType
    from temporalio.client import Client

    copy = db.with_name("analysis.db")
    # The database and its write-ahead log (the dev server's SQLite is in WAL mode, simulator.servers): what was
    # committed since the last checkpoint, up to the run's last minutes, is only in the log.
    copies = [copy, copy.with_name(copy.name + "-wal"), copy.with_name(copy.name + "-shm")]
    for stale in copies:
        stale.unlink(missing_ok=True)
    copy.write_bytes(db.read_bytes())
    wal = db.with_name(db.name + "-wal")
    if wal.exists():
        copies[1].write_bytes(wal.read_bytes())
    port = free_port()
    server = subprocess.Popen(
        [find_binary("temporal"), "server", "start-dev", "--headless", "--db-filename", str(copy), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = None
        for _ in range(60):
            with contextlib.suppress(Exception):
                client = await Client.connect(f"127.0.0.1:{port}")
                break
            await asyncio.sleep(0.5)
        if client is None:
            return [], 0, []
        waits: list[tuple[float, float]] = []
        timeouts = 0
        holdups: list[float] = []
        async for execution in client.list_workflows(""):
            history = await client.get_workflow_handle(execution.id, run_id=execution.run_id).fetch_history()
            holdups += step_holdups(history.events)
            scheduled: float | None = None
            for event in history.events:
                at = event.event_time.ToDatetime().timestamp()
                if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
                    scheduled = at
                elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED and scheduled is not None:
                    waits.append((scheduled, round(at - scheduled, 3)))
                    scheduled = None
                elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT:
                    timeouts += 1
        return waits, timeouts, holdups
    finally:
        server.terminate()
        server.wait(timeout=30)
        for made in copies:
            made.unlink(missing_ok=True)


def step_holdups(events: Sequence[HistoryEvent]) -> list[float]:
    """Seconds from each repair step's completion (STEP_ACTIVITIES) to the workflow task that takes it being scheduled:
    0 unless another task of the same workflow was in flight (a workflow runs one at a time), which the completion
    then waits out (the server schedules the next task once that one is done)."""
    from temporalio.api.enums.v1 import EventType

    names: dict[int, str] = {}
    held: list[float] = []
    for index, event in enumerate(events):
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            names[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED and (
            names.get(event.activity_task_completed_event_attributes.scheduled_event_id) in STEP_ACTIVITIES
        ):
            task = next(
                (e for e in events[index + 1 :] if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED), None
            )
            if task is not None:
                seconds = task.event_time.ToDatetime().timestamp() - event.event_time.ToDatetime().timestamp()
                held.append(round(max(seconds, 0.0), 3))
    return held


def holdups_cell(holdups: list[float]) -> str:
    held = [seconds for seconds in holdups if seconds > HELD_S]
    if not held:
        return f"0 of {len(holdups)}"
    return f"{len(held)} of {len(holdups)}: {percentile(held, 50):.2f} / {max(held):.2f}"


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{percentile(values, 50):.1f} / {percentile(values, 90):.1f} / {max(values):.1f}"


def quantiles(waits: list[float]) -> str:
    if not waits:
        return "-"
    return f"{percentile(waits, 50):.2f} / {percentile(waits, 90):.2f} / {percentile(waits, 99):.2f}"


def table(runs: list[Run], instances: int, faults: int) -> str:
    measures = list(runs[0].timings)
    head = [
        "commit, run",
        *measures,
        "workflow task wait p50 / p90 / p99: after the faults (whole run)",
        "repair steps held behind another task: held of all, p50 / max s",
        "CPU s: demo / sim / worker / moto / temporal",
    ]
    lines = [
        f"| {instances} / {faults}, p50 / p90 / max s | " + " | ".join(head[1:]) + " | exit, wall |",
        "|---" * (len(head) + 1) + "|",
    ]
    for commit in dict.fromkeys(run.commit for run in runs):
        mine = [run for run in runs if run.commit == commit]
        for index, run in enumerate(mine):
            wait = f"{quantiles(run.surge_task_waits)} ({quantiles(run.task_waits)})"
            if run.task_timeouts:
                wait += f", {run.task_timeouts} timed out"
            cpu = " / ".join(f"{run.cpu_seconds.get(name, 0):.0f}" for name in CPU_ROLES)
            cells = [spread(run.timings[m]) for m in measures]
            held = holdups_cell(run.step_holdups)
            lines.append(
                f"| {commit} {index + 1} | "
                + " | ".join([*cells, wait, held, cpu])
                + f" | {run.exit}, {run.seconds} s |"
            )
        pooled = [spread([s for run in mine for s in run.timings[m]]) for m in measures]
        held = holdups_cell([h for run in mine for h in run.step_holdups])
        lines.append(f"| **{commit}, all runs** | " + " | ".join(pooled) + f" | | {held} | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("commits", nargs="+", help="the commits to compare, each run from a worktree of its own")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--instances", type=int, default=200)
    parser.add_argument("--faults", type=int, default=40)
    parser.add_argument(
        "--also-niced",
        default="",
        help="comma-separated roles (sim, moto, ingest, demo, ...) to run each commit again with at nice 19",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    niced = frozenset(filter(None, args.also_niced.split(",")))
    unknown = niced - {name for _, name in ROLES} - {"demo"}
    if unknown:
        parser.error(f"--also-niced: no such role {sorted(unknown)}; roles: demo, {', '.join(n for _, n in ROLES)}")
    variants = [frozenset(), niced] if niced else [frozenset()]

    scratch = Path(tempfile.mkdtemp(prefix="demo-timings-"))
    trees: dict[str, Path] = {}
    runs: list[Run] = []
    try:
        for commit in args.commits:
            trees[commit] = scratch / f"tree-{len(trees)}"
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[commit]), commit], cwd=REPO, check=True)
        for index in range(args.runs):
            for (commit, tree), nice in itertools.product(trees.items(), variants):
                label = f"{commit}, {'+'.join(sorted(nice))} niced" if nice else commit
                state = scratch / f"{tree.name}{'-niced' if nice else ''}-run-{index}"
                run = run_demo(commit, tree, args.instances, args.faults, state, niced=nice, label=label)
                runs.append(run)
                print(f"{label} run {index + 1}: exit {run.exit} in {run.seconds} s", flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    print(f"\n{os.cpu_count()} CPUs; {' '.join(sys.argv)}\n")
    print(table(runs, args.instances, args.faults))
    if args.json is not None:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": [asdict(r) for r in runs]})
        )


if __name__ == "__main__":
    main()
