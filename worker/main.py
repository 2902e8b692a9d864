"""The worker process: every workflow and activity of gpu-autorepair on one task queue."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import structlog
from temporalio.client import Client
from temporalio.runtime import Runtime
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities.aws import AwsClients
from activities.aws_status import AwsStatusActivities
from activities.breaker_ops import BreakerOps
from activities.events import EventActivities
from activities.evidence import EvidenceActivities
from activities.fleet import FleetActivities
from activities.remediation import RemediationActivities
from activities.workflow_ops import WorkflowOps
from contract.breaker import FleetBreakerConfig
from worker.aws_watch import aws_watch
from worker.health_endpoint import worker_health
from worker.health_gauges import health_gauges
from worker.settings import Settings
from workflows.drain_semaphore import DrainSemaphoreWorkflow
from workflows.event_outbox import EventOutboxWorkflow
from workflows.fleet_breaker import FleetBreakerWorkflow
from workflows.health import InstanceHealthWorkflow
from workflows.liveness import LivenessTrackerWorkflow
from workflows.options import HEARTBEAT_TIMEOUT_MAX
from workflows.repair import InstanceRepairWorkflow

log = structlog.get_logger(__name__)

WORKFLOWS = [
    InstanceHealthWorkflow,
    InstanceRepairWorkflow,
    DrainSemaphoreWorkflow,
    LivenessTrackerWorkflow,
    FleetBreakerWorkflow,
    EventOutboxWorkflow,
]

# The contract and the models are shared with activities and clients: passing them through keeps one class per
# model (and per enum, so `is` comparisons hold), so a model built in a workflow is an instance of the class an
# activity's input expects (and the sandbox loads less).
# structlog and rich format the replay-aware workflow logger's records; they import lazily, which the sandbox blocks.
# The plain models (workflows/ modules with no Temporal in them, and the signal decoding they raise Rejected from) are
# passed through too: the sandbox imports every module it does not pass through again for each workflow run, and
# those imports were about a tenth of a test worker's CPU (py-spy of `make test`), paid by every health workflow a
# fleet starts or continues as new. They take the time from their callers (`now`) and keep no module state, so the
# sandbox has nothing to guard in them. Everything they import is passed through as well: a class loaded both
# inside and outside the sandbox would be two classes.
PLAIN_MODELS = (
    "workflows.breaker",
    "workflows.fix_gate",
    "workflows.health_aws_rules",
    "workflows.health_checks",
    "workflows.health_daemon_rules",
    "workflows.health_ladder",
    "workflows.health_services",
    "workflows.holder_watch",
    "workflows.instance_health",
    "workflows.liveness_book",
    "workflows.model_log",
    "workflows.models",
    "workflows.outbox_book",
    "workflows.repair_ladder",
    "workflows.repair_record",
    "workflows.repair_runbook",
    "workflows.semaphore_state",
    "workflows.side_tasks",
    "workflows.signal_input",
)
SANDBOX = SandboxedWorkflowRunner(
    restrictions=SandboxRestrictions.default.with_passthrough_modules(
        "contract",
        *PLAIN_MODELS,
        "activities",
        "pydantic",
        "structlog",
        "rich",
    )
)


def worker_aws(settings: Settings) -> AwsClients:
    """The activities' AWS clients, with threads for as many calls as the worker runs activities ([worker])."""
    return AwsClients(settings.aws, threads=settings.worker.aws_threads)


def build_worker(settings: Settings, client: Client, aws: AwsClients | None = None) -> Worker:
    """The Temporal worker. `aws`: the activities' AWS clients, which the caller shuts down after the worker
    (run_worker does); unset, clients of the worker's own whose threads end when they are garbage-collected."""
    aws = aws or worker_aws(settings)
    tuning = settings.worker
    fleet = FleetActivities(aws, settings.group, client=client)
    events = EventActivities(
        aws, settings.events, client, settings.temporal.task_queue, ui_url=settings.temporal.ui_url
    )
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
        # On shutdown the worker stops polling at once and gives in-flight activities this long to finish (the SDK's
        # default is none: a rolling update would cancel every AWS call in flight).
        graceful_shutdown_timeout=settings.graceful_shutdown_timeout,
        max_heartbeat_throttle_interval=HEARTBEAT_TIMEOUT_MAX,
        # [worker] (worker/tuning.py): the SDK's own defaults unless set.
        max_concurrent_workflow_tasks=tuning.max_concurrent_workflow_tasks,
        max_concurrent_activities=tuning.max_concurrent_activities,
        workflow_task_poller_behavior=PollerBehaviorSimpleMaximum(tuning.workflow_task_pollers),
        activity_task_poller_behavior=PollerBehaviorSimpleMaximum(tuning.activity_task_pollers),
        max_cached_workflows=tuning.max_cached_workflows,
        sticky_queue_schedule_to_start_timeout=tuning.sticky_queue_schedule_to_start_timeout,
    )


async def run_worker(settings: Settings, client: Client, stop: asyncio.Event | None = None) -> None:
    """Run until `stop` is set (SIGTERM or SIGINT, worker/commands.py) or the task is cancelled: then stop polling,
    give in-flight activities `graceful_shutdown_timeout` to finish, and return. Workflows carry on on the other
    workers; an activity cut short is retried there."""
    meter = (client.service_client.config.runtime or Runtime.default()).metric_meter
    async with AsyncExitStack() as stack:
        # One pool of AWS threads for the activities and the AWS watch; entered first, so closed last, once the
        # worker (below) and the watch have stopped calling.
        aws = await stack.enter_async_context(worker_aws(settings))
        # What AWS says of each group's instances, told to their health workflows on change (worker/aws_watch.py).
        await stack.enter_async_context(aws_watch(settings, client, aws))
        # GET /healthz (worker/health_endpoint.py): 503 once Temporal is out of reach, or once shutdown began.
        health = await stack.enter_async_context(worker_health(settings, client))
        if settings.metrics_bind_address:
            groups = [group.name for group in settings.groups]
            await stack.enter_async_context(
                health_gauges(client, groups, meter, settings.health_gauge_interval, settings.repair_running_long)
            )
        worker = build_worker(settings, client, aws)
        running = asyncio.create_task(worker.run(), name="temporal worker")
        stopped = asyncio.create_task((stop or asyncio.Event()).wait(), name="wait for a stop signal")
        try:
            await asyncio.wait({running, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not running.done():
                health.begin_shutdown()
                log.info("worker shutting down", graceful_shutdown_timeout=str(settings.graceful_shutdown_timeout))
                await worker.shutdown()
            await running
