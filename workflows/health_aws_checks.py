"""What AWS says of the instance, for its health workflow: EC2 status checks, EC2 scheduled events, the ECS agent.

The worker's per-group reader (worker/aws_watch.py) signals `aws_status` only when its picture of the instance
changed; the signal handler keeps the picture and the run loop (workflows/health.py) decides here, on its named wake
timer, so that a healthy instance costs nothing. The rules are a plain model in workflows/health_aws_rules.py; here
are the signal and the run loop's step, with the activity that confirms with AWS.

Runbook:
  1. An EC2 status check (system or instance) `impaired` for the group's status_check_grace makes EC2_STATUS
     IMPAIRED; the repair replaces the instance (its reason names EC2, never a GPU finding, so no reboot-first
     ladder applies). `insufficient-data` is INSUFFICIENT_DATA, never IMPAIRED.
  2. A pending scheduled event (retirement, stop, reboot, maintenance) is published once as ScheduledEventFound,
     and scheduled_event_lead before its NotBefore makes EC2_STATUS IMPAIRED, so that the instance is replaced
     start-before-stop before AWS takes it. Such a repair is critical (maintenance windows do not hold it) and is
     never counted by the breaker: AWS planned it, it says nothing of the fleet's health.
  3. The ECS agent disconnected (DescribeContainerInstances `agentConnected` false) for agent_disconnect_grace makes
     AGENT_CONNECTIVITY IMPAIRED with a reason of its own (`ECS agent disconnected since ...`), apart from the
     probe's heartbeat loss (`Agent disconnected since ...`, the liveness tracker's). A probe's loss takes the check
     over; the probe heard again while AWS still says the agent is disconnected gives it back to the agent, as it was.
  4. Each grace runs from when the check went bad: new or alternating reasons while it stays bad never restart it
     (Karpenter #2833); only `ok` ends it. A blip shorter than the grace changes nothing, not even an event.
  5. Before an impairment takes effect, AWS is read once more (an activity): a picture a reader told before it died
     is never acted on once AWS says otherwise.
  6. An impairment made here that someone else set OK (an operator's clear, a discarded held repair, a fix in place)
     is proven afresh: a full grace from then; a scheduled event cleared so is not repaired for again.
  7. A fix in place (the remediation ladder's reboot or GPU reset) ends every bad period that began before it: a
     status check or an agent the reboot itself took down must stay bad a full grace after the fix to count. A
     scheduled event is not fixed by a reboot: its instance is still replaced.
  8. A group's ECS daemon service (`daemon_services`) with no RUNNING, or an UNHEALTHY, task on the instance for
     daemon_task_grace puts it on DAEMON's down list (`ECS_DAEMON_<service>`), as a systemd unit the probe reports
     down does; its task back takes it off (workflows/health_daemon_rules.py). Steps 4 to 7 apply to it alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError

from contract.aws_status import AwsInstanceStatus
from contract.groups import CapacityGroup
from workflows import health_aws_rules as rules
from workflows import health_daemon_rules as daemon_rules
from workflows.instance_health import InstanceHealth
from workflows.options import CALL_TIMEOUT
from workflows.signal_input import Rejected, decode

with workflow.unsafe.imports_passed_through():
    from activities.aws_status import AwsStatusActivities
    from activities.models import AwsStatusRequest

# A confirming read that AWS does not answer is not waited on for long: the reader's picture decides then.
CONFIRM_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), maximum_attempts=3)


def on_signal(health: InstanceHealth, name: str, payloads: Sequence[RawValue]) -> None:
    """The signal keeps the picture (state only); the run loop decides on it."""
    report = decode(name, payloads, AwsInstanceStatus)
    if isinstance(report, Rejected):
        health.reject(report)
    elif report.instance_id != health.instance_id or report.group != health.group:
        health.reject(Rejected(f"aws_status of {report.instance_id} in {report.group} sent to {health.instance_id}"))
    else:
        rules.apply(health.state.aws, report)


async def advance(health: InstanceHealth, group: CapacityGroup) -> None:
    """Decide what the pictures mean now: impair (once AWS confirms it), clear, or wait for a grace to end."""
    state, aws = health.state, health.state.aws
    rules.settle(state, workflow.now())
    if rules.decide(state, group, workflow.now(), _daemons(health)).impairs_anew(state):
        await _confirm(health)
    before = health.status_key()
    decision = rules.decide(state, group, workflow.now(), _daemons(health))
    rules.apply_decision(state, decision, workflow.now())
    aws.next_at, aws.next_what = decision.next_at, decision.next_what
    for found in rules.events_to_tell(state, group):
        health.instance_event(found)
    health.publish_if_changed(before)


def _daemons(health: InstanceHealth) -> bool:
    """Whether ECS daemon tasks are decided: only once told of, so that the patch marker is asked only then."""
    return daemon_rules.relevant(health.state.aws) and workflow.patched(daemon_rules.ECS_DAEMON_TASKS)


async def _confirm(health: InstanceHealth) -> None:
    """Read AWS once more before impairing; unanswered, the last picture decides."""
    try:
        now = await workflow.execute_activity_method(
            AwsStatusActivities.read_aws_status,
            AwsStatusRequest(group=health.group, instance_id=health.instance_id),
            summary=f"confirm with AWS that {health.instance_id} is still impaired",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CONFIRM_RETRY,
        )
    except ActivityError as err:
        workflow.logger.warning("AWS not read for %s (%s): the last picture decides", health.instance_id, err.cause)
        return
    rules.apply(health.state.aws, now)
    health.state.aws.look = False
