"""`autorepair worker` as a child process, from a Settings object: the demo runs the engine apart from the world
it simulates (its own interpreter, so the probes and the simulated fleet do not hold up its workflow tasks), and the
tests SIGKILL it and start it again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from worker.settings import Settings


def worker_environment(settings: Settings) -> dict[str, str]:
    """The settings, as the environment an operator gives `autorepair worker`."""
    env = dict(os.environ)
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
    return env


class WorkerProcess:
    """`autorepair worker` in a child process: started, SIGKILLed and started again, its output in one log."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self._env = worker_environment(settings)
        self._log_path = log_path
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
            raise RuntimeError("the worker is already running")
        with self._log_path.open("ab") as log:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "operator_cli.main", "worker", env=self._env, stdout=log, stderr=log
            )
        self.starts += 1

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
            raise RuntimeError(f"the worker is not running; log:\n{self.log_tail()}")
        return self._proc

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
