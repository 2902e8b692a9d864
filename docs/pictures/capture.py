"""The README's and the operations guide's pictures, taken from a real demo run: `python -m docs.pictures.capture`.

It runs `autorepair demo` (12 instances, 2 faults, free ports, a scratch state dir), waits until the repairs have
completed, and while the demo's servers and worker are still up writes into docs/pictures/:

- repair-web-ui.png and repair-event-history.png: the longest repair's page in the Temporal Web UI (headless
  Chromium): its summary and the runbook in its current details; its event history;
- repair-timeline.svg: that repair's timeline by phase, from its RepairCompleted event (timeline_svg.py);
- describe-instances.txt and history.txt: `autorepair describe-instances` and `autorepair history` of the group,
  which it then pastes into README.md's marked blocks (`paste_samples`).

tests/test_web_ui.py runs `capture` on its own repair, so the path that takes the pictures is tested; the checked-in
files are not compared byte for byte. tests/test_docs_pictures.py checks that the README's blocks are the files.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import html
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from contract.event_types import RepairCompleted
from contract.events import Event
from contract.formats import workflow_url
from docs.pictures.headless import find_chromium, png_size, run_chromium, run_command
from docs.pictures.timeline_svg import timeline_svg

PICTURES = Path(__file__).resolve().parent
ROOT = PICTURES.parent.parent
README = ROOT / "README.md"
SCREENSHOT = "repair-web-ui.png"
TIMELINE = "repair-timeline.svg"
DESCRIBE = "describe-instances.txt"
HISTORY = "history.txt"
HISTORY_PAGE = "repair-event-history.png"
RUNBOOK_WINDOW = (1400, 900)  # the runbook fits, with little white below it
HISTORY_WINDOW = (1400, 1400)  # the input, the result, and the history's first events
MIN_PNG_BYTES = 10_000  # a blank page is smaller
# Wide enough for most columns not to fold (rich reads the width from COLUMNS when not on a terminal).
CLI_COLUMNS = 200
PAGE_TRIES = 8
DEMO_LIMIT_S = 300.0
# README.md's sample blocks: this marker names the file, and the fenced block right after it is that file's text.
_SAMPLE = re.compile(r"(<!-- sample: (docs/pictures/[\w.-]+) -->\n```text\n)(.*?)(```)", re.DOTALL)


@dataclass(frozen=True)
class FinishedRepair:
    """A completed repair on a running Temporal server with its Web UI, and a worker still answering queries."""

    temporal_address: str
    namespace: str
    ui_url: str
    group: str
    workflow_id: str
    run_id: str
    completed: dict[str, Any]  # its RepairCompleted event as the JSON-lines sink wrote it

    @property
    def page(self) -> str:
        """The run's page in the Web UI."""
        return workflow_url(self.ui_url, self.namespace, self.workflow_id, self.run_id)


@dataclass(frozen=True)
class Captured:
    screenshot: Path
    history_page: Path
    timeline: Path
    describe: Path
    history: Path


async def capture(repair: FinishedRepair, out_dir: Path, chromium: str, scratch: Path) -> Captured:
    """Take the pictures of `repair` into `out_dir` (`scratch`: Chromium's profiles)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    browser = _Pages(chromium, scratch)
    # The runbook (the repair's current details, a query answered by a running worker), and the event history.
    screenshot = await browser.screenshot(
        f"{repair.page}/user-metadata", "Outcome", RUNBOOK_WINDOW, out_dir / SCREENSHOT
    )
    history_page = await browser.screenshot(
        f"{repair.page}/history?sort=ascending", "Workflow Execution Started", HISTORY_WINDOW, out_dir / HISTORY_PAGE
    )
    event = Event.model_validate(repair.completed)
    detail = event.typed()
    assert isinstance(detail, RepairCompleted), f"{event.type} is no RepairCompleted event"
    timeline = out_dir / TIMELINE
    title = f"repair of {event.instance_id} ({detail.reason}) by phase, from its RepairCompleted event"
    timeline.write_text(timeline_svg(detail.timeline, title), encoding="utf-8")
    describe = out_dir / DESCRIBE
    describe.write_text(await _cli(repair, "describe-instances", "--group", repair.group), encoding="utf-8")
    history = out_dir / HISTORY
    history.write_text(await _cli(repair, "history", "--group", repair.group), encoding="utf-8")
    return Captured(screenshot, history_page, timeline, describe, history)


class _Pages:
    """Screenshots of Web UI pages, each in a fresh Chromium profile."""

    def __init__(self, chromium: str, scratch: Path) -> None:
        self._chromium = chromium
        self._scratch = scratch
        self._loads = 0

    async def _run(self, action: str, url: str, window: tuple[int, int]) -> str:
        self._loads += 1
        return await run_chromium(self._chromium, self._scratch / f"capture-profile-{self._loads}", action, url, window)

    async def screenshot(self, url: str, ready: str, window: tuple[int, int], path: Path) -> Path:
        """The page once the app shows `ready` on it: it renders asynchronously, and a load that caught it half
        drawn is tried again."""
        for _ in range(PAGE_TRIES):
            dom = unquote(html.unescape(await self._run("--dump-dom", url, window)))
            if ready in dom:
                path.unlink(missing_ok=True)
                await self._run(f"--screenshot={path}", url, window)
                if path.exists() and path.stat().st_size > MIN_PNG_BYTES and png_size(path.read_bytes()) == window:
                    return path
            await asyncio.sleep(1)
        raise AssertionError(f"the Web UI did not render {url} in {PAGE_TRIES} tries")


def _autorepair() -> str:
    beside = Path(sys.executable).parent / "autorepair"
    return str(beside) if beside.exists() else (shutil.which("autorepair") or "autorepair")


async def _cli(repair: FinishedRepair, *argv: str) -> str:
    """The command's output as a person sees it, after the command line that made it."""
    env = os.environ | {"COLUMNS": str(CLI_COLUMNS), "AUTOREPAIR_TEMPORAL__UI_URL": repair.ui_url}
    connection = ("--address", repair.temporal_address, "--namespace", repair.namespace)
    code, out, err = await run_command(_autorepair(), *argv, *connection, env=env)
    assert code == 0, f"autorepair {' '.join(argv)} failed ({code}): {err}"
    lines = [line.rstrip() for line in out.splitlines()]
    return f"$ autorepair {' '.join(argv)}\n" + "\n".join(lines).strip("\n") + "\n"


