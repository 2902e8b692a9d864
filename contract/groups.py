"""Capacity groups: the unit of the drain cap and of the auto-repair switch, and their live configuration."""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, Field

from contract.config import SettingsSection, format_seconds
from contract.limits import Name
from contract.liveness import LivenessShards

# The drain cap's percentage: validated by the settings (the field's bounds) and by a live update (problems()).
MIN_DRAINING_PERCENT, MAX_DRAINING_PERCENT = 1, 100
DrainingPercent = Annotated[int, Field(ge=MIN_DRAINING_PERCENT, le=MAX_DRAINING_PERCENT)]
# The heartbeat-loss threshold: validated by the settings (settings_problems) and by a live update (problems()).
# At least this many of the probes' heartbeat intervals, so that one late or lost heartbeat never impairs.
HEARTBEATS_PER_THRESHOLD = 3
MAX_HEARTBEAT_LOSS_THRESHOLD = timedelta(days=1)
DEFAULT_HEARTBEAT_INTERVAL = timedelta(seconds=60)  # the probe's own default, `--heartbeat-interval 60`


def heartbeat_threshold_problem(threshold: timedelta, heartbeat_interval: timedelta | None) -> str | None:
    """Why a heartbeat-loss threshold does not fit (None: it does); without an interval, only its bounds."""
    if not timedelta(0) < threshold <= MAX_HEARTBEAT_LOSS_THRESHOLD:
        return (
            "heartbeat_loss_threshold must be more than 0s and at most "
            f"{format_seconds(MAX_HEARTBEAT_LOSS_THRESHOLD)}, not {format_seconds(threshold)}"
        )
    if heartbeat_interval is not None and threshold < HEARTBEATS_PER_THRESHOLD * heartbeat_interval:
        least = HEARTBEATS_PER_THRESHOLD * heartbeat_interval
        return (
            f"heartbeat_loss_threshold {format_seconds(threshold)} is less than {HEARTBEATS_PER_THRESHOLD} heartbeat "
            f"intervals ({HEARTBEATS_PER_THRESHOLD} x {format_seconds(heartbeat_interval)}): one late heartbeat "
            f"would impair a healthy instance; make it at least {format_seconds(least)}, or lower the group's "
            "heartbeat_interval together with the probes' --heartbeat-interval"
        )
    return None


class AutoRepair(StrEnum):
    ENABLED = "ENABLED"
    DISABLED = "DISABLED"


class CapacityGroup(SettingsSection):
    """One capacity group (ECS's capacity provider): the unit of the drain cap and of the auto-repair switch.

    A [[groups]] table of the settings, and also a wire type (activity results, the semaphore's state): read as
    settings an unknown key, a duration that is not positive and a threshold under 3 heartbeat intervals are errors
    (SettingsSection); on the wire it stays lenient, so a payload of an older or newer version still decodes."""

    name: str = Field(min_length=1)
    cluster: str = Field(min_length=1, description="ECS cluster the group's container instances register with")
    launch_template: str | None = Field(default=None, description="Launch template name or id for replacements")
    launch_template_version: str = "$Latest"
    auto_scaling_group: str | None = None
    auto_repair: AutoRepair = AutoRepair.ENABLED
    max_draining_percent: DrainingPercent = 20
    # No probe heartbeat for this long: AGENT_CONNECTIVITY IMPAIRED. At least 3 heartbeat intervals, at most a day.
    heartbeat_loss_threshold: timedelta = timedelta(minutes=10)
    # How often the group's probes send a heartbeat: their --heartbeat-interval (default 60 s), said here once more so
    # that the threshold can be checked against it.
    heartbeat_interval: timedelta = DEFAULT_HEARTBEAT_INTERVAL
    # How long a replacement may take from launch to ACTIVE in ECS before the wait is retried.
    replacement_ready_timeout: timedelta = timedelta(minutes=20)
    # How often the repair looks at the draining instance's tasks between stop-timeout deadlines.
    task_poll_interval: timedelta = timedelta(seconds=15)
    # How often the drain semaphore checks that its permit holders are still running.
    permit_reclaim_interval: timedelta = timedelta(minutes=1)
    # Liveness trackers for the group: one holds up to 20,000 instances; a larger group needs more (ceil(n/20,000)).
    liveness_shards: LivenessShards = 1

    def max_draining(self, instance_count: int) -> int:
        """The drain cap, computed here only. ECS's rule: max(1, floor(n * pct / 100)); below 9 instances at 20%
        that is one at a time."""
        return max(1, instance_count * self.max_draining_percent // 100)

    def settings_problems(self) -> list[tuple[str | None, str]]:
        problem = heartbeat_threshold_problem(self.heartbeat_loss_threshold, self.heartbeat_interval)
        return [("heartbeat_loss_threshold", problem)] if problem else []


class GroupConfigOverrides(BaseModel):
    """What an operator changed on a running group; unset fields fall back to the worker's settings."""

    auto_repair: AutoRepair | None = None
    max_draining_percent: int | None = None
    heartbeat_loss_threshold: timedelta | None = None

    def apply(self, group: CapacityGroup) -> CapacityGroup:
        return group.model_copy(update=self.model_dump(exclude_none=True))


class GroupConfigUpdate(BaseModel):
    """`autorepair group update`: the fields to change (None: leave as is). Checked by the update's validator,
    not here, so that a bad value reaches the workflow and is refused there with a clear message."""

    auto_repair: AutoRepair | None = None
    max_draining_percent: int | None = None
    heartbeat_loss_threshold: timedelta | None = None
    # Drop every live override first (back to the worker's settings), then apply the fields above, if any.
    reset: bool = False
    requested_by: Name = ""

    def changes(self) -> GroupConfigOverrides:
        return GroupConfigOverrides.model_validate(self.model_dump(exclude={"requested_by", "reset"}))

    def problems(self, group: CapacityGroup | None = None) -> list[str]:
        """What is wrong with this update, for the operator; empty when it may be applied. `group`: the group's
        effective configuration now (settings + live overrides), to check the threshold against its
        heartbeat_interval; without it only the bounds are checked."""
        problems = []
        if not self.reset and self.changes() == GroupConfigOverrides():
            problems.append(
                "nothing to change: give auto_repair, max_draining_percent, heartbeat_loss_threshold or reset"
            )
        percent = self.max_draining_percent
        if percent is not None and not MIN_DRAINING_PERCENT <= percent <= MAX_DRAINING_PERCENT:
            problems.append(
                f"max_draining_percent must be between {MIN_DRAINING_PERCENT} and {MAX_DRAINING_PERCENT}, not {percent}"
            )
        threshold = self.heartbeat_loss_threshold
        if threshold is not None:
            problem = heartbeat_threshold_problem(threshold, group.heartbeat_interval if group else None)
            if problem:
                problems.append(problem)
        return problems


class GroupConfigState(BaseModel):
    """The semaphore's `group_config` query and `update_group` result: the overrides, and the effective
    configuration as the semaphore last read it (worker settings + overrides; None before its first read)."""

    group: str
    overrides: GroupConfigOverrides = Field(default_factory=GroupConfigOverrides)
    effective: CapacityGroup | None = None
    updated_at: datetime | None = None
    updated_by: Name = ""
    revision: int = 0
