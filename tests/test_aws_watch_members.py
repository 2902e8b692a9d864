"""The AWS watch's membership memory, with a fake AWS reader and a fake Temporal client (no server needed): an
instance of a shared cluster that is not the group's is asked about again after FOREIGN_RECHECK, so one tagged into
the group later gets its health workflow without a worker restart. Coverage end to end:
tests/test_coverage_from_registration.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.aws_status import AwsStatusReads
from contract.aws_status import AwsInstanceStatus
from contract.groups import CapacityGroup
from contract.ids import semaphore_workflow_id
from worker.aws_watch import FOREIGN_RECHECK, GroupWatch
from worker.settings import Settings


class Reads:
    def __init__(self, cluster: list[str], members: set[str]) -> None:
        self.cluster = cluster
        self.member_ids = members
        self.asked: list[list[str]] = []

    async def read(self, group: CapacityGroup, now: datetime | None = None) -> dict[str, AwsInstanceStatus]:
        at = now or datetime.now(UTC)
        return {i: AwsInstanceStatus(instance_id=i, group=group.name, observed_at=at) for i in self.cluster}

    async def members(self, group: CapacityGroup, instance_ids: list[str]) -> set[str]:
        self.asked.append(list(instance_ids))
        return self.member_ids & set(instance_ids)


class Temporal:
    """Health workflows started, apart from the group's drain semaphore (started before them, or refused while
    `refuse` is set)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.semaphores: list[str] = []
        self.refuse = False

    async def start_workflow(self, *args: Any, id: str, **kwargs: Any) -> None:
        if id == semaphore_workflow_id("g"):
            if self.refuse:
                raise RPCError("unavailable", RPCStatusCode.UNAVAILABLE, b"")
            self.semaphores.append(id)
            assert not self.started, "the semaphore starts before any health workflow"
        else:
            self.started.append(id)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_an_instance_of_another_group_is_asked_about_again_and_covered_once_it_joins() -> None:
    reads, temporal, clock = Reads(["i-mine", "i-theirs"], {"i-mine"}), Temporal(), Clock()
    settings = Settings(groups=[CapacityGroup(name="g", cluster="shared")])
    watch = GroupWatch(cast(Client, temporal), settings, "g", cast(AwsStatusReads, reads), clock=clock)

    await watch.round()
    assert temporal.started == ["health/i-mine"] and reads.asked == [["i-mine", "i-theirs"]]
    await watch.round()
    assert reads.asked == [["i-mine", "i-theirs"]]  # not asked again at every read

    reads.member_ids.add("i-theirs")  # tagged into the group
    clock.now += FOREIGN_RECHECK - 1
    await watch.round()
    assert temporal.started == ["health/i-mine"]
    clock.now += 2
    await watch.round()
    assert reads.asked[-1] == ["i-theirs"] and temporal.started == ["health/i-mine", "health/i-theirs"]
    await watch.round()
    assert len(reads.asked) == 2 and watch.started == 2  # covered: never asked again
    assert temporal.semaphores == [semaphore_workflow_id("g")]  # at the first round only


async def test_the_groups_drain_semaphore_runs_before_its_first_fault_and_a_refused_start_is_tried_again() -> None:
    reads, temporal = Reads(["i-1"], {"i-1"}), Temporal()
    settings = Settings(groups=[CapacityGroup(name="g", cluster="c")])
    watch = GroupWatch(cast(Client, temporal), settings, "g", cast(AwsStatusReads, reads), clock=Clock())
    temporal.refuse = True
    await watch.round()
    # Temporal refused: the instances are still read and covered, and the next round tries the semaphore again.
    assert not watch.semaphore_running and temporal.started == ["health/i-1"]
    temporal.refuse = False
    temporal.started.clear()
    await watch.round()
    await watch.round()
    assert watch.semaphore_running and temporal.semaphores == [semaphore_workflow_id("g")]
