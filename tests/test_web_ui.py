"""The Temporal Web UI as the repair history: search attribute filters and one-line summaries, as an operator sees them.

Both tests run a real repair on the simulated fleet, then look at it from outside, the way an operator does: through
`temporal workflow list --query` (the same visibility queries the Web UI's filters make), and through the Web UI
itself in headless Chromium.

Every external program runs as an asyncio subprocess: the worker shares the test's event loop, and a blocking
`subprocess.run` would stall it.
"""

from __future__ import annotations

import asyncio
import html
import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter

from contract.ids import health_workflow_id, repair_workflow_id, semaphore_workflow_id
from simulator.servers import TemporalDevServer, find_binary, free_port
from tests.fleet import Fleet, simulated_fleet
from tests.harness import eventually

XID = 79
CHROMIUM = "/usr/bin/chromium"
# One Chromium run may not finish rendering the single-page app in time; each run is bounded, and retried.
CHROMIUM_RUN_TIMEOUT_S = 60.0
VIRTUAL_TIME_BUDGET_MS = 10_000


async def run_command(*argv: str, timeout: float = 60.0) -> tuple[int, str, str]:
    """Run a program without blocking the event loop; kill its whole process group if it overruns."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout)
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise AssertionError(f"{argv[0]} did not finish within {timeout}s") from None
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


async def list_workflows(address: str, namespace: str, query: str) -> list[tuple[str, str]]:
    """`temporal workflow list --query` as an operator types it: (workflow id, run id) of each match."""
    code, out, err = await run_command(
        find_binary("temporal"),
        "workflow",
        "list",
        "--address",
        address,
        "--namespace",
        namespace,
        "--query",
        query,
        "-o",
        "json",
    )
    assert code == 0, f"temporal workflow list --query {query!r} failed ({code}): {err}"
    executions: list[dict[str, Any]] = json.loads(out or "[]")
    return sorted((e["execution"]["workflowId"], e["execution"]["runId"]) for e in executions)


async def repair_one_instance(fleet: Fleet, instances: int) -> str:
    await fleet.all_healthy(instances)
    [faulty] = fleet.sim.live_instances()[:1]
    fleet.sim.inject_fault(faulty, xid=XID)
    assert await fleet.repairs_finished(1) == [faulty]
    return faulty


async def test_search_attribute_filters_find_the_repair_with_the_cli_and_every_workflow_has_a_summary(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        faulty = await repair_one_instance(fleet, 3)
        repair = client.get_workflow_handle(repair_workflow_id(faulty))
        # Its last event is published before it returns: the close follows a moment later.
        described = await eventually(repair.describe, lambda d: d.status == WorkflowExecutionStatus.COMPLETED)
        assert described.run_id is not None
        the_repair = [(repair_workflow_id(faulty), described.run_id)]

        address = client.service_client.config.target_host
        group = fleet.group

        async def listed(query: str, expected: list[tuple[str, str]]) -> None:
            # Visibility is eventually consistent: poll until the index has caught up.
            found = await eventually(lambda: list_workflows(address, client.namespace, query), lambda r: r == expected)
            assert found == expected, query

        await listed(f'InstanceId = "{faulty}" AND Outcome = "Completed"', the_repair)
        await listed(f'CapacityGroup = "{group}" AND RepairPhase = "Completed"', the_repair)
        await listed(f'Xid = {XID} AND CapacityGroup = "{group}"', the_repair)
        # The filters really filter: the instance's health workflow carries InstanceId too, but no Outcome or Xid.
        both = await eventually(
            lambda: list_workflows(address, client.namespace, f'InstanceId = "{faulty}"'), lambda r: len(r) == 2
        )
        assert {workflow_id for workflow_id, _ in both} == {repair_workflow_id(faulty), health_workflow_id(faulty)}
        assert await list_workflows(address, client.namespace, f'Xid = 48 AND CapacityGroup = "{group}"') == []

        # One-line summaries for every kind of workflow, as the Web UI lists them.
        repair_summary = await described.static_summary()
        assert repair_summary is not None
        assert repair_summary.startswith(f"repair {faulty}: XID_{XID} on GPU "), repair_summary
        health = await client.get_workflow_handle(health_workflow_id(faulty)).describe()
        assert await health.static_summary() == f"health of {faulty} in {group}"
        semaphore = await client.get_workflow_handle(semaphore_workflow_id(group)).describe()
        assert await semaphore.static_summary() == f"drain cap for capacity group {group}"


# --- the Web UI in a browser --------------------------------------------------------------------------------


@pytest.fixture
def chromium() -> str:
    found = CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")
    if found is None:
        pytest.fail("Chromium not found: run the tests through `make test`, which installs Debian's chromium")
    return found


def chromium_args(chromium: str, profile: Path) -> list[str]:
    return [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        # Virtual time runs ahead only while no request is pending: the app's API calls complete before the dump.
        f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}",
        "--window-size=1400,1000",
    ]


async def run_chromium(chromium: str, profile: Path, action: str, url: str) -> str:
    code, out, err = await run_command(*chromium_args(chromium, profile), action, url, timeout=CHROMIUM_RUN_TIMEOUT_S)
    assert code == 0, f"chromium {action} failed ({code}): {err[-2000:]}"
    return out


class Dom(str):
    """A page's DOM; short in a failure message (`eventually` prints the last value)."""

    def __repr__(self) -> str:
        return f"<DOM of {len(self)} characters>"


