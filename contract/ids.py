"""Workflow ids: one health workflow per instance, one repair per impaired instance, one semaphore per group."""


def health_workflow_id(instance_id: str) -> str:
    return f"health/{instance_id}"


def repair_workflow_id(instance_id: str) -> str:
    return f"repair/{instance_id}"


def semaphore_workflow_id(group: str) -> str:
    return f"drain-semaphore/{group}"
