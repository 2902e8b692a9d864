"""The container runtime check (ECS's CONTAINER_RUNTIME) against real unix-socket servers: a docker-like HTTP server
that answers GET /_ping as dockerd does, a real gRPC server (grpcio) standing in for containerd, a socket that
accepts and never answers (a hung runtime), and no socket at all. systemd is a real script named as systemctl. The
finding goes through the real probe to a real health workflow on the Temporal dev server."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import stat
import sys
import typing
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from aiohttp import web
from temporalio.client import Client

from contract.health import CheckType, HealthState
from contract.probe import STATE_TRANSITION_KINDS
from node_probe.classify.policy import Policy
from node_probe.classify.record import RecordKind
from node_probe.delivery.reporter import Reporter
from node_probe.probe import Probe, ProbeConfig, build_sources
from node_probe.sources.container_runtime import (
    ContainerRuntimeSource,
    RuntimeSpec,
    default_runtimes,
    docker_ping,
    grpc_preface,
)
from tests.harness import eventually, unique
from tests.test_daemons import NOW, Clock
from tests.test_health_signals import check, health_of, monitor_only, start_health
from tests.test_probe import FakeReporter

API_TIMEOUT = 0.5


@contextlib.asynccontextmanager
async def docker_like(path: Path) -> AsyncIterator[None]:
    """An HTTP server on a unix socket answering /_ping with what dockerd sends (moby api/server/router/system)."""

    async def ping(request: web.Request) -> web.Response:
        headers = {"Api-Version": "1.47", "Docker-Experimental": "false", "Ostype": "linux"}
        return web.Response(text="OK", headers=headers)

    app = web.Application()
    app.router.add_get("/_ping", ping)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.UnixSite(runner, str(path))
    await site.start()
    try:
        yield
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def grpc_server(path: Path) -> AsyncIterator[None]:
    """A real gRPC server (grpcio, HTTP/2 like containerd's) on a unix socket, serving nothing in particular."""
    server = grpc.aio.server()
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    try:
        yield
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def hung(path: Path) -> AsyncIterator[list[int]]:
    """Accepts connections and never answers, as a wedged dockerd does; counts the connections."""
    accepted: list[int] = []
    held: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        held.append(writer)

    server = await asyncio.start_unix_server(handle, str(path))
    try:
        yield accepted
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


def fake_systemctl(tmp_path: Path, states: dict[str, str]) -> tuple[Path, Path]:
    """A real executable answering `systemctl is-active U...` and `systemctl show --property=LoadState --value U...`
    from a JSON file of unit -> state (a unit not in it is not installed); returns the program and the file."""
    state_file = tmp_path / "units.json"
    state_file.write_text(json.dumps(states))
    program = tmp_path / "systemctl"
    program.write_text(
        f"""#!/usr/bin/env python3
import json, sys
states = json.load(open({str(state_file)!r}))
if sys.argv[1] == "is-active":
    print("\\n".join(states.get(unit, "inactive") for unit in sys.argv[2:]))
    sys.exit(0 if all(states.get(unit) == "active" for unit in sys.argv[2:]) else 3)
print("\\n\\n".join("loaded" if unit in states else "not-found" for unit in sys.argv[4:]))
"""
    )
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    return program, state_file


def docker(socket: Path) -> RuntimeSpec:
    return RuntimeSpec(unit="docker", api="docker", socket=socket)


def containerd(socket: Path) -> RuntimeSpec:
    return RuntimeSpec(unit="containerd", api="containerd", socket=socket)


def source(runtimes: list[RuntimeSpec], systemctl: Path, clock: Clock, threshold: float = 60) -> ContainerRuntimeSource:
    return ContainerRuntimeSource(
        runtimes, down_threshold=threshold, systemctl=str(systemctl), clock=clock, api_timeout=API_TIMEOUT
    )


def test_the_host_service_kinds_are_the_contracts() -> None:
    assert set(typing.get_args(RecordKind)) >= STATE_TRANSITION_KINDS


async def test_docker_ping_answers_hangs_or_is_missing(tmp_path: Path) -> None:
    sock = tmp_path / "docker.sock"
    async with docker_like(sock):
        assert await docker_ping(sock, API_TIMEOUT) is None
    async with hung(sock) as accepted:
        why = await docker_ping(sock, API_TIMEOUT)
        assert why == f"{sock} accepted but did not answer GET /_ping within {API_TIMEOUT:g}s" and accepted
    sock.unlink(missing_ok=True)
    why = await docker_ping(sock, API_TIMEOUT)
    assert why is not None and why.startswith(f"cannot connect to {sock}: No such file")


async def test_a_grpc_server_answers_the_http2_preface_and_a_hung_one_does_not(tmp_path: Path) -> None:
    sock = tmp_path / "containerd.sock"
    async with grpc_server(sock):
        assert await grpc_preface(sock, API_TIMEOUT) is None
    sock.unlink(missing_ok=True)
    async with hung(sock):
        assert "did not answer the HTTP/2 preface" in (await grpc_preface(sock, API_TIMEOUT) or "")
    sock.unlink(missing_ok=True)
    async with docker_like(sock):  # an HTTP/1.1 server is not a gRPC server
        why = await grpc_preface(sock, API_TIMEOUT)
        assert why is not None and "HTTP/2" in why


async def test_a_hung_runtime_impairs_after_the_threshold_and_a_blip_does_not(tmp_path: Path) -> None:
    sock = tmp_path / "docker.sock"
    systemctl, _ = fake_systemctl(tmp_path, {"docker": "active"})
    clock = Clock()
    runtime = source([docker(sock)], systemctl, clock)
    async with hung(sock):
        assert await runtime.poll() == []  # hung, but not for long yet
        clock.now += 30
        assert await runtime.poll() == []
    sock.unlink(missing_ok=True)
    async with docker_like(sock):
        clock.now += 20
        assert await runtime.poll() == []  # the blip is over: never reported
    sock.unlink(missing_ok=True)
    async with hung(sock):
        clock.now += 10
        assert await runtime.poll() == []  # a new outage: its clock starts now
        clock.now += 61
        (down,) = await runtime.poll()
        clock.now += 600
        assert await runtime.poll() == []  # still hung: said once
    record = down.record
    assert (record.kind, record.reason, record.critical) == ("container_runtime", "CONTAINER_RUNTIME_docker", True)
    assert "docker is active but its API does not answer" in record.message and "for 61s" in record.message
    for policy in ("ecs", "nvidia-catalog"):
        verdict = Policy(policy).classify(record, NOW)
        assert verdict.impairs and verdict.reason == "CONTAINER_RUNTIME_docker"
    sock.unlink(missing_ok=True)
    async with docker_like(sock):
        clock.now += 5
        (up,) = await runtime.poll()
    assert (up.record.kind, up.record.reason) == ("container_runtime_recovered", "CONTAINER_RUNTIME_docker")
    assert not Policy().classify(up.record, NOW).impairs
    assert runtime.status.is_ok and not runtime.gpu_source


async def test_a_stopped_unit_or_a_missing_socket_is_down_and_only_installed_runtimes_are_watched(
    tmp_path: Path,
) -> None:
    sock = tmp_path / "containerd.sock"
    systemctl, states = fake_systemctl(tmp_path, {"containerd": "active"})  # docker is not installed here
    clock = Clock()
    runtimes = [
        RuntimeSpec(unit="docker", api="docker", socket=tmp_path / "docker.sock", only_if_installed=True),
        RuntimeSpec(unit="containerd", api="containerd", socket=sock, only_if_installed=True),
    ]
    runtime = source(runtimes, systemctl, clock, threshold=0)
    (gone,) = await runtime.poll()  # active, but nothing listens on its socket
    assert gone.record.reason == "CONTAINER_RUNTIME_containerd" and "No such file" in gone.record.message
    async with grpc_server(sock):
        (back,) = await runtime.poll()
        assert back.record.kind == "container_runtime_recovered"
        states.write_text(json.dumps({"containerd": "failed"}))
        (stopped,) = await runtime.poll()  # its unit failed: the socket is not even asked
    assert stopped.record.message.startswith("containerd is failed for 0s") and stopped.position != gone.position
    assert all(down.record.reason != "CONTAINER_RUNTIME_docker" for down in (gone, stopped))


AS_A_USER = """
import asyncio, sys
from pathlib import Path
from node_probe.sources.container_runtime import ContainerRuntimeSource, RuntimeSpec

async def main() -> None:
    docker = RuntimeSpec(unit="docker", api="docker", socket=Path(sys.argv[1]))
    runtime = ContainerRuntimeSource([docker], down_threshold=0, systemctl=sys.argv[2], api_timeout=0.5)
    print(len(await runtime.poll()), runtime.status.is_ok)

asyncio.run(main())
"""
NOBODY = 65534
PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def without_root_file_access() -> None:
    """In the child, before exec: root loses the capabilities that ignore file permissions, so that a socket another
    user owns (mode 0600) is refused to it as to any user outside that socket's group."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root's file-access capabilities in a child, which needs root")
async def test_a_socket_the_probe_may_not_open_is_no_fault_of_the_runtime(tmp_path: Path) -> None:
    """The shipped unit runs the probe as a dynamic user that may not open docker's socket (root:docker 0660): the
    runtime is judged by its unit alone, never impaired for the probe's own lack of access."""
    systemctl, _ = fake_systemctl(tmp_path, {"docker": "active"})
    sock = tmp_path / "docker.sock"
    async with hung(sock):
        os.chown(sock, NOBODY, NOBODY)
        sock.chmod(0o600)  # another user's only, like docker.sock to a user outside the docker group
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            AS_A_USER,
            str(sock),
            str(systemctl),
            cwd=Path(__file__).resolve().parent.parent,
            preexec_fn=without_root_file_access,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await child.communicate()
    assert child.returncode == 0, err.decode()
    # Hung and past a zero threshold, yet no finding: the probe could not ask, so it judged the unit (active).
    assert out.decode().split() == ["0", "True"]
    assert f"may not open {sock} (Permission denied): watching the docker unit only" in err.decode()


def test_defaults_watch_docker_and_containerd_where_installed() -> None:
    specs = {spec.unit: spec for spec in default_runtimes()}
    assert specs["docker"].socket == Path("/var/run/docker.sock") and specs["docker"].api == "docker"
    assert specs["containerd"].socket == Path("/run/containerd/containerd.sock")
    assert all(spec.only_if_installed and spec.critical for spec in specs.values())
    config = ProbeConfig(instance_id="i-1", group="g", container_runtimes=default_runtimes())
    assert [type(s) for s in build_sources(config)] == [ContainerRuntimeSource]


@pytest.mark.timeout(180)
async def test_a_hung_docker_impairs_container_runtime_and_its_recovery_clears_it(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    """The real probe, its runtime source on a hung socket, delivering to a real health workflow."""
    sock = tmp_path / "docker.sock"
    systemctl, _ = fake_systemctl(tmp_path, {"docker": "active"})
    instance = unique("i")
    async with monitor_only(client, aws_env, tmp_path) as (settings, group):
        handle = await start_health(client, settings, instance)
        runtime = ContainerRuntimeSource(
            [docker(sock)], down_threshold=1.0, poll_interval=0.1, systemctl=str(systemctl), api_timeout=0.2
        )
        config = ProbeConfig(
            instance_id=instance,
            group=group,
            task_queue=settings.temporal.task_queue,
            heartbeat_interval=timedelta(hours=1),
            retry_max_backoff=timedelta(seconds=1),
        )
        probe = Probe(config, Reporter(client), sources=[runtime])
        task = asyncio.create_task(probe.run())
        try:
            async with hung(sock):
                # The repair decision follows the impairment: withheld, as the group's auto repair is DISABLED.
                view = await eventually(lambda: health_of(handle), lambda v: v.repair_withheld is not None, within=60)
            assert check(view, CheckType.CONTAINER_RUNTIME) is HealthState.IMPAIRED
            assert view.healthStatus.overallStatus is HealthState.IMPAIRED
            detail = next(d for d in view.healthStatus.details if d.type is CheckType.CONTAINER_RUNTIME)
            assert detail.statusReason == "CONTAINER_RUNTIME_docker"
            assert check(view, CheckType.ACCELERATED_COMPUTE) is not HealthState.IMPAIRED
            assert "DISABLED" in (view.repair_withheld or "")
            sock.unlink(missing_ok=True)
            async with docker_like(sock):
                view = await eventually(
                    lambda: health_of(handle),
                    lambda v: check(v, CheckType.CONTAINER_RUNTIME) is HealthState.OK,
                    within=60,
                )
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert [f.kind for f in view.recent_findings] == ["container_runtime", "container_runtime_recovered"]
    assert view.healthStatus.overallStatus is not HealthState.IMPAIRED and not view.warning_counts


async def test_the_source_says_which_way_it_checked_each_runtime_and_the_heartbeat_carries_it(tmp_path: Path) -> None:
    """OK, and how: through the API where the probe may open the socket, by the unit alone where it is not running."""
    sock = tmp_path / "docker.sock"
    systemctl, _ = fake_systemctl(tmp_path, {"docker": "active", "containerd": "failed"})
    runtime = source([docker(sock), containerd(tmp_path / "containerd.sock")], systemctl, Clock())
    async with docker_like(sock):
        assert await runtime.poll() == []  # containerd failed, but not for long yet
    assert runtime.status.state is HealthState.OK
    assert runtime.status.reason == f"docker: unit and API on {sock}; containerd: unit failed"
    # The heartbeat names it, OK; it is no GPU source, so the GPUs' health is as the GPU sources say.
    probe = Probe(ProbeConfig(instance_id="i-1", group="g"), FakeReporter(), sources=[runtime])
    [reported] = probe.heartbeat().sources
    assert (reported.state, reported.reason, reported.gpu_source) == (HealthState.OK, runtime.status.reason, False)


AS_A_USER_GRANTED_LATER = """
import asyncio, logging, sys
from pathlib import Path
from node_probe.sources.container_runtime import ContainerRuntimeSource, RuntimeSpec

async def main() -> None:
    docker = RuntimeSpec(unit="docker", api="docker", socket=Path(sys.argv[1]))
    runtime = ContainerRuntimeSource([docker], down_threshold=0, systemctl=sys.argv[2], api_timeout=0.5)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(len(await runtime.poll()), runtime.status.reason, flush=True)
    sys.stdin.readline()  # the socket's mode changes meanwhile, as a restart in its group would make it
    print(len(await runtime.poll()), runtime.status.reason, flush=True)

asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root's file-access capabilities in a child, which needs root")
async def test_a_socket_refused_is_checked_by_its_unit_and_says_so_until_access_is_granted(tmp_path: Path) -> None:
    """As deployed: a probe outside the socket's group judges the unit alone and says so in its status; once it may
    open the socket (the unit's SupplementaryGroups=docker), the next poll asks the API, and says that."""
    systemctl, _ = fake_systemctl(tmp_path, {"docker": "active"})
    sock = tmp_path / "docker.sock"
    async with docker_like(sock):
        os.chown(sock, NOBODY, NOBODY)
        sock.chmod(0o600)
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            AS_A_USER_GRANTED_LATER,
            str(sock),
            str(systemctl),
            cwd=Path(__file__).resolve().parent.parent,
            preexec_fn=without_root_file_access,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert child.stdout is not None and child.stdin is not None
        first = (await asyncio.wait_for(child.stdout.readline(), 30)).decode().strip()
        sock.chmod(0o666)
        out, err = await asyncio.wait_for(child.communicate(b"\n"), 30)
    assert child.returncode == 0, err.decode()
    assert first == f"0 docker: unit only, may not open {sock} (Permission denied)"
    assert out.decode().strip() == f"0 docker: unit and API on {sock}"
    assert f"may open {sock} now: watching the docker API too" in err.decode()
