"""Starting a group's drain semaphore: whoever needs it first (the worker's watch of the group, an impairment report, a
permit request) starts it, and finds the running one after that."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy

from contract import names
from contract.ids import semaphore_workflow_id
from contract.semaphore import SemaphoreInput


async def start_drain_semaphore(
    client: Client, task_queue: str, group: str, signal: str | None = None, args: Sequence[Any] = ()
) -> WorkflowHandle[Any, Any]:
    """Start the group's semaphore unless it runs, and send it `signal` with `args` if given (signal-with-start)."""
    return await client.start_workflow(
        names.SEMAPHORE_WORKFLOW,
        SemaphoreInput(group=group),
        id=semaphore_workflow_id(group),
        task_queue=task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        start_signal=signal,
        start_signal_args=args,
        static_summary=f"drain cap for capacity group {group}",
    )
