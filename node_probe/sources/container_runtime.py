"""The container runtime (ECS's CONTAINER_RUNTIME health check): docker or containerd, up and answering.

A runtime is up when its systemd unit is active AND its API answers within a timeout: docker `GET /_ping` on its
unix socket (200 "OK"), containerd an HTTP/2 connection preface on its gRPC socket (a gRPC server answers one with
its SETTINGS frame, before any call). A runtime whose unit is active but whose socket accepts and never answers is
hung, which `systemctl is-active` cannot see: no task starts on it. Down or hung past the daemons' threshold is one
finding (kind `container_runtime`, reason `CONTAINER_RUNTIME_<unit>`), impairing when the runtime is critical (the
default: a host that cannot start containers is no use to ECS); back up is `container_runtime_recovered`. A blip
shorter than the threshold says nothing. The hysteresis and the episodes are DaemonSource's; only what "up" means
differs.

A socket the probe may not open is no fault of the runtime: that runtime's unit alone is judged, and the log says so
once. The shipped systemd unit runs the probe as a dynamic user in the docker group where the host has one
(deploy/systemd/install-probe.sh), so docker's socket (root:docker 0660) is asked; containerd's is root's alone, so
containerd is judged by its unit there. Each poll the source's status (the heartbeat's `sources`, `autorepair
describe`) says which way each runtime was checked: "docker: unit and API on /var/run/docker.sock; containerd: unit
only, may not open /run/containerd/containerd.sock (Permission denied)". A socket refused once is asked again at
each poll, so access granted later (a restart in the group) is used at once.

Like the daemons, this says nothing about the GPUs (`gpu_source = False`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Literal

from contract.health import HealthState
from contract.probe import KIND_CONTAINER_RUNTIME, KIND_CONTAINER_RUNTIME_RECOVERED
from node_probe.classify.record import RecordKind
from node_probe.host import CommandRunner, run_command
from node_probe.sources.base import Observation, SourceStatus
from node_probe.sources.daemons import UP_STATES, DaemonSource, DaemonSpec

log = logging.getLogger(__name__)

SOURCE_NAME = "container_runtime"
REASON_PREFIX = "CONTAINER_RUNTIME_"
DOCKER_SOCKET = Path("/var/run/docker.sock")
CONTAINERD_SOCKET = Path("/run/containerd/containerd.sock")
# The state a unit that systemd calls active is given when its API does not answer.
UNRESPONSIVE = "unresponsive"

# RFC 9113 section 3.4: the client connection preface, then an empty SETTINGS frame (length 0, type 4, no flags,
# stream 0). The server's own preface is a SETTINGS frame, the first frame it sends.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HTTP2_EMPTY_SETTINGS = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
# GOAWAY (type 7), last stream 0, NO_ERROR: leave as a well-behaved client does, not as a broken connection.
HTTP2_GOAWAY = bytes([0, 0, 8, 7, 0, 0, 0, 0, 0]) + bytes(8)
_FRAME_HEADER = 9
_SETTINGS = 4
_MAX_STATUS_LINE = 1024

Api = Literal["docker", "containerd"]
Exchange = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bytes]]
ApiCheck = Callable[[Path, float], Awaitable[str | None]]


class RuntimeSpec(DaemonSpec):
    """A container runtime: its systemd unit, and the socket its API answers on."""

    api: Api
    socket: Path
    critical: bool = True


def default_runtimes() -> list[RuntimeSpec]:
    """docker and containerd, each watched when systemd knows its unit (an ECS host runs docker on containerd)."""
    return [
        RuntimeSpec(unit="docker", api="docker", socket=DOCKER_SOCKET, only_if_installed=True),
        RuntimeSpec(unit="containerd", api="containerd", socket=CONTAINERD_SOCKET, only_if_installed=True),
    ]


async def docker_ping(socket: Path, timeout: float) -> str | None:
    """None when dockerd answers `GET /_ping` on `socket` with a 2xx within `timeout`; else what went wrong."""
    request = b"GET /_ping HTTP/1.1\r\nHost: docker\r\nUser-Agent: gpu-autorepair-probe\r\nConnection: close\r\n\r\n"

    async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(request)
        await writer.drain()
        return await reader.readline()

    answer = await _ask(socket, timeout, exchange, "GET /_ping")
    if isinstance(answer, str):
        return answer
    parts = answer[:_MAX_STATUS_LINE].decode("latin-1").split()
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        return f"GET /_ping on {socket} answered {answer[:80]!r}, not HTTP"
    if not parts[1].startswith("2"):
        return f"GET /_ping on {socket} answered {' '.join(parts[1:])}"
    return None


async def grpc_preface(socket: Path, timeout: float) -> str | None:
    """None when the gRPC server on `socket` answers an HTTP/2 connection preface with its SETTINGS frame within
    `timeout`; else what went wrong. No call is made: containerd needs no namespace or credentials for this."""

    async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(HTTP2_PREFACE + HTTP2_EMPTY_SETTINGS)
        await writer.drain()
        header = await reader.readexactly(_FRAME_HEADER)
        writer.write(HTTP2_GOAWAY)
        with contextlib.suppress(OSError):
            await writer.drain()
        return header

    answer = await _ask(socket, timeout, exchange, "the HTTP/2 preface")
    if isinstance(answer, str):
        return answer
    if answer[3] != _SETTINGS:
        return f"{socket} answered the HTTP/2 preface with frame type {answer[3]}, not SETTINGS"
    return None


async def _ask(
    socket: Path,
    timeout: float,
    exchange: Exchange,
    what: str,
) -> bytes | str:
    """The bytes `exchange` read from `socket`, or why there are none; the connection is closed either way."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(str(socket))
            answer = await exchange(reader, writer)
    except TimeoutError:
        if writer is None:
            return f"cannot connect to {socket} within {timeout:g}s"
        return f"{socket} accepted but did not answer {what} within {timeout:g}s"
    except asyncio.IncompleteReadError as exc:
        return f"{socket} closed the connection after {len(exc.partial)} bytes of its answer to {what}"
    except PermissionError:
        raise  # says nothing about the runtime: the probe may not ask it (the caller decides)
    except OSError as exc:
        return f"cannot connect to {socket}: {exc.strerror or exc}"
    finally:
        if writer is not None:
            writer.close()
    if not answer:
        return f"{socket} closed the connection without answering {what}"
    return answer


