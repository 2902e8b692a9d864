"""What AWS itself says of a group's instances: EC2 status checks and scheduled events, and the ECS agent's connection.

Read by the worker's per-group reader (worker/aws_watch.py), which signals a health workflow only when what it sees
changed, and by one activity a health workflow runs to confirm an impairment before acting on it. Only instances
running in EC2 and registered (ACTIVE or DRAINING) in the group's ECS cluster are read: one that left on purpose is
the liveness tracker's business (activities/departures.py).

The calls, per group and read: ListContainerInstances and DescribeContainerInstances (100 at a time), then
DescribeInstanceStatus with IncludeAllInstances for those instances (100 ids at a time); with `daemon_services`, the
daemon tasks' few calls (activities/daemon_tasks.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.aws import AwsClients
from activities.daemon_tasks import DaemonTaskReads, Registration
from activities.ec2 import Ec2, chunks
from activities.ecs import Ecs
from activities.models import AwsStatusRequest
from contract.aws_status import (
    EC2_IMPAIRED,
    EC2_INSUFFICIENT_DATA,
    EC2_OK,
    MAX_EVENTS,
    REPAIRED_EVENT_CODES,
    AwsInstanceStatus,
    Ec2StatusCheck,
    ScheduledEvent,
)
from contract.groups import CapacityGroup

if TYPE_CHECKING:
    from mypy_boto3_ec2.type_defs import InstanceStatusSummaryTypeDef, InstanceStatusTypeDef

# API batch limit: DescribeInstanceStatus takes 100 explicit InstanceIds.
EC2_STATUS_BATCH = 100
# An event AWS has finished with stays listed a while, its description prefixed so.
DONE_EVENT_PREFIXES = ("[Completed]", "[Canceled]", "[Cancelled]")
# DescribeInstanceStatus fails a whole batch for one id EC2 does not know; it names the ids in its message.
NOT_FOUND = "InvalidInstanceID.NotFound"
INSTANCE_ID = re.compile(r"\bi-[0-9a-f]{8,17}\b")


class AwsStatusReads:
    """The reads, shared by the reader and the activity."""

    def __init__(self, aws: AwsClients) -> None:
        self._aws = aws
        self._ec2 = Ec2(aws)
        self._ecs = Ecs(aws)
        self._daemons = DaemonTaskReads(aws)

    async def members(self, group: CapacityGroup, instance_ids: Sequence[str]) -> set[str]:
        """Which of these instances of the group's cluster are the group's (by tag or Auto Scaling membership): a
        cluster may hold another group's."""
        return await self._ec2.members(group, instance_ids)

    async def read(
        self, group: CapacityGroup, instance_id: str | None = None, now: datetime | None = None
    ) -> dict[str, AwsInstanceStatus]:
        """Every registered, running instance of the group (or only `instance_id`), as AWS describes it now."""
        observed_at = now or datetime.now(UTC)
        registered = await self.registrations(group.cluster, instance_id)
        statuses = await self.ec2_statuses(sorted(registered))
        running = {iid: registered[iid] for iid in statuses}
        missing = await self._daemons.missing(group, running, observed_at, instance_id)
        return {
            iid: AwsInstanceStatus(
                instance_id=iid,
                group=group.name,
                observed_at=observed_at,
                system=status.system,
                instance=status.instance,
                events=status.events,
                agent_connected=registered[iid].agent_connected,
                daemon_tasks_missing=missing.get(iid, []),
            )
            for iid, status in statuses.items()
        }

    async def registrations(self, cluster: str, instance_id: str | None = None) -> dict[str, Registration]:
        """EC2 instance id -> its container instance in the cluster, ACTIVE or DRAINING (the newest registration,
        for one registered twice)."""
        return {
            iid: Registration(
                arn=ci.get("containerInstanceArn", ""),
                status=ci.get("status", ""),
                registered_at=ci.get("registeredAt"),
                agent_connected=bool(ci.get("agentConnected", False)),
            )
            for iid, ci in (await self._ecs.registrations(cluster, instance_id)).items()
        }

    async def ec2_statuses(self, instance_ids: Sequence[str]) -> dict[str, _Ec2View]:
        """The running ones among `instance_ids`: their two status checks and pending scheduled events."""
        found: dict[str, _Ec2View] = {}
        for chunk in chunks(list(instance_ids), EC2_STATUS_BATCH):
            for status in await self._describe_status(chunk):
                if status.get("InstanceState", {}).get("Name") == "running" and "InstanceId" in status:
                    found[status["InstanceId"]] = _Ec2View(status)
        return found

    async def _describe_status(self, ids: list[str]) -> list[InstanceStatusTypeDef]:
        try:
            return await self._describe_batch(ids)
        except ApplicationError as err:
            # Once more without the ids EC2 says it does not know (terminated long ago, gone from EC2's view).
            # The ids in AWS's own message, after the code (the resource before it names known ones too).
            said = err.message.split(f"{NOT_FOUND}:", 1)[-1]
            unknown = set(INSTANCE_ID.findall(said)) if err.type == NOT_FOUND else set()
            if not unknown:
                raise
            rest = [i for i in ids if i not in unknown]
            return await self._describe_batch(rest) if rest else []

    async def _describe_batch(self, ids: list[str]) -> list[InstanceStatusTypeDef]:
        # Explicit ids are never paged (EC2 refuses MaxResults with InstanceIds).
        page = await self._aws.call(
            f"EC2 instances {', '.join(ids[:3])}{'...' if len(ids) > 3 else ''}",
            self._aws.ec2.describe_instance_status,
            InstanceIds=ids,
            IncludeAllInstances=True,
        )
        return list(page.get("InstanceStatuses", []))


