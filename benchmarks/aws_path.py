"""The AWS calls a repair waits on, counted and timed: which step makes which call, and how many come one after
another on a repair's path (the issue's goal: at most 10 serial calls with AWS's 50-300 ms per call).

    .venv/bin/python -m benchmarks.aws_path [--repairs 4] [--no-latency] [--json FILE]     (repository root, ~2 min)

Moto, a Temporal dev server, and the worker in this process, reaching moto through the fault proxy with AWS's
latency profile (FlakyAws.like_aws; --no-latency: none); a simulated fleet of a few instances whose real probes
signal Temporal directly. One instance at a time gets a critical Xid and is repaired, so every call the engine makes
meanwhile belongs to that repair. Each AWS call of an activity is recorded where every one is made (AwsCalls.run,
wrapped here): the workflow, the activity, the API, when it started and when it ended.

What a repair waits on is its own workflow's activities, one after the other, and the drain semaphore's grant before
them. Within one activity (or one workflow), calls that overlap in time were made side by side and count once: the
serial count is the most calls of a workflow no two of which overlap. The waits (tasks to stop, the replacement to
register) look again and again while the world takes its time (the physical floor); only each wait's last look, the
one that ends it, is on the path, so a wait counts as one look. benchmarks/SCALE.md records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks.probe_throughput import machine
from benchmarks.support import local_fleet
from contract.ids import REPAIR_PREFIX

# The activities that wait for the world by looking again and again; a look's calls are what the path pays.
WAITS = ("wait_for_tasks_to_stop", "await_container_instance_active")


@dataclass(frozen=True)
class Call:
    workflow_id: str
    activity: str
    attempt: int
    activity_id: str
    api: str
    start: float
    end: float


class Recorder:
    """Every AWS call made inside an activity, as AwsCalls.run makes it."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        # Each waiting activity heartbeats once a look, before it sleeps: the calls after its last heartbeat are the
        # look that ended the wait.
        self.heartbeats: dict[str, list[float]] = defaultdict(list)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        from temporalio import activity

        from activities.aws import AwsCalls

        original = AwsCalls.run
        recorder = self

        async def run(calls: AwsCalls, api: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await original(calls, api, fn, *args, **kwargs)
            finally:
                if activity.in_activity():
                    info = activity.info()
                    recorder.calls.append(
                        Call(
                            workflow_id=info.workflow_id or "",
                            activity=info.activity_type,
                            attempt=info.attempt,
                            activity_id=info.activity_id,
                            api=api,
                            start=start,
                            end=time.perf_counter(),
                        )
                    )

        beat = activity.heartbeat

        def heartbeat(*details: Any) -> None:
            info = activity.info()
            recorder.heartbeats[f"{info.workflow_id}/{info.activity_id}"].append(time.perf_counter())
            beat(*details)

        with mock.patch.object(AwsCalls, "run", run), mock.patch.object(activity, "heartbeat", heartbeat):
            yield


def serial(calls: list[Call]) -> int:
    """The most calls no two of which overlap in time: the calls made one after the other (earliest end first)."""
    count, free_at = 0, float("-inf")
    for call in sorted(calls, key=lambda c: c.end):
        if call.start >= free_at:
            count += 1
            free_at = call.end
    return count


def path_of(recorder: Recorder, instance_id: str, window: tuple[float, float]) -> dict[str, Any]:
    """One repair's calls: its own workflow's by activity (a wait counted by its last look), and the other workflows'
    made meanwhile (the semaphore's grant among them)."""
    start, end = window
    mine = [c for c in recorder.calls if start <= c.start <= end]
    repair = [c for c in mine if c.workflow_id.startswith(f"{REPAIR_PREFIX}{instance_id}/")]
    steps: list[dict[str, Any]] = []
    by_invocation: dict[tuple[str, str, str], list[Call]] = defaultdict(list)
    for call in repair:
        by_invocation[(call.workflow_id, call.activity_id, call.activity)].append(call)
    for (workflow_id, activity_id, activity), made in sorted(
        by_invocation.items(), key=lambda kv: min(c.start for c in kv[1])
    ):
        step: dict[str, Any] = {"activity": activity}
        if activity in WAITS:
            beats = recorder.heartbeats.get(f"{workflow_id}/{activity_id}", [])
            step["looks"] = len(beats) + 1
            made = [c for c in made if not beats or c.start > beats[-1]]
        step["serial"] = serial(made)
        step["apis"] = [c.api for c in sorted(made, key=lambda c: c.start)]
        steps.append(step)
    others: dict[str, dict[str, Any]] = {}
    for workflow in sorted({c.workflow_id.split("/")[0] for c in mine} - {REPAIR_PREFIX.rstrip("/")}):
        theirs = [c for c in mine if c.workflow_id.split("/")[0] == workflow]
        others[workflow] = {
            "calls": len(theirs),
            "serial": serial(theirs),
            "by_activity": dict(Counter(f"{c.activity}: {c.api}" for c in theirs)),
        }
    return {
        "instance_id": instance_id,
        "seconds": round(end - start, 1),  # the fault injected -> its RepairCompleted read back
        "steps": steps,
        "serial_on_path": sum(s["serial"] for s in steps),
        "calls_in_repair": len(repair),
        "others": others,
    }


INSTANCES = 4


async def measure(state: Path, repairs: int, latency: bool) -> dict[str, Any]:
    recorder = Recorder()
    windows: list[tuple[str, float, float]] = []
    # One repair after another in a small group: the breaker would hold the fourth.
    calm = {"min_impaired": 100}
    with recorder.recording():
        async with local_fleet(state, instances=INSTANCES, seed=7, aws_latency=latency, group_settings=calm) as fleet:
            await fleet.all_healthy(INSTANCES)
            for done in range(1, repairs + 1):
                instance = fleet.sim.live_instances()[0]
                start = time.perf_counter()
                fleet.sim.inject_fault(instance, xid=79)
                await fleet.repairs_finished(done, within=180)
                windows.append((instance, start, time.perf_counter()))
                await fleet.all_healthy(INSTANCES)
    return {"repairs": [path_of(recorder, instance, (a, b)) for instance, a, b in windows]}


def markdown(results: dict[str, Any]) -> str:
    """A table per run: a row per step (a step met twice in a repair is two rows), a column per repair."""
    lines = []
    for run in results["runs"]:
        latency = "AWS's latency (50-300 ms a call)" if run["latency"] else "no added latency"
        paths = run["repairs"]
        rows: dict[str, list[str]] = {}
        for n, path in enumerate(paths):
            seen: Counter[str] = Counter()
            for step in path["steps"]:
                seen[step["activity"]] += 1
                name = step["activity"] + (f" ({seen[step['activity']]})" if seen[step["activity"]] > 1 else "")
                looks = f" in {step['looks']} looks" if "looks" in step else ""
                rows.setdefault(name, ["-"] * len(paths))[n] = f"{step['serial']}{looks}"
        counts = [p["serial_on_path"] for p in paths]
        lines += [f"### {latency}: serial AWS calls on a repair's path {', '.join(map(str, counts))}", ""]
        lines.append("| step | " + " | ".join(f"repair {n + 1}" for n in range(len(paths))) + " |")
        lines.append("|---|" + "---|" * len(paths))
        lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows.items()]
        lines.append("| **on the path** | " + " | ".join(f"**{c}**" for c in counts) + " |")
        lines.append("| fault -> RepairCompleted, s | " + " | ".join(str(p["seconds"]) for p in paths) + " |")
        for workflow in sorted({w for p in paths for w in p["others"]}):
            cells = [str(p["others"].get(workflow, {}).get("serial", 0)) for p in paths]
            lines.append(f"| ({workflow} workflows, meanwhile) | " + " | ".join(cells) + " |")
        lines += ["", "Each step's calls in the first repair, in order (a wait: its last look):", ""]
        lines += [f"- {step['activity']}: {', '.join(step['apis'])}" for step in paths[0]["steps"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repairs", type=int, default=4, help="repairs, one at a time, per run (default: 4)")
    parser.add_argument("--no-latency", action="store_true", help="only the run without added latency")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {
        "machine": machine(),
        "command": " ".join([".venv/bin/python -m benchmarks.aws_path", *(argv or sys.argv[1:])]),
    }
    results["runs"] = []
    for latency in [False] if args.no_latency else [False, True]:
        with tempfile.TemporaryDirectory(prefix="aws-path-") as state:
            run = asyncio.run(measure(Path(state), args.repairs, latency))
        results["runs"].append({"latency": latency, **run})
    print(markdown(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