_CHECKS: dict[Api, ApiCheck] = {
    "docker": docker_ping,
    "containerd": grpc_preface,
}


class ContainerRuntimeSource(DaemonSource):
    name = SOURCE_NAME
    gpu_source = False  # the runtime being down is a finding about the host, not a reason to doubt the GPU sources
    down_kind: RecordKind = KIND_CONTAINER_RUNTIME
    up_kind: RecordKind = KIND_CONTAINER_RUNTIME_RECOVERED
    reason_prefix = REASON_PREFIX

    def __init__(
        self,
        runtimes: Sequence[RuntimeSpec],
        *,
        down_threshold: float = 60.0,
        poll_interval: float = 15.0,
        timeout: float = 10.0,
        api_timeout: float = 5.0,
        systemctl: str = "systemctl",
        runner: CommandRunner = run_command,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            runtimes,
            down_threshold=down_threshold,
            poll_interval=poll_interval,
            timeout=timeout,
            systemctl=systemctl,
            runner=runner,
            clock=clock,
        )
        self._runtimes = {spec.unit: spec for spec in runtimes}
        self._api_timeout = api_timeout
        self._unanswered: dict[str, str] = {}  # unit -> why its API did not answer, while it does not
        self._forbidden: dict[str, str] = {}  # unit -> why the probe may not open its socket, while it may not
        self._checked: dict[str, str] = {}  # unit -> how the last poll checked it, for the source's status

    async def poll(self) -> list[Observation]:
        found = await super().poll()
        if self._status.is_ok and self._checked:
            self._status = SourceStatus(HealthState.OK, "; ".join(self._checked.values()))
        return found

    async def _states(self, watched: list[DaemonSpec]) -> list[str] | None:
        states = await super()._states(watched)
        if states is None:
            return None
        asks = [
            (index, self._runtimes[spec.unit])
            for index, (spec, state) in enumerate(zip(watched, states, strict=True))
            if state in UP_STATES and spec.unit in self._runtimes
        ]
        answers = await asyncio.gather(*(self._ask_api(runtime) for _, runtime in asks))
        self._checked = {spec.unit: f"{spec.unit}: unit {state}" for spec, state in zip(watched, states, strict=True)}
        for _, runtime in asks:
            forbidden = self._forbidden.get(runtime.unit)
            self._checked[runtime.unit] = (
                f"{runtime.unit}: unit and API on {runtime.socket}"
                if forbidden is None
                else f"{runtime.unit}: unit only, may not open {runtime.socket} ({forbidden})"
            )
        for (index, runtime), why in zip(asks, answers, strict=True):
            if why is None:
                self._unanswered.pop(runtime.unit, None)
                continue
            if self._unanswered.get(runtime.unit) != why:
                log.warning("%s: %s is active but its API does not answer: %s", self.name, runtime.unit, why)
            self._unanswered[runtime.unit] = why
            states[index] = UNRESPONSIVE
        return states

    async def _ask_api(self, runtime: RuntimeSpec) -> str | None:
        try:
            answer = await _CHECKS[runtime.api](runtime.socket, self._api_timeout)
        except PermissionError as exc:
            # A probe outside the socket's group (containerd's is root's alone): no fault of the runtime, so only its
            # unit is judged.
            if runtime.unit not in self._forbidden:
                log.warning(
                    "%s: may not open %s (%s): watching the %s unit only, not its API",
                    self.name,
                    runtime.socket,
                    exc.strerror or exc,
                    runtime.unit,
                )
            self._forbidden[runtime.unit] = str(exc.strerror or exc)
            return None
        if self._forbidden.pop(runtime.unit, None) is not None:
            log.info("%s: may open %s now: watching the %s API too", self.name, runtime.socket, runtime.unit)
        return answer

    def _describe(self, spec: DaemonSpec, state: str) -> str:
        if state == UNRESPONSIVE:
            why = self._unanswered.get(spec.unit, "no answer")
            return f"{spec.unit} is active but its API does not answer ({why})"
        return f"{spec.unit} is {state}"

    def _raw(self, spec: DaemonSpec, state: str) -> str:
        if state == UNRESPONSIVE and isinstance(spec, RuntimeSpec):
            return f"{spec.unit}: systemctl is-active: active; {spec.api} API on {spec.socket}: no answer"
        return super()._raw(spec, state)
