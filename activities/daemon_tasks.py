"""ECS daemon tasks (ECS's DAEMON check for ECS fleets): which of a group's `daemon_services` has no RUNNING task on
a container instance, or an UNHEALTHY one there.

Read per group, never per instance, beside the rest of what AWS says (activities/aws_status.py): DescribeServices once
for the named services (10 names a call), then for each DAEMON service ListTasks(serviceName, desiredStatus=RUNNING)
and DescribeTasks, 100 at a time. One instance alone (the health workflow's confirming read) lists that instance's
RUNNING tasks instead. A named service that does not exist, is not ACTIVE or is not DAEMON-scheduled is logged, each
read, and judged on no instance: a typo in the settings must never impair a fleet.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from activities.aws import AwsClients
from activities.ecs import Ecs
from contract.groups import CapacityGroup

log = logging.getLogger(__name__)

DAEMON = "DAEMON"
RUNNING = "RUNNING"
UNHEALTHY = "UNHEALTHY"
# ECS names a service's tasks' group so: the filter real ECS applies by serviceName, checked again on each task.
SERVICE_GROUP_PREFIX = "service:"


@dataclass(frozen=True)
class Registration:
    """One EC2 instance's container instance in the group's cluster (the newest registration's)."""

    arn: str
    status: str  # ACTIVE or DRAINING
    registered_at: datetime | None
    agent_connected: bool


class DaemonTaskReads:
    def __init__(self, aws: AwsClients) -> None:
        self._aws = aws
        self._ecs = Ecs(aws)

    async def missing(
        self,
        group: CapacityGroup,
        registrations: Mapping[str, Registration],
        now: datetime,
        instance_id: str | None = None,
    ) -> dict[str, list[str]]:
        """EC2 instance id -> the group's daemon services with no RUNNING, not UNHEALTHY task on it, for each
        instance ACTIVE for longer than daemon_task_grace (a new one has no daemon tasks yet); `instance_id`: that
        one alone."""
        judged = {
            iid: reg.arn
            for iid, reg in registrations.items()
            if reg.status == "ACTIVE"
            and reg.registered_at is not None
            and now - reg.registered_at >= group.daemon_task_grace
            and instance_id in (None, iid)
        }
        if not group.daemon_services or not judged:
            return {}
        services = await self._daemon_services(group)
        if not services:
            return {}
        running = await self._running_here(group.cluster, judged[instance_id]) if instance_id else None
        found: dict[str, set[str]] = {}
        for service in services:
            tasks = running if running is not None else await self._service_tasks(group.cluster, service)
            found[service] = {t["containerInstanceArn"] for t in tasks if _serves(t, service)}
        return {iid: [s for s in services if arn not in found[s]] for iid, arn in judged.items()}

    async def _daemon_services(self, group: CapacityGroup) -> list[str]:
        """The named services that are ACTIVE and DAEMON-scheduled in the cluster, in the settings' order."""
        described = await self._aws.call(
            f"ECS cluster {group.cluster}",
            self._aws.ecs.describe_services,
            cluster=group.cluster,
            services=list(group.daemon_services),
        )
        usable, refused = judge_daemon_services(described)
        if refused:
            log.warning(
                "group %s: daemon_services %s in cluster %s: judged on no instance",
                group.name,
                "; ".join(sorted(refused)),
                group.cluster,
            )
        return [name for name in group.daemon_services if name in usable]

    async def _service_tasks(self, cluster: str, service: str) -> list[Any]:
        return await self._ecs.describe_tasks(
            cluster, await self._ecs.task_arns(cluster, serviceName=service, desiredStatus=RUNNING)
        )

    async def _running_here(self, cluster: str, container_instance: str) -> list[Any]:
        return await self._ecs.describe_tasks(
            cluster, await self._ecs.task_arns(cluster, containerInstance=container_instance, desiredStatus=RUNNING)
        )


def judge_daemon_services(described: Mapping[str, Any]) -> tuple[set[str], list[str]]:
    """DescribeServices' answer judged for daemon_services (here and by `autorepair doctor`): the names that are
    ACTIVE and DAEMON-scheduled, and why each other one is not."""
    usable, refused = set(), []
    for service in described.get("services", []):
        name = service.get("serviceName", "")
        if service.get("status") != "ACTIVE":
            refused.append(f"{name} is {service.get('status', 'not ACTIVE')}")
        elif service.get("schedulingStrategy") != DAEMON:
            refused.append(f"{name} is {service.get('schedulingStrategy', 'REPLICA')}-scheduled, not DAEMON")
        else:
            usable.add(name)
    for failure in described.get("failures", []):
        name = str(failure.get("arn", "")).rsplit("/", 1)[-1]
        refused.append(f"{name} not found ({failure.get('reason', 'no reason given')})")
    return usable, refused


def _serves(task: Any, service: str) -> bool:
    """A task of `service` that is RUNNING and not UNHEALTHY (UNKNOWN: no health check defined, or not yet run)."""
    return (
        task.get("group") == f"{SERVICE_GROUP_PREFIX}{service}"
        and task.get("lastStatus") == RUNNING
        and task.get("healthStatus") != UNHEALTHY
        and bool(task.get("containerInstanceArn"))
    )
