"""Workflows running on the released code must keep running on this code: replay their recorded histories."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from worker.main import SANDBOX, WORKFLOWS

ROOT = Path(__file__).parent / "histories"
# The latest recording at the top, earlier releases' in folders named for what changed after them: every one of them
# must still replay.
HISTORIES = sorted(ROOT.rglob("*.json"))


def test_histories_are_recorded() -> None:
    assert {p.stem for p in HISTORIES} >= {"repair", "health", "semaphore"}


@pytest.mark.parametrize("path", HISTORIES, ids=[str(p.relative_to(ROOT).with_suffix("")) for p in HISTORIES])
async def test_recorded_history_replays_without_nondeterminism(path: Path) -> None:
    history = WorkflowHistory.from_json(f"recorded/{path.stem}", path.read_text())
    replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter, workflow_runner=SANDBOX)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"
