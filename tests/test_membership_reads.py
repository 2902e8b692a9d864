"""The ingest asks EC2 about many hosts in one call (ingest/tag_reads.py), and refreshes a membership answer in the
background while it still gives it (ingest/membership.py): a fleet's expiring answers cost a call a second, not one
per host."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import boto3
import pytest
from botocore.exceptions import ClientError

from contract import names
from contract.config import AwsSettings
from contract.groups import CapacityGroup
from ingest.membership import AwsMembershipLookup, GroupMembership, MembershipUnknown
from ingest.tag_reads import TagReads

GROUP = CapacityGroup(name="gpu-a", cluster="gpu-a", launch_template="lt-gpu")


class SlowTags:
    """EC2 as a dict of tags, answering after `delay` seconds; records each call's ids."""

    def __init__(self, tags: dict[str, str | None], delay: float = 0.05) -> None:
        self.tags = tags
        self.delay = delay
        self.calls: list[list[str]] = []
        self.fail: Exception | None = None
        self._lock = threading.Lock()

    def __call__(self, ids: Sequence[str]) -> dict[str, str | None]:
        with self._lock:
            self.calls.append(list(ids))
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return {i: self.tags.get(i) for i in ids}


async def test_reads_that_arrive_while_one_is_in_flight_go_out_together() -> None:
    ids = [f"i-{n:017x}" for n in range(50)]
    ec2 = SlowTags(dict.fromkeys(ids, "gpu-a"))
    reads = TagReads(ec2)
    first = asyncio.create_task(reads.tag(ids[0]))
    await asyncio.sleep(0.01)  # its call is in flight (50 ms)
    answers = await asyncio.gather(first, *(reads.tag(i) for i in ids[1:]))
    await reads.close()
    assert answers == ["gpu-a"] * 50
    # The first goes alone; the 49 that queued behind it share the next call.
    assert [len(call) for call in ec2.calls] == [1, 49]


async def test_a_call_carries_at_most_max_ids() -> None:
    ids = [f"i-{n:017x}" for n in range(11)]
    ec2 = SlowTags(dict.fromkeys(ids, "gpu-a"))
    reads = TagReads(ec2, max_ids=4)
    await asyncio.gather(*(reads.tag(i) for i in ids))
    await reads.close()
    assert [len(call) for call in ec2.calls] == [4, 4, 3]
    assert sorted(i for call in ec2.calls for i in call) == sorted(ids)


async def test_refreshes_nobody_waits_for_are_gathered_and_an_urgent_read_takes_them_along() -> None:
    ids = [f"i-{n:017x}" for n in range(4)]
    ec2 = SlowTags(dict.fromkeys(ids, "gpu-a"), delay=0)
    reads = TagReads(ec2, refresh_every_s=0.3)
    await reads.tag(ids[0])  # a call was just made: refreshes wait out the interval after it
    refreshes = [asyncio.create_task(reads.tag(i, urgent=False)) for i in ids[1:3]]
    await asyncio.sleep(0.1)
    assert len(ec2.calls) == 1  # still gathering
    await reads.tag(ids[3])  # somebody waits: it goes at once, with the gathered refreshes
    await asyncio.gather(*refreshes)
    await reads.close()
    assert ec2.calls == [[ids[0]], [ids[3], ids[1], ids[2]]]


async def test_an_aws_error_fails_every_read_of_its_call_and_the_next_call_is_clean() -> None:
    ec2 = SlowTags({"i-1": "gpu-a", "i-2": "gpu-a"})
    ec2.fail = RuntimeError("Throttling")
    reads = TagReads(ec2)
    results = await asyncio.gather(reads.tag("i-1"), reads.tag("i-2"), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    ec2.fail = None
    assert await reads.tag("i-1") == "gpu-a"
    await reads.close()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Lookup(AwsMembershipLookup):
    """The real lookup's shape, without AWS: tags from a dict, and no instance in any cluster."""

    def __init__(self, ec2: SlowTags) -> None:
        self.ec2_tags = ec2

    def group_tags(self, instance_ids: Sequence[str]) -> dict[str, str | None]:
        return self.ec2_tags(instance_ids)

    def in_cluster(self, cluster: str, instance_id: str) -> bool:
        return False


def one_member() -> tuple[FakeClock, SlowTags, GroupMembership]:
    """i-1 tagged for gpu-a, answers fresh for 300 s on a clock the test moves, refreshes sent at once."""
    clock = FakeClock()
    ec2 = SlowTags({"i-1": "gpu-a"}, delay=0)
    lookup = Lookup(ec2)
    tag_reads = TagReads(lookup.group_tags, refresh_every_s=0)
    return clock, ec2, GroupMembership([GROUP], lookup, ttl_s=300, clock=clock, tag_reads=tag_reads)


async def test_a_stale_answer_is_given_while_it_is_asked_again_and_a_too_old_one_is_waited_for() -> None:
    clock, ec2, membership = one_member()
    try:
        assert (await membership.check("i-1", "gpu-a")).member
        clock.now += 100
        assert (await membership.check("i-1", "gpu-a")).member
        assert len(ec2.calls) == 1  # fresh: no call

        ec2.tags["i-1"] = "gpu-b"  # moved to another group
        clock.now += 250  # 350 s old: stale, still given, asked again behind the answer
        assert (await membership.check("i-1", "gpu-a")).member
        for _ in range(50):
            await asyncio.sleep(0.01)
            if not membership.refreshing:
                break
        assert len(ec2.calls) == 2
        refused = await membership.check("i-1", "gpu-a")
        assert not refused.member and f"tagged {names.GROUP_TAG}=gpu-b" in refused.how

        ec2.tags["i-1"] = "gpu-a"
        clock.now += 601  # older than two TTLs: forgotten, asked while the report waits
        assert (await membership.check("i-1", "gpu-a")).member
        assert len(ec2.calls) == 3
    finally:
        await membership.close()


async def test_a_failed_refresh_keeps_the_answer_until_it_is_too_old_then_the_report_gets_unknown() -> None:
    clock, ec2, membership = one_member()
    try:
        assert (await membership.check("i-1", "gpu-a")).member
        ec2.fail = ClientError({"Error": {"Code": "RequestLimitExceeded", "Message": "slow down"}}, "DescribeInstances")
        clock.now += 400
        assert (await membership.check("i-1", "gpu-a")).member  # stale, refresh fails in the background
        await asyncio.sleep(0.05)
        assert (await membership.check("i-1", "gpu-a")).member
        clock.now += 300  # 700 s: past two TTLs
        with pytest.raises(MembershipUnknown):
            await membership.check("i-1", "gpu-a")
    finally:
        await membership.close()


def test_one_describe_instances_answers_for_many_and_an_unknown_id_costs_only_itself(aws_env: str) -> None:
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=aws_env)
    tagged = [
        i["InstanceId"]
        for i in ec2.run_instances(
            ImageId="ami-12c6146b",
            MinCount=2,
            MaxCount=2,
            TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": names.GROUP_TAG, "Value": "gpu-a"}]}],
        )["Instances"]
    ]
    [untagged] = [
        i["InstanceId"] for i in ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)["Instances"]
    ]
    lookup = AwsMembershipLookup(AwsSettings(endpoint_url=aws_env, region="us-east-1"))
    unknown = "i-0000000000000dead"
    assert lookup.group_tags([*tagged, untagged]) == {tagged[0]: "gpu-a", tagged[1]: "gpu-a", untagged: None}
    assert lookup.group_tags([tagged[0], unknown]) == {tagged[0]: "gpu-a", unknown: None}
