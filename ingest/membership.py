"""Whether an instance belongs to the capacity group it names: its EC2 tag (contract.names.GROUP_TAG) says so, or it
is registered in that group's ECS cluster. Answers, yes and no, are believed for `ingest.membership_ttl`, then given
for up to that long again while they are asked anew in the background, many instances to an EC2 call
(ingest/tag_reads.py); an AWS error is no answer (MembershipUnknown, the ingest says 503) and is not remembered. A
group the settings do not have is no member of anything, and said so (`group_known`): the probe's --group is
wrong."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from cachetools import TTLCache

from contract import names
from contract.aws_session import new_session
from contract.config import AwsSettings
from contract.groups import CapacityGroup
from ingest.tag_reads import TagReads

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ecs import ECSClient

log = logging.getLogger(__name__)

MAX_CACHED_ANSWERS = 100_000
# ECS: describe_container_instances takes at most 100 at a time.
_ECS_DESCRIBE_BATCH = 100
_REGISTERED = ("ACTIVE", "DRAINING")
_NOT_FOUND_CODES = frozenset({"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"})


class MembershipUnknown(Exception):
    """AWS could not be asked just now (throttled, unreachable): neither yes nor no."""


# Group names an unknown-group refusal lists, at most: enough to spot the typo, short enough for one log line.
LISTED_GROUPS = 10


@dataclass(frozen=True, slots=True)
class Membership:
    member: bool
    how: str  # "tag", "ecs", or why not
    # False when the group is not in the settings at all: the probe's --group is wrong (or the settings are), which
    # no membership answer would change.
    group_known: bool = True


class AwsMembershipLookup:
    """The two blocking boto3 questions; run in a thread by GroupMembership."""

    def __init__(self, settings: AwsSettings) -> None:
        session = new_session(settings.region)
        config = Config(
            region_name=settings.region,
            retries={"mode": "standard", "max_attempts": settings.max_attempts},
            max_pool_connections=50,
        )
        self.ec2: EC2Client = session.client("ec2", endpoint_url=settings.endpoint_url, config=config)
        self.ecs: ECSClient = session.client("ecs", endpoint_url=settings.endpoint_url, config=config)

    def group_tags(self, instance_ids: Sequence[str]) -> dict[str, str | None]:
        """Each instance's GROUP_TAG value, in one call; None when it has none or EC2 does not know it. EC2 refuses the
        whole call when one id is unknown or malformed: then each is asked alone."""
        try:
            pages = self.ec2.describe_instances(InstanceIds=list(instance_ids))
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") not in _NOT_FOUND_CODES:
                raise
            if len(instance_ids) == 1:
                return {instance_ids[0]: None}
            tags: dict[str, str | None] = {}
            for instance_id in instance_ids:
                tags.update(self.group_tags([instance_id]))
            return tags
        found: dict[str, str | None] = dict.fromkeys(instance_ids)
        for reservation in pages.get("Reservations", []):
            for instance in reservation.get("Instances", []):
                if instance.get("InstanceId") in found:
                    labels = instance.get("Tags", [])
                    found[instance["InstanceId"]] = next(
                        (t.get("Value") for t in labels if t.get("Key") == names.GROUP_TAG), None
                    )
        return found

    def in_cluster(self, cluster: str, instance_id: str) -> bool:
        """Registered (ACTIVE or DRAINING) in the ECS cluster. Real ECS narrows the list with the cluster query;
        moto ignores `filter` and lists the whole cluster, so ec2InstanceId is matched here as well."""
        arns: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"cluster": cluster, "filter": f"ec2InstanceId == {instance_id}"}
            if token:
                kwargs["nextToken"] = token
            try:
                page = self.ecs.list_container_instances(**kwargs)
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") == "ClusterNotFoundException":
                    return False
                raise
            arns += page.get("containerInstanceArns", [])
            token = page.get("nextToken")
            if not token:
                break
        for start in range(0, len(arns), _ECS_DESCRIBE_BATCH):
            chunk: Sequence[str] = arns[start : start + _ECS_DESCRIBE_BATCH]
            described = self.ecs.describe_container_instances(cluster=cluster, containerInstances=list(chunk))
            for ci in described.get("containerInstances", []):
                if ci.get("ec2InstanceId") == instance_id and ci.get("status") in _REGISTERED:
                    return True
        return False


class GroupMembership:
    """An answer is fresh for ttl_s. Past that it is still given, for up to another ttl_s, while it is asked again in
    the background with other instances' in one EC2 call (ingest/tag_reads.py); older, or never asked, a report
    waits for its answer."""

    def __init__(
        self,
        groups: Sequence[CapacityGroup],
        lookup: AwsMembershipLookup,
        ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = MAX_CACHED_ANSWERS,
        tag_reads: TagReads | None = None,
    ) -> None:
        self._groups = {group.name: group for group in groups}
        self._lookup = lookup
        self._ttl_s = ttl_s
        self._clock = clock
        self._tags = tag_reads or TagReads(lookup.group_tags, clock=clock)
        # (answer, when it was asked); the least recently used forgotten first when full.
        self._cache: TTLCache[tuple[str, str], tuple[Membership, float]] = TTLCache(max_entries, 2 * ttl_s, timer=clock)
        self._refreshing: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.lookups = 0  # AWS lookups made (cache misses and refreshes), for the tests and the log

    @property
    def refreshing(self) -> int:
        """Answers being asked again in the background just now."""
        return len(self._refreshing)

    async def check(self, instance_id: str, group: str) -> Membership:
        if group not in self._groups:
            return Membership(False, self.unknown_group(group), group_known=False)
        key = (instance_id, group)
        cached = self._cache.get(key)
        if cached is not None:
            answer, asked_at = cached
            if self._clock() - asked_at >= self._ttl_s and key not in self._refreshing:
                self._refreshing[key] = asyncio.create_task(self._refresh(key))
            return answer
        asked_at = self._clock()
        answer = await self._ask(instance_id, self._groups[group], urgent=True)
        self._cache[key] = (answer, asked_at)
        return answer

    async def close(self) -> None:
        for task in list(self._refreshing.values()):
            task.cancel()
        await self._tags.close()

    async def _refresh(self, key: tuple[str, str]) -> None:
        try:
            asked_at = self._clock()
            answer = await self._ask(key[0], self._groups[key[1]], urgent=False)
            self._cache[key] = (answer, asked_at)
        except Exception as err:  # the answer stands until it is too old to give; a later report asks again
            if not isinstance(err, MembershipUnknown):
                log.exception("refreshing the membership of %s in %s failed", *key)
        finally:
            self._refreshing.pop(key, None)

    def unknown_group(self, group: str) -> str:
        names = sorted(self._groups)
        listed = ", ".join(names[:LISTED_GROUPS])
        if len(names) > LISTED_GROUPS:
            listed += f" and {len(names) - LISTED_GROUPS} more"
        return (
            f"unknown group {group!r}: not in settings (this ingest's groups: {listed or 'none'}); start the probe "
            "with --group naming one of them, or add the group to the settings and restart the ingest"
        )

    async def _ask(self, instance_id: str, group: CapacityGroup, *, urgent: bool) -> Membership:
        self.lookups += 1
        try:
            tag = await self._tags.tag(instance_id, urgent=urgent)
            if tag == group.name:
                return Membership(True, "tag")
            if await asyncio.to_thread(self._lookup.in_cluster, group.cluster, instance_id):
                return Membership(True, "ecs")
        except (ClientError, BotoCoreError) as err:
            log.warning("membership of %s in %s not checkable: %s", instance_id, group.name, err)
            raise MembershipUnknown(f"membership not checkable just now: {type(err).__name__}") from err
        found = f"tagged {names.GROUP_TAG}={tag}" if tag else f"no {names.GROUP_TAG} tag"
        return Membership(
            False, f"{instance_id} is not in group {group.name} ({found}, not in ECS cluster {group.cluster})"
        )
