"""Workflow ids: one health workflow per instance, one repair per impaired instance, one semaphore per group, one
liveness tracker per group shard, one fleet breaker."""


def health_workflow_id(instance_id: str) -> str:
    return f"health/{instance_id}"


def repair_workflow_id(instance_id: str) -> str:
    return f"repair/{instance_id}"


def semaphore_workflow_id(group: str) -> str:
    return f"drain-semaphore/{group}"


def fleet_breaker_workflow_id(task_queue: str) -> str:
    # One per worker deployment (its settings name the fleet's groups), told apart by the task queue.
    return f"fleet-breaker/{task_queue}"


def liveness_workflow_id(group: str, shard: int = 0, shards: int = 1) -> str:
    # The shard count is in the id: changing it starts a fresh set of trackers, and the old ones, no longer
    # reported to, hold their fire (a silent pipeline declares nothing) and end.
    return f"liveness/{group}" if shards <= 1 else f"liveness/{group}/{shard}of{shards}"
