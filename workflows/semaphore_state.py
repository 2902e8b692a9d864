"""A drain semaphore's state as a plain model: who holds a permit, who waits, how much room the cap leaves, its
breaker book and live configuration, and where the group's launches met capacity errors.

No Temporal here: `now` comes from the caller. DrainSemaphoreWorkflow (workflows/drain_semaphore.py) and its breaker
duties (workflows/semaphore_breaker.py) read and write it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from contract.breaker import BreakerHold, BreakerRule, ImpairmentReport
from contract.groups import GroupConfigState
from contract.semaphore import LaunchOutcome, PermitRequest
from workflows.breaker import BreakerBook
from workflows.models import Permit, SemaphoreRun

# Bounds the launch record whatever the signals say: a region has a few dozen AZs at most.
MAX_ZONES = 64


@dataclass
class SemaphoreState:
    group: str
    holders: list[Permit]
    waiters: list[PermitRequest]
    config: GroupConfigState
    breaker: BreakerBook
    fleet_hold: BreakerHold | None = None
    # AZ -> when a launch there last met a capacity error: a grant names the AZs to avoid (docs/operations.md, "Where
    # a replacement launches"). Kept by AZ, not by subnet: capacity is an AZ's.
    launch_failures: dict[str, datetime] = field(default_factory=dict)
    max_holders_seen: int = 0
    rejected: int = 0
    forged: int = 0
    dropped_requests: int = 0
    # Impairments reported and not yet counted (the loop counts them at its next turn).
    reported: list[ImpairmentReport] = field(default_factory=list)
    # From the last count of the group (the cap follows from its size): see measured().
    capacity: int = 1
    group_size: int = 0
    out_of_service: int = 0
    unheld_draining: set[str] = field(default_factory=set)
    measured_at: datetime | None = None
    holder_left: bool = False  # since the last count: its instance may still be out of service
    changed: bool = True  # something the loop must look at: a grant may be possible

    @classmethod
    def from_run(cls, input: SemaphoreRun) -> SemaphoreState:
        return cls(
            group=input.group,
            holders=list(input.holders),
            waiters=list(input.waiters),
            config=input.config or GroupConfigState(group=input.group),
            breaker=input.breaker or BreakerBook(),
            fleet_hold=input.fleet_hold,
            launch_failures=dict(input.launch_failures),
            max_holders_seen=input.max_holders_seen,
            rejected=input.rejected_signals,
            forged=input.forged_signals,
            dropped_requests=input.dropped_requests,
        )

    def carried(self) -> SemaphoreRun:
        """What the next run takes over (continue-as-new); the group's count is taken afresh."""
        return SemaphoreRun(
            group=self.group,
            holders=self.holders,
            waiters=self.waiters,
            max_holders_seen=self.max_holders_seen,
            rejected_signals=self.rejected,
            forged_signals=self.forged,
            dropped_requests=self.dropped_requests,
            config=self.config,
            breaker=self.breaker,
            fleet_hold=self.fleet_hold,
            launch_failures=self.launch_failures,
        )

    # --- room under the cap -------------------------------------------------------------------------------------

    def room(self) -> int:
        """Permits left: the cap counts instances out of service (DRAINING in ECS, a failed repair's or an
        operator's) as well as the repairs that hold permits."""
        return self.capacity - len(self.holders) - self.out_of_service

    def fits(self, request: PermitRequest) -> bool:
        # A repair whose instance is already out of service (a failed attempt's, retried) takes no more capacity.
        return request.instance_id in self.unheld_draining or self.room() > 0

    def fitting(self, ready: list[PermitRequest]) -> list[PermitRequest]:
        """The requests to grant now, in order: those whose instance is already DRAINING first, then as many others
        as there is room for."""
        first = [w for w in ready if w.instance_id in self.unheld_draining]
        others = [w for w in ready if w.instance_id not in self.unheld_draining]
        return first + others[: max(0, self.room())]

    def took_over(self, replacement_instance_id: str, now: datetime) -> None:
        """A completed repair's replacement took over now: its fault within replacement_fault_window is early."""
        group = self.config.effective
        window = group.replacement_fault_window if group is not None else BreakerRule().replacement_fault_window
        self.breaker.took_over(replacement_instance_id, now, window)

    def holding(self) -> bool:
        return self.breaker.held is not None or self.fleet_hold is not None

    def count_due(self, now: datetime, reclaim_interval: timedelta) -> bool:
        """Counting the group costs a page of ECS and EC2 calls per 100 instances: only when the count may have moved
        under us (a holder left, whose instance may stay DRAINING) or is older than the reclaim interval."""
        if self.measured_at is None or self.holder_left:
            return True
        return now - self.measured_at >= reclaim_interval

    def hold(self, request: PermitRequest, now: datetime) -> Permit:
        # Its DRAINING is now its permit's: counted once.
        if request.instance_id in self.unheld_draining:
            self.unheld_draining.discard(request.instance_id)
            self.out_of_service -= 1
        permit = Permit(
            holder_workflow_id=request.holder_workflow_id,
            holder_run_id=request.holder_run_id,
            instance_id=request.instance_id,
            since=now,
            token=request.token,
        )
        self.holders.append(permit)
        self.breaker.granted(now)
        self.max_holders_seen = max(self.max_holders_seen, len(self.holders))
        return permit

    def remove(self, holder_workflow_id: str) -> None:
        before = len(self.holders) + len(self.waiters)
        holders = len(self.holders)
        self.holders = [p for p in self.holders if p.holder_workflow_id != holder_workflow_id]
        self.holder_left = self.holder_left or len(self.holders) != holders
        self.waiters = [w for w in self.waiters if w.holder_workflow_id != holder_workflow_id]
        if len(self.holders) + len(self.waiters) != before:
            self.changed = True

    # --- where launches meet capacity errors --------------------------------------------------------------------

    def launch_outcome(self, outcome: LaunchOutcome, now: datetime) -> str | None:
        """Keep how a holder's launch went; why not, when it is no holder's (a forged signal)."""
        holder = next((p for p in self.holders if p.holder_workflow_id == outcome.holder_workflow_id), None)
        if holder is None or not outcome.token or holder.token != outcome.token:
            # Only a repair that drains launches, and it shows the token of its request.
            return f"launch outcome for {outcome.holder_workflow_id}, not a permit holder's"
        zone = outcome.availability_zone
        if not outcome.capacity_error:
            self.launch_failures.pop(zone, None)
        elif zone in self.launch_failures or len(self.launch_failures) < MAX_ZONES:
            self.launch_failures[zone] = now
        return None

    def avoid_azs(self, now: datetime) -> list[str]:
        """The AZs a grant tells its repair to avoid; older failures are forgotten here."""
        group = self.config.effective
        if group is None:
            return sorted(self.launch_failures)
        since = now - group.az_avoid_for
        self.launch_failures = {zone: at for zone, at in self.launch_failures.items() if at > since}
        return sorted(self.launch_failures) if group.allow_other_azs else []