class _Ec2View:
    """One DescribeInstanceStatus entry, in the signal's terms."""

    def __init__(self, status: InstanceStatusTypeDef) -> None:
        self.system = status_check(status.get("SystemStatus"))
        self.instance = status_check(status.get("InstanceStatus"))
        self.events = pending_events(status.get("Events", []))


def status_check(summary: InstanceStatusSummaryTypeDef | None) -> Ec2StatusCheck:
    """impaired and insufficient-data as EC2 says them; anything else (ok, initializing, not-applicable) is ok:
    nothing to say, so a launch or a stop sends no signal."""
    if summary is None:
        return Ec2StatusCheck()
    raw = summary.get("Status", EC2_OK)
    status = raw if raw in (EC2_IMPAIRED, EC2_INSUFFICIENT_DATA) else EC2_OK
    if status == EC2_OK:
        return Ec2StatusCheck()
    details = [d for d in summary.get("Details", []) if d.get("Status") != "passed"]
    since = [d["ImpairedSince"] for d in details if d.get("ImpairedSince")]
    return Ec2StatusCheck(
        status=status,
        failed=sorted({d.get("Name", "") for d in details if d.get("Name")})[:8],
        impaired_since=min(since) if since and status == EC2_IMPAIRED else None,
    )


def pending_events(events: Sequence[Any]) -> list[ScheduledEvent]:
    """The events that take the instance away, not yet done, earliest first."""
    pending = [
        ScheduledEvent(
            code=event["Code"],
            event_id=event.get("InstanceEventId", ""),
            not_before=event["NotBefore"],
            not_after=event.get("NotAfter"),
            description=event.get("Description", ""),
        )
        for event in events
        if event.get("Code") in REPAIRED_EVENT_CODES
        and event.get("NotBefore") is not None
        and not str(event.get("Description", "")).startswith(DONE_EVENT_PREFIXES)
    ]
    return sorted(pending, key=lambda e: (e.not_before, e.key))[:MAX_EVENTS]


class AwsStatusActivities:
    """The confirming read a health workflow runs before an AWS-told impairment takes effect."""

    def __init__(self, aws: AwsClients, groups: Callable[[str], CapacityGroup]) -> None:
        self._reads = AwsStatusReads(aws)
        self._groups = groups

    def activities(self) -> list[Callable[..., Any]]:
        """The bound activity methods, for `Worker(activities=...)`."""
        return [self.read_aws_status]

    @activity.defn(name="read_aws_status")
    async def read_aws_status(self, request: AwsStatusRequest) -> AwsInstanceStatus:
        """What AWS says of the instance now; not running or not registered: nothing to say (healthy)."""
        try:
            group = self._groups(request.group)
        except KeyError as err:
            raise ApplicationError(str(err), type="UnknownCapacityGroup", non_retryable=True) from err
        now = datetime.now(UTC)
        found = await self._reads.read(group, request.instance_id, now)
        return found.get(request.instance_id) or AwsInstanceStatus(
            instance_id=request.instance_id, group=group.name, observed_at=now, agent_connected=None
        )
