"""Did a silent instance leave on purpose? The reads behind the `instances_gone` activity, and the verdict.

An instance that was scaled in, stopped or terminated by someone, put in standby, deregistered from ECS, taken back
by a Spot interruption or by the end of its Capacity Block falls silent exactly like a broken one. Repairing it
would fail at `set_draining`, count against the breaker and raise alerts: it retires instead.

Learned cheaply: once per batch of losses, one read per AWS API (chunked by each API's own limits), never a poll
per instance. EC2's own read must succeed (the caller fails and the workflow retries, then tells the losses as
such). Any other read that fails proves nothing: it is logged, and the instances it was about count as lost (a real
fault) unless another read says they left. Never retire on a guess.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from botocore.exceptions import BotoCoreError
from temporalio.exceptions import ApplicationError

from activities.aws import AwsClients
from activities.ec2 import EC2_FILTER_VALUES_MAX, GONE_EC2_STATES, chunks
from activities.models import GoneCause, GoneInstance

if TYPE_CHECKING:
    from mypy_boto3_autoscaling.type_defs import AutoScalingInstanceDetailsTypeDef
    from mypy_boto3_ec2.type_defs import CapacityReservationTypeDef, InstanceTypeDef, SpotInstanceRequestTypeDef

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_REASON = 256
# API batch limits: DescribeAutoScalingInstances takes at most 50 ids.
ASG_DESCRIBE_MAX = 50
CAPACITY_RESERVATIONS_MAX = 100
# Ids per ECS cluster query (`ec2InstanceId in [...]`): an expression is at most 2,000 characters, ~21 per id.
ECS_QUERY_IDS_MAX = 50

STOPPED_EC2_STATES = frozenset({"stopping", "stopped"})
# Auto Scaling only has a say while EC2 still runs the instance; past that, EC2's state says it all.
ASG_SAYS_IN_EC2_STATES = frozenset({"pending", "running"})
# Auto Scaling lifecycle states of an instance on its way out of the group, and what they mean to an operator.
ASG_LEAVING: dict[str, str] = {
    "Terminating": "being terminated (scale-in, instance refresh or rebalancing)",
    "Terminating:Wait": "being terminated, held by a termination lifecycle hook",
    "Terminating:Proceed": "being terminated, past its termination lifecycle hook",
    "Terminating:Retained": "terminated by the group and retained",
    "Terminated": "terminated by the group",
    "Detaching": "being detached from the group",
    "Detached": "detached from the group",
    "EnteringStandby": "being put in standby",
    "Standby": "put in standby",
}
# ECS lists every container instance but INACTIVE ones; these two are what deregistering leaves behind.
ECS_DEREGISTERED_STATUSES = frozenset({"DEREGISTERING", "INACTIVE"})
# Spot request status codes (EC2 User Guide, "Spot request status") of EC2 taking the capacity back. The "-by-user"
# ones are someone's own stop or terminate, which EC2's state and reason already say.
SPOT_INTERRUPTION_PREFIXES = ("marked-for-", "instance-terminated-", "instance-stopped-", "instance-hibernated-")
CAPACITY_BLOCK_ENDED_STATES = frozenset({"expired", "cancelled"})
# EC2 starts terminating a Capacity Block's instances 30 minutes before its end date (and warns 10 minutes before
# that): from then on, silence is the block ending, not a fault.
CAPACITY_BLOCK_ENDING_LEAD = timedelta(minutes=30)


@dataclass
class Lookups:
    """What the reads besides EC2's said. An instance (or reservation) missing from a mapping: that read had nothing
    to say about it, or could not be made; either way it proves nothing."""

    cluster: str = ""
    # instance -> its Auto Scaling membership (instances in no Auto Scaling group are not listed)
    asg: dict[str, AutoScalingInstanceDetailsTypeDef] = field(default_factory=dict)
    # instance -> statuses of its container instances in the group's cluster ([]: none, it was deregistered)
    registrations: dict[str, list[str]] = field(default_factory=dict)
    # instance -> its Spot request
    spot: dict[str, SpotInstanceRequestTypeDef] = field(default_factory=dict)
    # reservation id -> the Capacity Reservation
    reservations: dict[str, CapacityReservationTypeDef] = field(default_factory=dict)


Registrations = Callable[[list[str]], Awaitable[dict[str, list[str]]]]


def departure(instance: InstanceTypeDef, lookups: Lookups, now: datetime) -> GoneInstance | None:
    """The instance as gone, with the strongest cause and every reason found; None when nothing says it left."""
    signals = [
        signal
        for signal in (
            # Root causes first: a Spot interruption or a Capacity Block's end is why EC2 terminates it.
            _spot_interruption(instance, lookups),
            _capacity_block_ending(instance, lookups, now),
            _ec2_state(instance),
            _asg_leaving(instance, lookups),
            _ecs_deregistered(instance, lookups),
        )
        if signal is not None
    ]
    if not signals:
        return None
    return GoneInstance(
        instance_id=instance["InstanceId"],
        state=_state(instance),
        reason="; ".join(text for _, text in signals if text)[:MAX_REASON],
        cause=signals[0][0],
    )


def is_spot_interruption(code: str) -> bool:
    return code.startswith(SPOT_INTERRUPTION_PREFIXES) and not code.endswith("-by-user")


def _state(instance: InstanceTypeDef) -> str:
    return str(instance.get("State", {}).get("Name", ""))


def _ec2_state(instance: InstanceTypeDef) -> tuple[GoneCause, str] | None:
    state = _state(instance)
    # EC2's reason, e.g. "User initiated (2026-12-01 10:00:00 GMT)"; the state itself is GoneInstance.state.
    reason = instance.get("StateTransitionReason", "")
    if state in GONE_EC2_STATES:
        return GoneCause.EC2_TERMINATED, reason
    if state in STOPPED_EC2_STATES:
        return GoneCause.EC2_STOPPED, reason
    return None


def _asg_leaving(instance: InstanceTypeDef, lookups: Lookups) -> tuple[GoneCause, str] | None:
    member = lookups.asg.get(instance["InstanceId"])
    if member is None or _state(instance) not in ASG_SAYS_IN_EC2_STATES:
        return None
    lifecycle = member.get("LifecycleState", "")
    meaning = ASG_LEAVING.get(lifecycle)
    if meaning is None:
        return None
    group = member.get("AutoScalingGroupName", "?")
    return GoneCause.ASG_LEAVING, f"Auto Scaling group {group} has it {lifecycle}: {meaning}"


def _ecs_deregistered(instance: InstanceTypeDef, lookups: Lookups) -> tuple[GoneCause, str] | None:
    statuses = lookups.registrations.get(instance["InstanceId"])
    # Only a running instance: one still pending has not registered yet, and a stopped one is EC2's to explain.
    if statuses is None or _state(instance) != "running":
        return None
    if not statuses:
        return GoneCause.ECS_DEREGISTERED, f"no longer registered in ECS cluster {lookups.cluster} (deregistered)"
    if all(status in ECS_DEREGISTERED_STATUSES for status in statuses):
        status = "/".join(sorted(set(statuses)))
        return GoneCause.ECS_DEREGISTERED, f"deregistered from ECS cluster {lookups.cluster} ({status})"
    return None


def _spot_interruption(instance: InstanceTypeDef, lookups: Lookups) -> tuple[GoneCause, str] | None:
    if instance.get("InstanceLifecycle") != "spot":
        return None
    request = lookups.spot.get(instance["InstanceId"])
    status = (request or {}).get("Status", {})
    code = status.get("Code", "")
    if not is_spot_interruption(code):
        return None
    message = status.get("Message", "")
    return GoneCause.SPOT_INTERRUPTION, f"Spot interruption: {code}" + (f" ({message})" if message else "")


def _capacity_block_ending(instance: InstanceTypeDef, lookups: Lookups, now: datetime) -> tuple[GoneCause, str] | None:
    reservation_id = instance.get("CapacityReservationId")
    reservation = lookups.reservations.get(reservation_id or "")
    # An ordinary On-Demand Capacity Reservation ending leaves its instances running: only a Capacity Block's does not.
    if reservation is None or reservation.get("ReservationType") != "capacity-block":
        return None
    state = reservation.get("State", "")
    if state in CAPACITY_BLOCK_ENDED_STATES:
        return GoneCause.CAPACITY_BLOCK_ENDING, f"Capacity Block {reservation_id} {state}"
    end = reservation.get("EndDate")
    if end is not None and end - now <= CAPACITY_BLOCK_ENDING_LEAD:
        return GoneCause.CAPACITY_BLOCK_ENDING, f"Capacity Block {reservation_id} ends {end.isoformat()}"
    return None


def _some(ids: Sequence[str]) -> str:
    return f"{', '.join(ids[:3])}{'...' if len(ids) > 3 else ''}"


class Departures:
    """The reads besides EC2's, each once per batch (chunked by its API's limits), all four at once."""

    def __init__(self, aws: AwsClients) -> None:
        self._aws = aws

    async def lookups(
        self, instances: Mapping[str, InstanceTypeDef], cluster: str | None, registrations: Registrations | None
    ) -> Lookups:
        """Reads only what can change the verdict: Auto Scaling and ECS for instances EC2 still runs, Spot requests
        for Spot instances, reservations for instances in one."""
        live = sorted(i for i, inst in instances.items() if _state(inst) in ASG_SAYS_IN_EC2_STATES)
        running = sorted(i for i, inst in instances.items() if _state(inst) == "running")
        spot = sorted(i for i, inst in instances.items() if inst.get("InstanceLifecycle") == "spot")
        reserved = sorted({rid for inst in instances.values() if (rid := inst.get("CapacityReservationId"))})
        asg, ecs, spot_requests, reservations = await asyncio.gather(
            self._by_chunk("autoscaling:DescribeAutoScalingInstances", live, ASG_DESCRIBE_MAX, self._asg_members),
            # No cluster (an unknown group): ECS is not asked, which proves nothing either way.
            self._by_chunk(
                f"ECS registrations in cluster {cluster}",
                running if registrations else [],
                ECS_QUERY_IDS_MAX,
                registrations or _nothing,
            ),
            self._by_chunk("ec2:DescribeSpotInstanceRequests", spot, EC2_FILTER_VALUES_MAX, self._spot_requests),
            self._by_chunk(
                "ec2:DescribeCapacityReservations", reserved, CAPACITY_RESERVATIONS_MAX, self._capacity_reservations
            ),
        )
        return Lookups(cluster=cluster or "", asg=asg, registrations=ecs, spot=spot_requests, reservations=reservations)

    async def _by_chunk(
        self, what: str, ids: Sequence[str], size: int, read: Callable[[list[str]], Awaitable[dict[str, T]]]
    ) -> dict[str, T]:
        found: dict[str, T] = {}
        for chunk in chunks(ids, size):
            try:
                found.update(await read(chunk))
            except (ApplicationError, BotoCoreError) as err:
                # AccessDenied, or throttled past botocore's retries: not asked is not an answer.
                log.warning(
                    "instances_gone: %s not read for %s (%s); they count as lost unless another read says they left",
                    what,
                    _some(chunk),
                    err,
                )
        return found

    async def _asg_members(self, instance_ids: list[str]) -> dict[str, AutoScalingInstanceDetailsTypeDef]:
        found: dict[str, AutoScalingInstanceDetailsTypeDef] = {}
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"NextToken": token} if token else {}
            page = await self._aws.call(
                f"Auto Scaling instances {_some(instance_ids)}",
                self._aws.autoscaling.describe_auto_scaling_instances,
                InstanceIds=instance_ids,
                MaxRecords=ASG_DESCRIBE_MAX,
                **kwargs,
            )
            found |= {
                m["InstanceId"]: m for m in page.get("AutoScalingInstances", []) if m["InstanceId"] in instance_ids
            }
            token = page.get("NextToken")
            if not token:
                return found

    async def _spot_requests(self, instance_ids: list[str]) -> dict[str, SpotInstanceRequestTypeDef]:
        found: dict[str, SpotInstanceRequestTypeDef] = {}
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"NextToken": token} if token else {}
            # A filter, not SpotInstanceRequestIds=: one request EC2 no longer knows would fail the whole chunk.
            page = await self._aws.call(
                f"Spot requests of EC2 instances {_some(instance_ids)}",
                self._aws.ec2.describe_spot_instance_requests,
                Filters=[{"Name": "instance-id", "Values": instance_ids}],
                **kwargs,
            )
            for request in page.get("SpotInstanceRequests", []):
                instance_id = request.get("InstanceId", "")
                # A replaced request may linger beside the current one: the one that says interruption wins.
                if instance_id and (
                    instance_id not in found or is_spot_interruption(request.get("Status", {}).get("Code", ""))
                ):
                    found[instance_id] = request
            token = page.get("NextToken")
            if not token:
                return found

    async def _capacity_reservations(self, reservation_ids: list[str]) -> dict[str, CapacityReservationTypeDef]:
        found: dict[str, CapacityReservationTypeDef] = {}
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"NextToken": token} if token else {}
            page = await self._aws.call(
                f"Capacity Reservations {_some(reservation_ids)}",
                self._aws.ec2.describe_capacity_reservations,
                CapacityReservationIds=reservation_ids,
                **kwargs,
            )
            for reservation in page.get("CapacityReservations", []):
                found[reservation.get("CapacityReservationId", "")] = reservation
            token = page.get("NextToken")
            if not token:
                return found


async def _nothing(_: list[str]) -> dict[str, list[str]]:
    return {}
