"""Where the group's launches meet capacity errors: a part of DrainSemaphoreWorkflow (workflows/drain_semaphore.py).

Each repair tells its group's semaphore how its launches in an AZ went (`launch_outcome`); a grant names the AZs
that met a capacity error within the group's `az_avoid_for` and have not launched since, so that a repair allowed to
move (`allow_other_azs`) starts elsewhere, as ECS's AZ avoidance does. Kept by AZ, not by subnet: capacity is an AZ's.
"""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

from contract.groups import GroupConfigState
from contract.semaphore import LaunchOutcome
from workflows.models import Permit

# Bounds the record whatever the signals say: a region has a few dozen AZs at most.
MAX_ZONES = 64


class SemaphoreZones:
    """Mixed into DrainSemaphoreWorkflow, whose state these are."""

    _holders: list[Permit]
    _config: GroupConfigState
    _launch_failures: dict[str, datetime]

    def _forged_signal(self, why: str) -> None:
        raise NotImplementedError

    def _on_launch_outcome(self, outcome: LaunchOutcome) -> None:
        holder = next((p for p in self._holders if p.holder_workflow_id == outcome.holder_workflow_id), None)
        if holder is None or not outcome.token or holder.token != outcome.token:
            # Only a repair that drains launches, and it shows the token of its request.
            self._forged_signal(f"launch outcome for {outcome.holder_workflow_id}, not a permit holder's")
            return
        zone = outcome.availability_zone
        if not outcome.capacity_error:
            self._launch_failures.pop(zone, None)
        elif zone in self._launch_failures or len(self._launch_failures) < MAX_ZONES:
            self._launch_failures[zone] = workflow.now()

    def _avoid_azs(self) -> list[str]:
        """The AZs a grant tells its repair to avoid; older failures are forgotten here."""
        group = self._config.effective
        if group is None:
            return sorted(self._launch_failures)
        since = workflow.now() - group.az_avoid_for
        self._launch_failures = {zone: at for zone, at in self._launch_failures.items() if at > since}
        return sorted(self._launch_failures) if group.allow_other_azs else []
