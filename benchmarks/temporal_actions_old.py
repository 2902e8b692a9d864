"""The old design, run for real from git: every heartbeat signalled to the instance's health workflow, which kept one
deadline timer per instance and re-read its group's configuration (an activity) each time the timer fired.

`old_tree` extracts the worker's packages (contract, workflows, activities, worker) at the last commit of that
design; `OldWorker` runs that worker in a subprocess, on its own task queue against the same dev server, so both
designs run in the same simulated hour. `old_model` is the same design's cost from its rules, for any settings.
Used by benchmarks.temporal_actions.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from benchmarks.support import REPO

# The last commit with per-instance heartbeat deadlines (the next one moved liveness to workflows/liveness.py).
OLD_REF = "444683044ca8b2fac80751bf43289343800c427f"
PACKAGES = ("contract", "workflows", "activities", "worker")

# Run with the old tree first on sys.path (the venv's editable install resolves after sys.path).
WORKER = """
import asyncio, json, os
from contract.temporal_client import connect
from worker.main import run_worker
from worker.settings import Settings

async def main():
    settings = Settings.model_validate(json.loads(os.environ["OLD_DESIGN_SETTINGS"]))
    client = await connect(settings.temporal)
    print("ready", flush=True)
    await run_worker(settings, client)

asyncio.run(main())
"""


def old_tree(ref: str, dest: Path) -> Path | None:
    """The worker's packages at `ref` under `dest`; None (and why on stderr) where git or the commit is missing."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", "--format=tar", ref, *PACKAGES],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        print(f"old design not run: no git tree for {ref}: {err} {detail.decode(errors='replace')}", file=sys.stderr)
        return None
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


class OldWorker:
    """The old tree's worker in a subprocess, stopped (SIGTERM, then SIGKILL) on the way out."""

    def __init__(self, tree: Path, settings_json: dict[str, object], log_path: Path) -> None:
        self._tree = tree
        self._settings = settings_json
        self._log_path = log_path
        self._proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> OldWorker:
        env = {**os.environ, "PYTHONPATH": str(self._tree), "OLD_DESIGN_SETTINGS": json.dumps(self._settings)}
        log = self._log_path.open("wb")
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WORKER,
            cwd=self._tree,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            stdin=asyncio.subprocess.DEVNULL,
        )
        log.close()
        assert self._proc.stdout is not None
        try:
            line = await asyncio.wait_for(self._proc.stdout.readline(), timeout=60)
        except TimeoutError:
            line = b""
        if line.strip() != b"ready":
            await self._stop()
            tail = self._log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the old design's worker did not start; its log:\n{tail}")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stop()

    async def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout=10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@dataclass(frozen=True)
class OldModel:
    """Per healthy instance and month, from the old design's rules (a 30-day month)."""

    signals: float
    timers: float
    activities: float
    queries_if_semaphore_runs: float
    continue_as_new: float

    @property
    def total(self) -> float:
        return self.signals + self.timers + self.activities + self.continue_as_new

    @property
    def total_with_queries(self) -> float:
        return self.total + self.queries_if_semaphore_runs


def old_model(threshold_s: float, heartbeat_s: float, events_per_hour: float | None = None) -> OldModel:
    """Every heartbeat is a signal. The watchdog's timer is set for (last heartbeat + threshold); when it fires the
    last heartbeat is on average half an interval old, so it fires every (threshold - interval/2) and each firing
    re-reads the group's configuration: one activity, and one query of the group's drain semaphore when that runs
    (it does from a group's first repair on). A run continues as new at Temporal's 4,096-event suggestion (each
    heartbeat adds 4 events: the signal and a workflow task; each firing about 11) or at 2,000 signals; each new
    run starts (1), re-reads the configuration (1) and re-arms the timer (1)."""
    month_h = 24 * 30
    signals = 3600 / heartbeat_s * month_h
    firings = 3600 / (threshold_s - heartbeat_s / 2) * month_h
    if events_per_hour is None:
        events_per_hour = 4 * 3600 / heartbeat_s + 11 * 3600 / (threshold_s - heartbeat_s / 2)
    runs = max(events_per_hour * month_h / 4096, signals / 2000)
    return OldModel(
        signals=signals,
        timers=firings,
        activities=firings,
        queries_if_semaphore_runs=firings + runs,
        continue_as_new=3 * runs,
    )
