"""`--address`, `-n/--namespace`, `--api-key` and `--profile` mean the same on every command that talks to Temporal:
the operator's, `autorepair worker`, `autorepair ingest` and `autorepair probe --direct-temporal`
(contract/temporal_options.py). Each command is run for real against the dev server, with the shared settings and
TEMPORAL_PROFILE pointing where nothing listens, so only the flags can bring it to Temporal."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client

from contract.temporal_options import load_settings
from node_probe import cli as probe_cli
from operator_cli.main import build_parser
from simulator.servers import free_port
from tests.harness import eventually, unique
from tests.test_health_endpoints import assert_probe_delivers, get
from worker.settings import Settings

# Each command's own arguments, beside the Temporal options.
COMMANDS = {
    "worker": [],
    "ingest": [],
    "probe": ["--group", "g", "--direct-temporal"],
    "history": [],
}


@pytest.fixture
def nowhere_by_default(tmp_path: Path, client: Client) -> Iterator[dict[str, str]]:
    """An environment whose settings and TEMPORAL_PROFILE lead nowhere; temporal.toml's `dev` profile leads to the
    dev server, but to a namespace that does not exist (so -n must be read too)."""
    nowhere = f"127.0.0.1:{free_port()}"
    config = tmp_path / "temporal.toml"
    config.write_text(
        f'[profile.dev]\naddress = "{client.service_client.config.target_host}"\nnamespace = "no-such-namespace"\n'
        f'[profile.elsewhere]\naddress = "{nowhere}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOREPAIR_", "TEMPORAL_"))}
    env |= {
        "TEMPORAL_CONFIG_FILE": str(config),
        "TEMPORAL_PROFILE": "elsewhere",
        "AUTOREPAIR_TEMPORAL__TASK_QUEUE": unique("tq"),
        "AUTOREPAIR_METRICS_BIND_ADDRESS": "off",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name in set(os.environ) - set(env):
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        yield env


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_that_talks_to_temporal_reads_the_same_options(
    command: str, nowhere_by_default: dict[str, str], client: Client
) -> None:
    load = probe_cli.direct_temporal_settings if command == "probe" else Settings.load
    base = [command, *COMMANDS[command]]

    def temporal(*flags: str) -> tuple[str, str, str | None]:
        settings = load_settings(load, build_parser().parse_args([*base, *flags])).temporal
        key = settings.api_key.get_secret_value() if settings.api_key else None
        return settings.address, settings.namespace, key

    server = client.service_client.config.target_host
    assert temporal()[0] != server  # TEMPORAL_PROFILE's: nowhere
    assert temporal("--profile", "dev") == (server, "no-such-namespace", None)
    assert temporal("--profile", "dev", "-n", "ns", "--address", "a:1", "--api-key", "k") == ("a:1", "ns", "k")
    assert temporal("--temporal-address", "b:2", "--namespace", "ns2")[:2] == ("b:2", "ns2")


@contextlib.asynccontextmanager
async def running(env: dict[str, str], log: Path, *args: str) -> AsyncIterator[None]:
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "operator_cli.main", *args, env=env, stdout=out, stderr=out
        )
    try:
        yield
        assert process.returncode is None, log.read_text()
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()


async def test_the_worker_and_the_ingest_reach_temporal_by_their_flags(
    nowhere_by_default: dict[str, str], client: Client, tmp_path: Path
) -> None:
    temporal = ["--profile", "dev", "-n", client.namespace]
    health = f"127.0.0.1:{free_port()}"
    ingest_health = f"127.0.0.1:{free_port()}"
    env = nowhere_by_default | {"AUTOREPAIR_HEALTH_BIND_ADDRESS": health}
    bind = f"127.0.0.1:{free_port()}"
    async with (
        running(env, tmp_path / "worker.log", "worker", *temporal),
        running(env, tmp_path / "ingest.log", "ingest", "--bind", bind, "--metrics-bind", ingest_health, *temporal),
    ):
        # 200 only once each reached Temporal: the worker polls its task queue, the ingest's lazy client answered.
        for bound in (health, ingest_health):
            code, body = await eventually(
                functools.partial(get, f"http://{bound}/healthz"), lambda a: a[0] == 200, within=60, every=0.2
            )
            assert code == 200, body


async def test_the_probe_reaches_temporal_by_its_flags(
    nowhere_by_default: dict[str, str], client: Client, tmp_path: Path
) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    bind = f"127.0.0.1:{free_port()}"
    argv = ["probe", *COMMANDS["probe"], "--instance-id", unique("i"), "--kernel-log", str(log)]
    argv += ["--no-nvml", "--no-dcgm", "--no-daemons", "--no-container-runtime", "--spool-dir", str(tmp_path / "s")]
    argv += ["--profile", "dev", "-n", client.namespace, "--heartbeat-interval", "1", "--health-bind", bind]
    await assert_probe_delivers(argv, bind)