class Browser:
    """Headless Chromium, one fresh profile per page load."""

    def __init__(self, chromium: str, tmp_path: Path) -> None:
        self._chromium = chromium
        self._tmp_path = tmp_path
        self._loads = 0

    def _profile(self) -> Path:
        self._loads += 1
        return self._tmp_path / f"chromium-profile-{self._loads}"

    async def dom(self, url: str) -> Dom:
        """The page's DOM once the single-page app has fetched the workflow and rendered it, as text: entities
        and the URL-encoded content of the UI's markdown frames decoded."""
        return Dom(unquote(html.unescape(await run_chromium(self._chromium, self._profile(), "--dump-dom", url))))

    async def screenshot(self, url: str, path: Path) -> None:
        await run_chromium(self._chromium, self._profile(), f"--screenshot={path}", url)
        assert path.stat().st_size > 10_000, f"blank screenshot of {url}"


def contains(*texts: str) -> Callable[[str], bool]:
    return lambda dom: all(text in dom for text in texts)


async def test_web_ui_shows_the_repair_with_its_summary_and_runbook(
    aws_env: str, tmp_path: Path, chromium: str
) -> None:
    browser = Browser(chromium, tmp_path)
    # The session's dev server runs without the UI; this one has it, on a free port.
    async with TemporalDevServer(tmp_path / "temporal", port=free_port(), ui_port=free_port()) as server:
        client = await Client.connect(server.address, data_converter=pydantic_data_converter)
        async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
            faulty = await repair_one_instance(fleet, 3)
            described = await client.get_workflow_handle(repair_workflow_id(faulty)).describe()
            summary = await described.static_summary()
            assert summary is not None and summary.startswith(f"repair {faulty}: XID_{XID} on GPU "), summary

            # UI 2.x's pages of one run; the workflow id is one path segment, its "/" encoded.
            run_url = (
                f"http://{server.host}:{server.ui_port}/namespaces/{server.namespace}"
                f"/workflows/{quote(repair_workflow_id(faulty), safe='')}/{described.run_id}"
            )
            # The event history, oldest first: the started event carries the summary, each activity its own.
            history = await eventually(
                lambda: browser.dom(f"{run_url}/history?sort=ascending"),
                contains(summary, "read group config", f"set {faulty} DRAINING in cluster {fleet.group}"),
                within=180,
                every=1,
            )
            assert repair_workflow_id(faulty) in history
            # User Metadata: the summary, and the runbook as current details (a query, so while a worker runs).
            metadata_url = f"{run_url}/user-metadata"
            await eventually(
                lambda: browser.dom(metadata_url),
                contains(summary, f"Repair of `{faulty}`", "Outcome: **Completed**"),
                within=180,
                every=1,
            )
            screenshot = tmp_path / "repair.png"
            await browser.screenshot(metadata_url, screenshot)
            await browser.screenshot(f"{run_url}/history?sort=ascending", tmp_path / "history.png")
            print(f"\nWeb UI page {metadata_url}\nscreenshot {screenshot}")
