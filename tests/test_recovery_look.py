"""A repair's look at an instance (RemediationActivities.recovery_status) tells the instance's silence from ours: a
health workflow whose query no worker answered in time, or that was not started yet, is the engine's own delay
(`probe_unanswered`), which WorldWait (workflows/repair_ladder.py) does not count against the instance; what the
health workflow says (no heartbeat, a GPU source down) is the instance's. Against the real dev server and moto."""

from __future__ import annotations

import uuid

import boto3
from temporalio.client import Client

from activities.aws import AwsClients
from activities.models import RecoveryCheck
from activities.remediation import QUERY_TIMEOUT, RemediationActivities
from contract import names
from contract.config import AwsSettings
from contract.groups import CapacityGroup
from contract.health import HealthInput
from contract.ids import health_workflow_id


def _activities(client: Client, endpoint: str, cluster: str) -> RemediationActivities:
    boto3.client("ecs", endpoint_url=endpoint, region_name="us-east-1").create_cluster(clusterName=cluster)
    group = CapacityGroup(name="g", cluster=cluster)
    return RemediationActivities(AwsClients(AwsSettings(endpoint_url=endpoint)), {"g": group}.__getitem__, client)


async def test_a_health_workflow_no_worker_answers_is_our_silence_not_the_instances(
    client: Client, aws_env: str
) -> None:
    instance_id = f"i-{uuid.uuid4().hex[:17]}"
    activities = _activities(client, aws_env, f"c-{instance_id}")
    # A task queue no worker polls: the workflow is there, its query waits for a worker until QUERY_TIMEOUT.
    handle = await client.start_workflow(
        names.HEALTH_WORKFLOW,
        HealthInput(instance_id=instance_id, group="g"),
        id=health_workflow_id(instance_id),
        task_queue=f"nobody-polls-{instance_id}",
    )
    try:
        look = await activities.recovery_status(RecoveryCheck(group="g", instance_id=instance_id))
    finally:
        await handle.terminate()
    assert look.probe is None
    assert look.probe_unanswered is True
    assert look.probe_error.startswith("health workflow did not answer")
    assert look.agent_connected is None and look.container_status is None  # not registered in ECS
    assert QUERY_TIMEOUT.total_seconds() <= 10  # what this test waits for


async def test_no_health_workflow_yet_is_our_silence_too(client: Client, aws_env: str) -> None:
    # A repair looks only at an instance registered in ECS, which the AWS watch covers with a health workflow: one not
    # there yet (seen at 1,000 / 200 for a replacement) is the engine behind, not the instance.
    instance_id = f"i-{uuid.uuid4().hex[:17]}"
    activities = _activities(client, aws_env, f"c-{instance_id}")
    look = await activities.recovery_status(RecoveryCheck(group="g", instance_id=instance_id))
    assert look.probe is None
    assert look.probe_unanswered is True
    assert "not found" in look.probe_error
