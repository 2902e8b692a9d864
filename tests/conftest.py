"""Real servers for the tests: a Temporal dev server (SQLite in memory) and a moto server over HTTP."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from contract import search_attributes
from simulator.servers import find_binary, free_port, moto_command
from tests.event_schema_check import check_events_files
from tests.harness import SERVER_STARTUP_TIMEOUT


@pytest.fixture(autouse=True)
def events_follow_their_schemas(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that had a tmp_path: every event its workers wrote there validates against its type's schema."""
    yield
    tmp_path = request.node.funcargs.get("tmp_path") if hasattr(request.node, "funcargs") else None
    if tmp_path is None:
        return
    _, wrong = check_events_files(tmp_path)
    assert not wrong, f"{len(wrong)} event(s) not of their schema:\n" + "\n".join(wrong[:20])


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        moto_command("127.0.0.1", port),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def aws_env(moto_endpoint: str) -> Iterator[str]:
    """Point boto3 at moto with throwaway credentials, for everything in this test process."""
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    yield moto_endpoint
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=find_binary("temporal"),
        data_converter=pydantic_data_converter,
        search_attributes=search_attributes.ALL,
        dev_server_extra_args=[
            "--dynamic-config-value",
            "limit.historyCount.suggestContinueAsNew=200",
        ],
        dev_server_startup_timeout=SERVER_STARTUP_TIMEOUT,
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
def client(temporal_env: WorkflowEnvironment) -> Client:
    return temporal_env.client
