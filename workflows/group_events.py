"""Publishing events from workflows: off the critical path, never a failure of the step that publishes."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception

from contract.event_types import EventDetail

with workflow.unsafe.imports_passed_through():
    from activities.events import EventActivities
    from activities.models import FleetEvent, RepairNews

# publish_event tries each sink once for a second or two and keeps what a sink refuses on the worker's disk, so it
# fails only when the worker cannot keep the event (a broken disk) or dies. A few quick attempts, then the event is
# given up on with a log line: a sink must never hold up a health change or a repair step for long.
PUBLISH_TIMEOUT = timedelta(seconds=10)
PUBLISH_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=5), maximum_attempts=3
)


async def publish_group_event(group: str, workflow_id: str, detail: EventDetail) -> None:
    event = FleetEvent.of(
        detail,
        event_id=str(workflow.uuid4()),
        time=workflow.now(),
        group=group,
        instance_id="",
        workflow_id=workflow_id,
    )
    await publish(event, f"event {detail.TYPE.value}")


async def publish(event: FleetEvent, summary: str) -> None:
    """The change is in effect and recorded in this history already: a lost event is logged, never a failure."""
    activity = workflow.start_activity_method(
        EventActivities.publish_event,
        event,
        summary=summary,
        start_to_close_timeout=PUBLISH_TIMEOUT,
        retry_policy=PUBLISH_RETRY,
    )
    await _never_failing(activity, f"{event.type.value} for {event.instance_id or event.group}")


async def publish_news(news: RepairNews, summary: str) -> None:
    """A repair's batch of news (workflows/repair_context.py): lost, it is logged, never a failure of the repair."""
    activity = workflow.start_activity_method(
        EventActivities.publish_news,
        news,
        summary=summary,
        # Its events go one after another, each as long as publish_event may take.
        start_to_close_timeout=PUBLISH_TIMEOUT * max(1, len(news.events)),
        retry_policy=PUBLISH_RETRY,
    )
    await _never_failing(activity, f"news of {news.health_workflow_id} ({summary})")


async def _never_failing(activity: workflow.ActivityHandle[None], what: str) -> None:
    try:
        await activity
    except ActivityError as err:
        if is_cancelled_exception(err):
            # Cancelled with its workflow: swallowing this would swallow the workflow's cancellation (sdk-python#620).
            raise asyncio.CancelledError from err
        workflow.logger.warning("%s not published: %s", what, activity_cause(err))


def activity_cause(err: ActivityError) -> str:
    cause = err.cause
    return cause.message if isinstance(cause, ApplicationError) else str(cause or err)