def paste_samples(readme: str, root: Path = ROOT) -> str:
    """`readme` with each marked sample block holding the file its marker names."""

    def pasted(match: re.Match[str]) -> str:
        text = (root / match.group(2)).read_text(encoding="utf-8")
        return match.group(1) + text + match.group(4)

    return _SAMPLE.sub(pasted, readme)


def sample_files(readme: str) -> list[str]:
    """The files README.md's sample blocks name."""
    return [match.group(2) for match in _SAMPLE.finditer(readme)]


# --- the demo run ---------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def demo_repair(args: argparse.Namespace, state: Path) -> AsyncIterator[FinishedRepair]:
    """`autorepair demo` up with its repairs finished, and the longest of them; the demo stays up (no --exit) until
    the block ends, then stops as a person stops it."""
    from temporalio.client import Client, WorkflowExecutionStatus
    from temporalio.contrib.pydantic import pydantic_data_converter

    from simulator.demo import DEMO_GROUP
    from simulator.events import group_events, repaired_instances
    from simulator.servers import free_port

    ports = {name: free_port() for name in ("temporal", "ui", "moto", "ingest", "sim")}
    demo_dir, events = state / "demo", state / "events.jsonl"
    argv = [
        *("demo", "--instances", str(args.instances), "--faults", str(args.faults), "--seed", str(args.seed)),
        *("--state-dir", str(demo_dir), "--events", str(events), "--time-limit", str(DEMO_LIMIT_S)),
        *(f"--{name}-port={port}" for name, port in ports.items()),
    ]
    with (state / "demo.out").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            _autorepair(), *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
        try:
            deadline = time.monotonic() + DEMO_LIMIT_S
            while len(repaired_instances(events, DEMO_GROUP)) < args.faults:
                if proc.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the demo ended or overran before its repairs were done: see {log.name}")
                await asyncio.sleep(1)
            # The longest of the repairs: its timeline shows the most.
            completed = max(group_events(events, DEMO_GROUP, "RepairCompleted"), key=_repair_seconds)
            address = f"127.0.0.1:{ports['temporal']}"
            client = await Client.connect(address, data_converter=pydantic_data_converter)
            handle = client.get_workflow_handle(completed["workflow_id"])
            # The last event is published before the repair returns: its close follows a moment later.
            while (described := await handle.describe()).status != WorkflowExecutionStatus.COMPLETED:
                await asyncio.sleep(0.5)
            assert described.run_id is not None
            ui_url = f"http://localhost:{ports['ui']}"
            print(f"demo up; its repairs: {workflow_url(ui_url, client.namespace)}")
            yield FinishedRepair(
                address, client.namespace, ui_url, DEMO_GROUP, completed["workflow_id"], described.run_id, completed
            )
        finally:
            await _stop(proc)


def _repair_seconds(completed: dict[str, Any]) -> float:
    steps = completed["detail"]["timeline"]
    return (
        datetime.fromisoformat(steps[-1]["started_at"]) - datetime.fromisoformat(steps[0]["started_at"])
    ).total_seconds()


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Ctrl-C, as a person ends the demo (in order: probes, worker, servers); killed if it does not end."""
    if proc.returncode is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), timeout=60)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def run(args: argparse.Namespace) -> int:
    chromium = find_chromium()
    if chromium is None:
        print("Chromium not found: `make browser` installs Debian's chromium", file=sys.stderr)
        return 2
    state = Path(tempfile.mkdtemp(prefix="autorepair-capture-"))
    async with demo_repair(args, state) as repair:
        captured = await capture(repair, args.out, chromium, state)
    for path in (captured.screenshot, captured.history_page, captured.timeline, captured.describe, captured.history):
        print(f"wrote {path}")
    if args.out.resolve() == PICTURES:
        readme = README.read_text(encoding="utf-8")
        README.write_text(paste_samples(readme), encoding="utf-8")
        print(f"pasted {', '.join(sample_files(readme)) or 'nothing'} into README.md")
    # Only after a run that worked: a failed one leaves its logs (demo.out, the demo's state dir) to read.
    shutil.rmtree(state, ignore_errors=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m docs.pictures.capture", description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=12)
    parser.add_argument("--faults", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=PICTURES, help="where the pictures go (default docs/pictures)")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
