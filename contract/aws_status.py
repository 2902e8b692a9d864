"""What AWS itself says of an instance, as the worker's per-group reader (worker/aws_watch.py) tells its health
workflow: EC2's status checks and scheduled events (DescribeInstanceStatus) and whether its ECS agent is connected
(DescribeContainerInstances `agentConnected`), and which of the group's ECS daemon services has no running, healthy
task on it (activities/daemon_tasks.py). The `aws_status` signal carries the whole picture of one instance and
is sent only when the picture changed, so a healthy fleet costs no Temporal action at all.
"""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, Field

from contract.groups import MAX_DAEMON_SERVICES, EcsServiceName
from contract.limits import Id, Name, Text, Timestamp

# DescribeInstanceStatus's words for a status check (SystemStatus, InstanceStatus).
EC2_OK: Final = "ok"
EC2_IMPAIRED: Final = "impaired"
EC2_INSUFFICIENT_DATA: Final = "insufficient-data"
# Scheduled events that take the instance away (retired, stopped) or interrupt it (rebooted, maintained): it is
# replaced, start-before-stop, before the event's NotBefore. AWS lists exactly these five codes.
REPAIRED_EVENT_CODES: Final = frozenset(
    {"instance-retirement", "instance-stop", "system-maintenance", "system-reboot", "instance-reboot"}
)
MAX_EVENTS: Final = 10


class Ec2StatusCheck(BaseModel):
    """One of the instance's two EC2 status checks (system: AWS's hardware and network; instance: its OS)."""

    status: Name = EC2_OK  # EC2's word: ok, impaired, insufficient-data, initializing, not-applicable
    # The names of the check's details that did not pass (e.g. "reachability"), for the status reason.
    failed: list[Name] = Field(default_factory=list, max_length=8)
    # EC2's ImpairedSince of the earliest failed detail, when it gives one.
    impaired_since: Timestamp | None = None


class ScheduledEvent(BaseModel):
    """A pending EC2 scheduled event (its description does not start with [Completed] or [Canceled])."""

    code: Name
    event_id: Name = ""
    not_before: Timestamp
    not_after: Timestamp | None = None
    description: Text = ""

    @property
    def key(self) -> str:
        """One event, however often it is told: AWS's id, or its code and time when it gives none."""
        return self.event_id or f"{self.code}@{self.not_before.isoformat()}"


class AwsInstanceStatus(BaseModel):
    """The `aws_status` signal: the whole of what AWS says of one instance, when it changed."""

    instance_id: Id
    group: Id
    # When the reader (or a confirming activity) read it, by its clock: an older picture than the last one a
    # health workflow applied is dropped (two workers' readers may tell the same change in either order).
    observed_at: Timestamp
    system: Ec2StatusCheck = Field(default_factory=Ec2StatusCheck)
    instance: Ec2StatusCheck = Field(default_factory=Ec2StatusCheck)
    events: list[ScheduledEvent] = Field(default_factory=list, max_length=MAX_EVENTS)
    # None: the instance has no container instance in the group's cluster (nothing to say about its agent).
    agent_connected: bool | None = True
    # When the reader first saw it disconnected (ECS gives no time); None when connected or not known.
    agent_disconnected_since: Timestamp | None = None
    # The group's daemon_services with no RUNNING task on the instance, or an UNHEALTHY one; empty when all are there,
    # and for an instance not judged (not ACTIVE for daemon_task_grace yet, no daemon_services, from older readers).
    daemon_tasks_missing: list[EcsServiceName] = Field(default_factory=list, max_length=MAX_DAEMON_SERVICES)

    def same_as(self, other: AwsInstanceStatus | None) -> bool:
        """Whether `other` says the same (when each was read aside)."""
        if other is None:
            return False
        return self.model_dump(exclude={"observed_at"}) == other.model_dump(exclude={"observed_at"})

    def healthy(self) -> bool:
        """What a health workflow assumes of an instance it was never told about: nothing to say."""
        return (
            self.system.status == EC2_OK
            and self.instance.status == EC2_OK
            and not self.events
            and self.agent_connected is not False
            and not self.daemon_tasks_missing
        )
