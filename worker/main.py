"""The worker process: every workflow and activity of gpu-autorepair on one task queue."""

from __future__ import annotations

from contextlib import AsyncExitStack

from temporalio.client import Client
from temporalio.runtime import Runtime
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities.aws import AwsClients
from activities.aws_status import AwsStatusActivities
from activities.breaker_ops import BreakerOps
from activities.events import EventActivities, event_delivery
from activities.evidence import EvidenceActivities
from activities.fleet import FleetActivities
from activities.remediation import RemediationActivities
from activities.workflow_ops import WorkflowOps
from contract.breaker import FleetBreakerConfig
from worker.aws_watch import aws_watch
from worker.health_gauges import health_gauges
from worker.settings import Settings
from workflows.drain_semaphore import DrainSemaphoreWorkflow
from workflows.fleet_breaker import FleetBreakerWorkflow
from workflows.health import InstanceHealthWorkflow
from workflows.liveness import LivenessTrackerWorkflow
from workflows.repair import InstanceRepairWorkflow

WORKFLOWS = [
    InstanceHealthWorkflow,
    InstanceRepairWorkflow,
    DrainSemaphoreWorkflow,
    LivenessTrackerWorkflow,
    FleetBreakerWorkflow,
]

# The contract and the models are shared with activities and clients: passing them through keeps one class per
# model (and per enum, so `is` comparisons hold), so a model built in a workflow is an instance of the class an
# activity's input expects (and the sandbox loads less).
# structlog and rich format the replay-aware workflow logger's records; they import lazily, which the sandbox blocks.
SANDBOX = SandboxedWorkflowRunner(
    restrictions=SandboxRestrictions.default.with_passthrough_modules(
        # workflows.breaker: its book is carried state (a model in workflows.models), so one class for both.
        "contract",
        "workflows.models",
        "workflows.breaker",
        "activities",
        "pydantic",
        "structlog",
        "rich",
    )
)


def build_worker(settings: Settings, client: Client) -> Worker:
    aws = AwsClients(settings.aws)
    fleet = FleetActivities(aws, settings.group, client=client)
    events = EventActivities(aws, settings.events, ui_url=settings.temporal.ui_url)
    ops = WorkflowOps(client, settings.temporal.task_queue)
    aws_status = AwsStatusActivities(aws, settings.group)
    remediation = RemediationActivities(aws, settings.group, client)
    evidence = EvidenceActivities(aws, settings.group, client)
    fleet_breaker = FleetBreakerConfig(
        rule=settings.fleet_breaker.rule(), groups=[group.name for group in settings.groups]
    )
    breaker = BreakerOps(client, settings.temporal.task_queue, fleet_breaker)
    return Worker(
        client,
        task_queue=settings.temporal.task_queue,
        workflows=WORKFLOWS,
        workflow_runner=SANDBOX,
        activities=[
            *fleet.activities(),
            *events.activities(),
            *ops.activities(),
            *breaker.activities(),
            *remediation.activities(),
            *evidence.activities(),
            *aws_status.activities(),
        ],
    )


async def run_worker(settings: Settings, client: Client) -> None:
    """Run until cancelled; in-flight activities are given a chance to finish, workflows simply resume elsewhere."""
    # The webhook outbox is drained by this process while it runs (see activities/webhook.py).
    meter = (client.service_client.config.runtime or Runtime.default()).metric_meter
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(event_delivery(settings.events, meter))
        # What AWS says of each group's instances, told to their health workflows on change (worker/aws_watch.py).
        await stack.enter_async_context(aws_watch(settings, client))
        if settings.metrics_bind_address:
            groups = [group.name for group in settings.groups]
            await stack.enter_async_context(health_gauges(client, groups, meter, settings.health_gauge_interval))
        await build_worker(settings, client).run()
