"""Which EC2 instance an ECS task runs on: a probe running as an ECS task proves its task (a task role's session
name is the task id, ingest/identity.py), and the ingest resolves it, with ecs:DescribeTasks in the configured
groups' clusters, to the task's container instance and that to its EC2 instance (ecs:DescribeContainerInstances).

Only a live task counts (PENDING, ACTIVATING or RUNNING); a stopped one, a Fargate one (no container instance) or
one in no configured cluster resolves to nothing (the ingest says 403). Answers, an instance or nothing, are believed
for `ingest.membership_ttl`; an AWS error is no answer (TaskLookupUnavailable, the ingest says 503) and is not
remembered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from botocore.exceptions import BotoCoreError, ClientError
from cachetools import TTLCache

if TYPE_CHECKING:
    from mypy_boto3_ecs import ECSClient

log = logging.getLogger(__name__)

MAX_CACHED_TASKS = 100_000
# Every configured cluster is asked in turn for a task it does not know: at most this many per resolution.
MAX_TASK_CLUSTERS = 16
_LIVE = frozenset({"PENDING", "ACTIVATING", "RUNNING"})


class TaskLookupUnavailable(Exception):
    """ECS could not be asked just now (throttled, unreachable): neither an instance nor nothing."""


def _same_cluster(cluster_arn: str, cluster: str) -> bool:
    """Whether `cluster_arn` (arn:...:cluster/NAME) is the configured `cluster` (a name or an ARN)."""
    return cluster_arn == cluster or cluster_arn.rpartition(":cluster/")[2] == cluster


class AwsTaskLookup:
    """The blocking ECS questions; run in a thread by TaskHosts."""

    def __init__(self, ecs: ECSClient) -> None:
        self.ecs = ecs

    def instance_of(self, cluster: str, task_id: str) -> str | None:
        """The EC2 instance the live task `task_id` of `cluster` runs on; None when the cluster has no such task,
        it is not live, or it has no container instance (Fargate)."""
        try:
            described = self.ecs.describe_tasks(cluster=cluster, tasks=[task_id])
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") == "ClusterNotFoundException":
                return None
            raise
        for task in described.get("tasks", []):
            # The id and cluster are checked again here: moto matches ids loosely and ignores the cluster.
            if task.get("taskArn", "").rpartition("/")[2] != task_id:
                continue
            if not _same_cluster(task.get("clusterArn", ""), cluster) or task.get("lastStatus") not in _LIVE:
                continue
            container_instance = task.get("containerInstanceArn")
            if not container_instance:
                return None
            instances = self.ecs.describe_container_instances(cluster=cluster, containerInstances=[container_instance])
            for ci in instances.get("containerInstances", []):
                if ci.get("containerInstanceArn") == container_instance and ci.get("ec2InstanceId"):
                    return ci["ec2InstanceId"]
        return None


class TaskHosts:
    """ECS task id -> the EC2 instance it runs on, searched in `clusters` (the first MAX_TASK_CLUSTERS distinct
    ones, in order), cached for `ttl_s` (at most `max_entries` answers, the least recently used forgotten first)."""

    def __init__(
        self,
        clusters: Sequence[str],
        lookup: AwsTaskLookup,
        ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = MAX_CACHED_TASKS,
    ) -> None:
        distinct = list(dict.fromkeys(clusters))
        if len(distinct) > MAX_TASK_CLUSTERS:
            log.warning(
                "%d ECS clusters configured: ECS tasks are resolved in the first %d only (%s)",
                len(distinct),
                MAX_TASK_CLUSTERS,
                ", ".join(distinct[:MAX_TASK_CLUSTERS]),
            )
        self.clusters = tuple(distinct[:MAX_TASK_CLUSTERS])
        self._lookup = lookup
        self._cache: TTLCache[str, str | None] = TTLCache(max_entries, ttl_s, timer=clock)
        self.lookups = 0  # AWS resolutions made (cache misses), for the tests and the log

    async def instance_of(self, task_id: str) -> str | None:
        """The EC2 instance the live task runs on, or None when no configured cluster runs it."""
        if task_id in self._cache:  # "runs nowhere" (None) is an answer too
            return self._cache[task_id]
        answer = self._cache[task_id] = await self._ask(task_id)
        return answer

    async def _ask(self, task_id: str) -> str | None:
        self.lookups += 1
        try:
            for cluster in self.clusters:
                instance = await asyncio.to_thread(self._lookup.instance_of, cluster, task_id)
                if instance is not None:
                    return instance
        except (ClientError, BotoCoreError) as err:
            log.warning("ECS task %s not resolvable: %s", task_id, err)
            raise TaskLookupUnavailable(f"ECS task not resolvable just now: {type(err).__name__}") from err
        return None
