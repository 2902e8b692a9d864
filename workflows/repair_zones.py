"""Where a repair's replacement launches (docs/operations.md, "Where a replacement launches").

By default in the impaired instance's subnet, and there for as long as capacity lacks: ODCRs and Capacity Blocks are
AZ-bound, and a group's tasks may be placed by AZ. Every capacity error says so (the event and the health view:
"staying in us-east-1a"). A group with `allow_other_azs` lists its `subnets`: a repair starts outside the AZs its
permit grant says the group's launches found out of capacity, and moves to the next AZ after
`capacity_errors_before_moving` capacity errors in a row. Each outcome goes to the group's semaphore, which keeps the
AZs' launch health for the group's other repairs (workflows/semaphore_zones.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from temporalio import workflow
from temporalio.exceptions import FailureError

from contract import names
from contract.groups import CapacityGroup
from contract.ids import semaphore_workflow_id
from contract.semaphore import LaunchOutcome
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.repair_record import RepairRecord

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from activities.models import DrainResult, SubnetZonesRequest


@dataclass(frozen=True)
class Placement:
    subnet_id: str | None
    availability_zone: str | None


class Zones:
    """One repair's launch placement, try after try."""

    def __init__(self, order: list[Placement], may_move: bool, errors_before_moving: int) -> None:
        self._order = order
        self._may_move = may_move
        self._errors_before_moving = errors_before_moving
        self._index = 0
        self._errors_here = 0
        self.moves = 0  # a launch somewhere new needs a client token of its own (EC2 checks a token's parameters)

    @property
    def here(self) -> Placement:
        return self._order[self._index]

    def capacity_error(self) -> str:
        """Count a capacity error where we are; says what the next try does, for the event and the health view."""
        zone = self.here.availability_zone or "its AZ"
        self._errors_here += 1
        if not self._may_move:
            return f"staying in {zone}: allow_other_azs is off"
        if len(self._order) < 2:
            return f"staying in {zone}: no subnet of the group is in another AZ"
        if self._errors_here < self._errors_before_moving:
            errors = f"{self._errors_here} of {self._errors_before_moving}"
            return f"staying in {zone} ({errors} capacity errors before moving)"
        self._index = (self._index + 1) % len(self._order)
        self._errors_here = 0
        self.moves += 1
        return f"moving to {self.here.subnet_id} in {self.here.availability_zone}"


async def plan(record: RepairRecord, group: CapacityGroup, drained: DrainResult) -> Zones:
    """The impaired instance's subnet first, unless the group may move and its AZ is one to avoid; then one subnet
    per other AZ of the group's, in the order the settings list them."""
    home = Placement(drained.subnet_id, drained.availability_zone)
    if not (group.allow_other_azs and group.launch_template and group.subnets):
        return Zones([home], False, group.capacity_errors_before_moving)
    found = await workflow.execute_activity_method(
        FleetActivities.subnet_zones,
        SubnetZonesRequest(subnet_ids=group.subnets),
        summary=f"look up the AZs of capacity group {group.name}'s subnets",
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )
    order = [home]
    for subnet in group.subnets:
        zone = found.zones.get(subnet)
        if zone is not None and zone not in {p.availability_zone for p in order}:
            order.append(Placement(subnet, zone))
    avoid = set(record.avoid_azs)
    order.sort(key=lambda p: p.availability_zone in avoid)  # stable: home first among the AZs not avoided
    return Zones(order, True, group.capacity_errors_before_moving)


async def tell_semaphore(record: RepairRecord, zone: str | None, capacity_error: bool) -> None:
    if not zone:
        return
    handle = workflow.get_external_workflow_handle(semaphore_workflow_id(record.group))
    outcome = LaunchOutcome(
        holder_workflow_id=workflow.info().workflow_id,
        token=record.permit_token,
        availability_zone=zone,
        capacity_error=capacity_error,
    )
    try:
        await handle.signal(names.SIGNAL_LAUNCH_OUTCOME, outcome)
    except FailureError as err:
        # The record is advice for other repairs; this one goes on without it.
        workflow.logger.warning("could not tell the drain semaphore about a launch in %s: %s", zone, err)
