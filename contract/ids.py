"""Workflow ids: one health workflow per instance, one per repair attempt of an instance, one semaphore per group,
one liveness tracker per group shard, one fleet breaker.

Repair ids (docs/operations.md, "Repair ids"): attempt n (1, 2, ...) of an instance's repair is
`repair/<instance>/<n>`, counted by the instance's health workflow, so that a failed repair can be retried under an id
of its own and every attempt keeps its history. Repairs started before attempts had ids of their own ran as
`repair/<instance>`: `repair_instance_of` and `repair_attempt_of` read both.
"""

REPAIR_PREFIX = "repair/"


def health_workflow_id(instance_id: str) -> str:
    return f"health/{instance_id}"


def repair_workflow_id(instance_id: str, attempt: int = 1) -> str:
    """Attempt `attempt` (from 1) of the instance's repair; the first unless said."""
    if attempt < 1:
        raise ValueError(f"repair attempts count from 1, not {attempt}")
    return f"{REPAIR_PREFIX}{instance_id}/{attempt}"


def legacy_repair_workflow_id(instance_id: str) -> str:
    """The one id of an instance's repair before attempts had ids of their own; read, never started anew."""
    return f"{REPAIR_PREFIX}{instance_id}"


def repair_attempt_of(workflow_id: str) -> tuple[str, int] | None:
    """(instance, attempt) of a repair's workflow id, attempt 0 for a legacy `repair/<instance>`; None for an id
    that is not a repair's."""
    if not workflow_id.startswith(REPAIR_PREFIX):
        return None
    rest = workflow_id[len(REPAIR_PREFIX) :]
    instance, slash, attempt = rest.rpartition("/")
    if slash and instance and attempt.isascii() and attempt.isdigit() and not attempt.startswith("0"):
        return instance, int(attempt)
    return (rest, 0) if rest else None


def repair_instance_of(workflow_id: str) -> str | None:
    """The instance a repair's workflow id (new or legacy) is about; None for an id that is not a repair's."""
    parsed = repair_attempt_of(workflow_id)
    return parsed[0] if parsed is not None else None


def semaphore_workflow_id(group: str) -> str:
    return f"drain-semaphore/{group}"


def fleet_breaker_workflow_id(task_queue: str) -> str:
    # One per worker deployment (its settings name the fleet's groups), told apart by the task queue.
    return f"fleet-breaker/{task_queue}"


def liveness_workflow_id(group: str, shard: int = 0, shards: int = 1) -> str:
    # The shard count is in the id: changing it starts a fresh set of trackers, and the old ones, no longer
    # reported to, hold their fire (a silent pipeline declares nothing) and end.
    return f"liveness/{group}" if shards <= 1 else f"liveness/{group}/{shard}of{shards}"
