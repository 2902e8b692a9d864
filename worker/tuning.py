"""`[worker]`: how much the worker takes on at once, passed to the Temporal SDK's Worker (worker/main.py).

The defaults are the SDK's own (temporalio 1.35; tests/test_worker_tuning.py fails if an SDK upgrade changes them),
stated here so that a benchmark can measure them and an operator can see what a change moves away from, except
`max_concurrent_activities`: a repair waiting for its replacement holds an activity for the whole boot, and at the
SDK's 100, 200 repairs at once (a fifth of 1,000 instances) left every other activity waiting 8-16 s for a slot at the
median and up to 94 s, past the events' timeouts (benchmarks/SCALE.md). The activities are asyncio tasks; their AWS
calls have threads of their own (`aws_call_threads`).
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import ConfigDict, Field

from contract.config import DEFAULT_CALL_THREADS, PositiveDuration, SettingsSection


class WorkerTuning(SettingsSection):
    model_config = ConfigDict(extra="forbid")

    max_concurrent_workflow_tasks: int = Field(
        default=100, ge=1, description="Workflow tasks (a workflow's code between two awaits) run at once"
    )
    max_concurrent_activities: int = Field(
        default=1_000,
        ge=1,
        description="Activities run at once; most make one AWS call at a time, a replacement's wait one for the boot",
    )
    workflow_task_pollers: int = Field(
        default=5,
        ge=2,
        description="Long polls for workflow tasks held open at once (sticky and normal queue together; at least 2)",
    )
    activity_task_pollers: int = Field(default=5, ge=1, description="Long polls for activity tasks held open at once")
    max_cached_workflows: int = Field(
        default=1_000,
        ge=0,
        description=(
            "Workflows kept in memory between tasks (the sticky cache): a cached workflow's next task is not replayed "
            "from its history; 0 turns the cache and sticky queues off"
        ),
    )
    sticky_queue_schedule_to_start_timeout: PositiveDuration = Field(
        default=timedelta(seconds=10),
        description="A task waiting this long on this worker's sticky queue goes to any worker (which replays)",
    )
    aws_call_threads: int = Field(
        default=DEFAULT_CALL_THREADS,
        ge=1,
        description=(
            "Threads for the activities' AWS calls, a pool of their own (activities/aws.py); a call waiting its turn "
            "holds no thread"
        ),
    )

    @property
    def aws_threads(self) -> int:
        return self.aws_call_threads

    def settings_problems(self) -> list[tuple[str | None, str]]:
        if self.max_cached_workflows and self.max_concurrent_workflow_tasks < 2:
            return [
                (
                    "max_concurrent_workflow_tasks",
                    "must be at least 2 while max_cached_workflows is not 0 (the Temporal SDK's rule)",
                )
            ]
        return []
