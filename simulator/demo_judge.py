"""When a demo run has reached its goal, or failed: judged from the fleet's snapshot and the events so far.

ENABLED: every faulted instance replaced (or, with remediation reboot-first, fixed in place by a reset or reboot where
NVIDIA says that clears it), the fleet back to N healthy instances, one RepairCompleted per fault; or, when the
breaker tripped (too many faults at once), what drained before it replaced and the rest held.
DISABLED: every faulted instance IMPAIRED and nothing drained or replaced for a grace period. In both modes a
repair or an IMPAIRED instance without a fault (a blip taken for a loss, noise taken for a fault) fails the run.

A replacement a repair gave up on (not ACTIVE in time: terminated by the repair, which then launches another, and a
`ReplacementAbandoned` event names it) is terminated without a fault of its own, and that is expected, never spurious.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from contract.groups import AutoRepair, Remediation
from contract.health import HealthState
from simulator.fleet import FleetSnapshot

# With auto repair DISABLED, "nothing happened" must hold this long after every fault shows as IMPAIRED.
DISABLED_GRACE_S = 10.0
# A repair terminates a replacement it abandons before it publishes the ReplacementAbandoned event that says so: a
# terminated replacement waits this long for that event before it counts as terminated without a fault.
ABANDONED_EVENT_GRACE_S = 60.0


@dataclass
class Outcome:
    """Neither done nor failed: the run goes on."""

    done: bool = False
    failed: bool = False
    message: str = ""


class Judge:
    """Decides when the run reached its goal (or failed), from the fleet's snapshot and the event counts."""

    def __init__(
        self,
        *,
        instances: int,
        auto_repair: AutoRepair,
        targets: set[str],
        blipped: set[str],
        group: str = "",
        remediation: Remediation = Remediation.REPLACE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.instances = instances
        self.group = group
        self.auto_repair = auto_repair
        self.targets = targets  # must be impaired (and, when ENABLED, replaced)
        self.blipped = blipped
        self.remediation = remediation
        self.quiet_since: float | None = None
        self._clock = clock
        # Terminated replacements whose ReplacementAbandoned event has not been read yet -> when first seen so.
        self._unexplained_since: dict[str, float] = {}

    def judge(
        self,
        snap: FleetSnapshot,
        events: Counter[str],
        fixed_in_place: set[str] | None = None,
        abandoned: set[str] | None = None,
    ) -> Outcome:
        """`abandoned`: the replacements that ReplacementAbandoned events name (terminated by their repair)."""
        in_place = fixed_in_place or set()
        if in_place - self.targets or (in_place and self.remediation is not Remediation.REBOOT_FIRST):
            return Outcome(failed=True, message=f"fixed in place without a fault to fix: {sorted(in_place)}")
        # What was terminated as a repair's abandoned replacement is not a repaired instance.
        terminated = set(snap.terminated) - (abandoned or set())
        unexplained = terminated - self.targets
        # A replacement (not one of the initial instances) may be terminated before its ReplacementAbandoned event is
        # written: wait a while for the event rather than call it spurious at once.
        now = self._clock()
        replacements = unexplained - set(snap.initial_instances)
        self._unexplained_since = {i: self._unexplained_since.get(i, now) for i in replacements}
        awaiting = {i for i in replacements if now - self._unexplained_since[i] < ABANDONED_EVENT_GRACE_S}
        spurious = sorted(unexplained - awaiting)
        if spurious:
            which = ", ".join(self._name(i, replacement=i in replacements) for i in spurious)
            return Outcome(failed=True, message=f"repaired instances that had no fault: {which}")
        false_alarms = sorted(
            iid for iid, status in snap.health.items() if status == HealthState.IMPAIRED and iid not in self.targets
        )
        if false_alarms:
            which = ", ".join(self._name(i) for i in false_alarms)
            return Outcome(failed=True, message=f"IMPAIRED without a fault: {which}")
        if self.auto_repair is AutoRepair.DISABLED:
            return self._judge_disabled(snap)
        if awaiting:
            return Outcome()  # neither done nor failed until the event says why they were terminated
        if events["RepairsHeld"]:
            return self._judge_held(snap, events, terminated)
        replaced = self.targets <= terminated | in_place
        back_to_n = (
            snap.running == self.instances
            and snap.healthy == self.instances
            and snap.container_draining == 0
            and not snap.booting
        )
        repairs_done = events["RepairCompleted"] >= len(self.targets)
        if replaced and back_to_n and repairs_done:
            how = f"repaired ({len(in_place)} by a reset or reboot)" if in_place else "replaced"
            return Outcome(
                done=True,
                message=(
                    f"all {len(self.targets)} impaired instances {how}; "
                    f"{self.instances}/{self.instances} instances healthy"
                ),
            )
        return Outcome()

    def _name(self, instance_id: str, *, replacement: bool = False) -> str:
        if instance_id in self.blipped:
            return f"{instance_id} (blip)"
        if replacement:
            return f"{instance_id} (a replacement, no ReplacementAbandoned event names it)"
        return instance_id

    def _judge_held(self, snap: FleetSnapshot, events: Counter[str], terminated: set[str]) -> Outcome:
        """The breaker tripped (too many faults at once): done once what drained before it is replaced, the rest
        held. Holding is the goal here, not a failure: replacing many instances on one signal is what it prevents."""
        if snap.container_draining or snap.booting or events["RepairCompleted"] < len(terminated):
            return Outcome()
        held = len(self.targets - terminated)
        return Outcome(
            done=True,
            message=(
                f"the breaker held repairs: {len(self.targets)} instances impaired at once, {len(terminated)} "
                f"replaced before it tripped, {held} held for an operator; `autorepair group describe --name "
                f"{self.group}` says why, `autorepair group update --name {self.group} --resume` lets them through "
                "(`--resume --discard-held` lets them go)"
            ),
        )

    def _judge_disabled(self, snap: FleetSnapshot) -> Outcome:
        if snap.container_draining or snap.terminated or snap.replacements_running or snap.booting:
            return Outcome(failed=True, message="auto repair is DISABLED, yet an instance was drained or replaced")
        impaired = all(snap.health.get(t) == HealthState.IMPAIRED for t in self.targets)
        if not impaired:
            self.quiet_since = None
            return Outcome()
        now = self._clock()
        if self.quiet_since is None:
            self.quiet_since = now
        if now - self.quiet_since >= DISABLED_GRACE_S:
            return Outcome(
                done=True,
                message=(
                    f"auto repair DISABLED: {len(self.targets)} instance(s) IMPAIRED and reported, "
                    f"nothing drained or replaced for {DISABLED_GRACE_S:.0f}s"
                ),
            )
        return Outcome()
