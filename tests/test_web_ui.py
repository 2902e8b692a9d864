"""The Temporal Web UI as the repair history: search attribute filters and one-line summaries, as an operator sees them.

Both tests run a real repair on the simulated fleet, then look at it from outside, the way an operator does: through
`temporal workflow list --query` (the same visibility queries the Web UI's filters make), and through the Web UI
itself in headless Chromium (docs/pictures/headless.py: every external program runs as an asyncio subprocess, as
the worker shares the test's event loop). The second also takes the README's pictures of its repair with the capture
script's own code (docs/pictures/capture.py), so they can always be taken again.
"""

from __future__ import annotations

import html
import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter

from contract.ids import health_workflow_id, repair_workflow_id, semaphore_workflow_id
from docs.pictures.capture import HISTORY_WINDOW, RUNBOOK_WINDOW, Captured, FinishedRepair, capture
from docs.pictures.headless import find_chromium, png_size, run_chromium, run_command
from simulator.servers import TemporalDevServer, find_binary, free_port
from tests.fleet import Fleet, simulated_fleet
from tests.harness import eventually

XID = 79
SVG = "{http://www.w3.org/2000/svg}"


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
    found = find_chromium()
    if found is None:
        pytest.fail("Chromium not found: run the tests through `make test`, which installs Debian's chromium")
    return found


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
                contains(summary, "event RepairStarted", f"set {faulty} DRAINING in cluster {fleet.group}"),
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
            # The README's pictures of this repair, taken as `python -m docs.pictures.capture` takes them.
            [completed] = fleet.events("RepairCompleted", faulty)
            repair = FinishedRepair(
                server.address,
                server.namespace,
                server.ui_url,
                fleet.group,
                repair_workflow_id(faulty),
                described.run_id,
                completed,
            )
            captured = await capture(repair, tmp_path / "pictures", chromium, tmp_path)
            assert_pictures(captured, faulty, completed)
            print(f"\nWeb UI page {metadata_url}\npictures in {captured.screenshot.parent}")


def assert_pictures(captured: Captured, faulty: str, completed: dict[str, Any]) -> None:
    """Pictures a reader can use: PNGs of the window's size and not blank, the timeline's bars those of the
    repair's phases, and each command's output about this fleet."""
    for path, window in ((captured.screenshot, RUNBOOK_WINDOW), (captured.history_page, HISTORY_WINDOW)):
        data = path.read_bytes()
        assert png_size(data) == window, path
        # A rendered page, not a blank one; and small enough to check in.
        assert 20_000 < len(data) < 3_000_000, (path, len(data))
    svg = ET.fromstring(captured.timeline.read_text(encoding="utf-8"))
    bars = [e.get("data-phase") for e in svg.iter(f"{SVG}rect") if "bar" in (e.get("class") or "").split()]
    phases = [step["phase"] for step in completed["detail"]["timeline"]]
    assert bars == phases[:-1] and phases[-1] == "Completed", (bars, phases)
    describe = captured.describe.read_text(encoding="utf-8")
    assert describe.startswith("$ autorepair describe-instances --group ") and "ACCELERATED_COMPUTE" in describe
    history = captured.history.read_text(encoding="utf-8")
    assert history.startswith("$ autorepair history --group ") and faulty in history and "Completed" in history
