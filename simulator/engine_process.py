"""`autorepair worker`, `autorepair ingest` and `autorepair sim` as child processes, from a Settings object: the demo
runs the engine apart from the world it simulates (their own interpreters, so the simulated fleet and its probes hold
up neither the worker's workflow tasks nor the ingest's answers, and what each costs is its own), and the tests
SIGKILL a worker (or the sim) and start it again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from contract.healthz import OFF
from worker.settings import Settings

Role = Literal["worker", "ingest", "sim"]


def engine_environment(settings: Settings) -> dict[str, str]:
    """The settings, as the environment an operator gives `autorepair worker` or `autorepair ingest`."""
    env = dict(os.environ)
    # Temporal's workflow sandbox imports the workflow modules afresh for every workflow the worker creates. Without a
    # bytecode cache (PYTHONDONTWRITEBYTECODE, as on the machine these were measured on: an editable install has none)
    # each import compiles from source: half of creating a workflow, a tenth of the worker's CPU in the 200 / 40
    # demo's surge (py-spy). The children keep Python's own cache (__pycache__, ignored by git), as an installed
    # image does (deploy/docker: UV_COMPILE_BYTECODE).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(
        AUTOREPAIR_TEMPORAL__ADDRESS=settings.temporal.address,
        AUTOREPAIR_TEMPORAL__NAMESPACE=settings.temporal.namespace,
        AUTOREPAIR_TEMPORAL__TASK_QUEUE=settings.temporal.task_queue,
        AUTOREPAIR_TEMPORAL__UI_URL=settings.temporal.ui_url,
        AUTOREPAIR_AWS__ENDPOINT_URL=settings.aws.endpoint_url or "",
        AUTOREPAIR_AWS__REGION=settings.aws.region,
        AUTOREPAIR_EVENTS__JSONL_PATH=str(settings.events.jsonl_path),
        AUTOREPAIR_EVENTS__EVENTBRIDGE=str(settings.events.eventbridge).lower(),
        AUTOREPAIR_GRACEFUL_SHUTDOWN_TIMEOUT=f"PT{settings.graceful_shutdown_timeout.total_seconds():g}S",
        # Several workers may share the machine: the health endpoint's port only where the settings ask for one.
        AUTOREPAIR_HEALTH_BIND_ADDRESS=settings.health_bind_address or "off",
        AUTOREPAIR_GROUPS=json.dumps([g.model_dump(mode="json") for g in settings.groups]),
        AUTOREPAIR_LOG_FORMAT="json",
    )
    if settings.events.webhook_url:
        env["AUTOREPAIR_EVENTS__WEBHOOK_URL"] = settings.events.webhook_url
    if settings.metrics_bind_address:
        # Prometheus' /metrics only where the settings ask (the demo: a free port), with the gauges' cadence.
        env.update(
            AUTOREPAIR_METRICS_BIND_ADDRESS=settings.metrics_bind_address,
            AUTOREPAIR_HEALTH_GAUGE_INTERVAL=f"PT{settings.health_gauge_interval.total_seconds():g}S",
            AUTOREPAIR_REPAIR_RUNNING_LONG=f"PT{settings.repair_running_long.total_seconds():g}S",
        )
    ingest = settings.ingest.model_dump(mode="json", exclude_none=True)
    # Dropped as None above, the child would fall back to the default port: "off" says none.
    ingest.setdefault("metrics_bind", OFF)
    if settings.ingest.session_secret is not None:
        ingest["session_secret"] = settings.ingest.session_secret.get_secret_value()
    env["AUTOREPAIR_INGEST"] = json.dumps(ingest)
    return env


class EngineProcess:
    """`autorepair worker` (or `ingest`) in a child process: started, SIGKILLed and started again, its output in one
    log."""

    def __init__(self, settings: Settings, log_path: Path, role: Role = "worker", args: Sequence[str] = ()) -> None:
        """`args`: the command's flags (the sim's: simulator/sim.py); the worker and the ingest read the settings."""
        self._env = engine_environment(settings)
        self._log_path = log_path
        self._role = role
        self._args = list(args)
        self._proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        if self.alive:
            raise RuntimeError(f"the {self._role} is already running")
        with self._log_path.open("ab") as log:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "operator_cli.main",
                self._role,
                *self._args,
                env=self._env,
                stdout=log,
                stderr=log,
            )
        self.starts += 1

    async def listening(self, host: str, port: int, within: float = 30.0) -> None:
        """Once it accepts connections on host:port; RuntimeError (with its log) if it exits or never does."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            self._running()
            try:
                # The whole connect in the thread: the loop it would block may run simulated probes.
                await asyncio.to_thread(lambda: socket.create_connection((host, port), 0.5).close())
                return
            except OSError:
                await asyncio.sleep(0.2)
        raise RuntimeError(f"the {self._role} never listened on {host}:{port}; log:\n{self.log_tail()}")

    async def kill(self) -> int:
        """SIGKILL: no shutdown, no activity completed, no sticky queue handed back. Its exit status."""
        proc = self._running()
        proc.send_signal(signal.SIGKILL)
        return await proc.wait()

    async def terminate(self, within: float) -> int:
        """SIGTERM, as an orchestrator stops a container, and the exit status once the process ended."""
        proc = self._running()
        proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(proc.wait(), timeout=within)

    async def stop(self) -> None:
        if self._proc is not None and self.alive:
            self._proc.terminate()
            try:
                await asyncio.wait_for(self._proc.wait(), timeout=15)
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()

    @property
    def exit_status(self) -> int | None:
        """None while it runs (or before it started)."""
        return None if self._proc is None else self._proc.returncode

    def _running(self) -> asyncio.subprocess.Process:
        if self._proc is None or not self.alive:
            raise RuntimeError(f"the {self._role} is not running; log:\n{self.log_tail()}")
        return self._proc

    def log_tail(self, lines: int = 30, *, containing: str = "") -> str:
        """The last `lines` lines of the process's log, of those that contain `containing`."""
        try:
            text = self._log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join([line for line in text.splitlines() if containing in line][-lines:])
