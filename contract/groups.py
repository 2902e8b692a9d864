"""Capacity groups: the unit of the drain cap and of the auto-repair switch, and their live configuration."""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from contract.breaker import (
    MAX_IMPAIRED_PERCENT,
    MAX_IMPAIRED_WINDOW,
    MAX_REPAIRS_PER_DAY,
    MIN_IMPAIRED_PERCENT,
    BreakerRule,
    ImpairedPercent,
    MaintenanceWindow,
    MinImpaired,
)
from contract.config import SettingsSection, format_seconds
from contract.limits import Name, Timestamp
from contract.liveness import LivenessShards

# The drain cap's percentage: validated by the settings (the field's bounds) and by a live update (problems()).
MIN_DRAINING_PERCENT, MAX_DRAINING_PERCENT = 1, 100
DrainingPercent = Annotated[int, Field(ge=MIN_DRAINING_PERCENT, le=MAX_DRAINING_PERCENT)]
# The heartbeat-loss threshold: validated by the settings (settings_problems) and by a live update (problems()).
# At least this many of the probes' heartbeat intervals, so that one late or lost heartbeat never impairs.
HEARTBEATS_PER_THRESHOLD = 3
MAX_HEARTBEAT_LOSS_THRESHOLD = timedelta(days=1)
DEFAULT_HEARTBEAT_INTERVAL = timedelta(seconds=60)  # the probe's own default, `--heartbeat-interval 60`
# Each attempt may hold a drain permit for a whole replacement_ready_timeout: more than a few only delays the operator.
MAX_REPLACEMENT_ATTEMPTS = 10
# Failed repairs of one instance, retried by its health workflow: each attempt may drain, launch and hold a permit,
# so a few, then an operator looks. The wait before each retry doubles from repair_retry_delay, at most a day.
MAX_REPAIR_ATTEMPTS = 10
MAX_REPAIR_RETRY_DELAY = timedelta(days=1)


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


# verify_replacement's third value, besides true and false: the reported checks, then the host's part of the fix's
# gate (DCGM's diagnostic, gate_command) through SSM Run Command. Not the default: it needs SSM on every host.
VerifyOnHost = Literal["on_host"]
VERIFY_ON_HOST: VerifyOnHost = "on_host"

# ECS's own bounds on a service name; DescribeServices takes 10 names a call, so the group's daemons cost one.
EcsServiceName = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_-]+$")]
MAX_DAEMON_SERVICES = 10

# A region has at most a few dozen AZs; a group lists a subnet or two per AZ.
MAX_SUBNETS = 50


class AutoRepair(StrEnum):
    ENABLED = "ENABLED"
    DISABLED = "DISABLED"


class Remediation(StrEnum):
    """What a repair does first (docs/operations.md, "The remediation ladder")."""

    # ECS's behaviour: every repair replaces the instance, start-before-stop.
    REPLACE = "replace"
    # A fault NVIDIA's catalog says a GPU reset or a reboot clears is first handled in place (reset where the group
    # allows it, else reboot); a replacement only when that does not work, or the fault comes back.
    REBOOT_FIRST = "reboot-first"


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
    # How long a replacement may take from launch to ACTIVE in ECS; then it is terminated and another is launched.
    replacement_ready_timeout: timedelta = timedelta(minutes=20)
    # A replacement ACTIVE in ECS must also have its probe report, and pass the gate a fix must pass (every GPU of its
    # type, no NVIDIA verdict, no memory pending, no fault), within replacement_ready_timeout of its launch, before
    # the impaired instance is terminated; one that fails is abandoned and another launched. "on_host": then also the
    # host's part of the gate (gate_diag_level, gate_command, within gate_timeout), which needs SSM on the hosts.
    verify_replacement: bool | VerifyOnHost = True
    # Replacements one repair may launch that never become ACTIVE; then the repair fails, its instance left DRAINING.
    max_replacement_attempts: int = Field(default=3, ge=1, le=MAX_REPLACEMENT_ATTEMPTS)
    # A failed repair is tried again by the instance's health workflow after this, doubling after each failure, up
    # to max_repair_attempts attempts in all; then RepairsExhausted, and the instance waits for an operator.
    repair_retry_delay: timedelta = timedelta(minutes=10)
    max_repair_attempts: int = Field(default=4, ge=1, le=MAX_REPAIR_ATTEMPTS)
    # How often the repair looks at the draining instance's tasks between stop-timeout deadlines.
    task_poll_interval: timedelta = timedelta(seconds=15)
    # How often the drain semaphore checks that its permit holders are still running while a repair waits for a
    # permit (ten times as long while none waits: a permit nobody waits for costs nothing).
    permit_reclaim_interval: timedelta = timedelta(minutes=1)
    # Liveness trackers for the group: one holds up to 20,000 instances; a larger group needs more (ceil(n/20,000)).
    liveness_shards: LivenessShards = 1
    # What AWS says of the group's instances (docs/operations.md, "What AWS says"), read by each worker every
    # aws_status_interval: an EC2 status check impaired this long, or the ECS agent disconnected this long, makes the
    # instance IMPAIRED; a scheduled event (retirement, stop, reboot, maintenance) gets it replaced this long before
    # the event's NotBefore.
    aws_status_interval: timedelta = timedelta(seconds=60)
    status_check_grace: timedelta = timedelta(minutes=3)
    agent_disconnect_grace: timedelta = timedelta(minutes=10)
    scheduled_event_lead: timedelta = timedelta(hours=24)
    # ECS DAEMON-scheduled services of the group's cluster that each instance must run (opt-in): one with no RUNNING
    # task on an instance, or an UNHEALTHY one, for daemon_task_grace makes DAEMON IMPAIRED there. Read per group,
    # every aws_status_interval; an instance ACTIVE for less than daemon_task_grace is not judged yet.
    daemon_services: list[EcsServiceName] = Field(default_factory=list, max_length=MAX_DAEMON_SERVICES)
    daemon_task_grace: timedelta = timedelta(minutes=5)
    # The breaker (docs/operations.md): no new drain permits once strictly more than max(min_impaired, n x
    # max_impaired_percent / 100) of the group's n instances became IMPAIRED within impaired_window.
    max_impaired_percent: ImpairedPercent = 30
    min_impaired: MinImpaired = 3
    impaired_window: timedelta = timedelta(minutes=30)
    # Replacements that fault this soon after taking over are counted (ReplacementFaultedEarly); this many within the
    # window hold the group's repairs like the breaker: replacing from a bad capacity pool makes things worse.
    replacement_fault_window: timedelta = timedelta(days=1)
    replacement_faults_to_hold: int = Field(default=3, ge=1, le=1000)
    # Optional: at most this many repairs granted in 24 hours, then repairs are held like the breaker holds them.
    max_repairs_per_day: int | None = Field(default=None, ge=1, le=MAX_REPAIRS_PER_DAY)
    # Optional: outside every window (UTC) only critical repairs run; none means any time.
    maintenance_windows: list[MaintenanceWindow] = Field(default_factory=list, max_length=50)
    # The remediation ladder (docs/operations.md): replace at once, or reboot first where NVIDIA says that works.
    remediation: Remediation = Remediation.REPLACE
    # Under reboot-first, a fault NVIDIA answers with RESET_GPU is reset through SSM Run Command (`nvidia-smi -r`)
    # instead of rebooting; off by default: the host needs the SSM agent and no process may hold the GPU.
    gpu_reset: bool = False
    # From the reboot (or reset) until the probe reports the new boot with every GPU source OK and the ECS agent is
    # connected; not back by then: the repair goes on to a replacement.
    reboot_timeout: timedelta = timedelta(minutes=20)
    # The fix's gate on the host itself (docs/operations.md §13), after a reset or reboot, through SSM Run Command:
    # `dcgmi diag -r <gate_diag_level>` where DCGM is installed (0: none), then gate_command if set (an NCCL test,
    # say; run as root, exit 0 passes). A host that has not answered within gate_timeout fails the gate.
    gate_diag_level: int = Field(default=1, ge=0, le=4)
    gate_command: str | None = Field(default=None, min_length=1, max_length=4096)
    gate_timeout: timedelta = timedelta(minutes=10)
    # The same GPU (the same instance, when the GPU cannot be told) faulting again this soon after a fix in place:
    # replaced, not rebooted again.
    escalation_window: timedelta = timedelta(hours=24)
    # A container instance whose probe has not reported this long after its health workflow started (at registration,
    # by the AWS watch) is unmonitored: INSUFFICIENT_DATA, and an InstanceUnmonitored event; never repaired for it.
    first_report_timeout: timedelta = timedelta(minutes=10)
    # An instance fixed in place this many times within fix_window is replaced at its next fault, whichever GPU: a
    # host that keeps needing reboots is failing, however each single fault looks.
    max_fixes_in_place: int = Field(default=3, ge=1, le=100)
    fix_window: timedelta = timedelta(days=7)
    # Evidence before a replacement terminates anything (docs/operations.md, "Evidence and quarantine"): the
    # findings and their kernel-log lines are stored under the incident in this bucket (none: nothing is stored),
    # and with bug_report the host's kernel log and `nvidia-bug-report.sh` through SSM Run Command, waited for at most
    # bug_report_timeout. With quarantine the impaired instance is stopped and kept, not terminated, for a hardware
    # investigation (it leaves the group: deregistered from ECS, its group tag moved to QUARANTINE_TAG).
    evidence_bucket: str | None = Field(default=None, min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]+$")
    evidence_prefix: str = Field(default="gpu-autorepair/", max_length=256)
    bug_report: bool = False
    bug_report_timeout: timedelta = timedelta(minutes=15)
    quarantine: bool = False
    # Where a replacement launches when its AZ has no capacity (docs/operations.md, "Where a replacement launches").
    # ODCRs and Capacity Blocks are AZ-bound: by default it stays in the impaired instance's subnet and keeps trying.
    allow_other_azs: bool = False
    # The subnets a replacement may move to (allow_other_azs; launch template groups: an Auto Scaling group picks
    # its own).
    subnets: list[str] = Field(default_factory=list, max_length=MAX_SUBNETS)
    # Capacity errors in a row in one subnet before a repair's next launch moves to another (allow_other_azs).
    capacity_errors_before_moving: int = Field(default=3, ge=1, le=100)
    # An AZ where a launch met a capacity error is avoided by the group's repairs this long, or until a launch there
    # succeeds (allow_other_azs).
    az_avoid_for: timedelta = timedelta(minutes=30)

    def max_draining(self, instance_count: int) -> int:
        """The drain cap, computed here only. ECS's rule: max(1, floor(n * pct / 100)); below 9 instances at 20%
        that is one at a time."""
        return max(1, instance_count * self.max_draining_percent // 100)

    def repair_retry_wait(self, failed: int) -> timedelta:
        """The wait before the next attempt once `failed` attempts in a row have failed (computed here only):
        repair_retry_delay, doubled for each failure after the first, at most MAX_REPAIR_RETRY_DELAY."""
        if failed < 1:
            return timedelta(0)
        doublings = min(failed - 1, MAX_REPAIR_ATTEMPTS)
        return min(self.repair_retry_delay * 2**doublings, MAX_REPAIR_RETRY_DELAY)

    @property
    def gates_on_host(self) -> bool:
        """Whether the fix's gate also runs on the host (DCGM's diagnostic, the operator's command)."""
        return bool(self.gate_diag_level or self.gate_command)

    @property
    def gates_replacement_on_host(self) -> bool:
        """Whether a replacement's gate also runs on the host: verify_replacement "on_host", and something to run."""
        return self.verify_replacement == VERIFY_ON_HOST and self.gates_on_host

    def breaker_rule(self) -> BreakerRule:
        return BreakerRule(
            max_impaired_percent=self.max_impaired_percent,
            min_impaired=self.min_impaired,
            impaired_window=self.impaired_window,
            replacement_fault_window=self.replacement_fault_window,
            replacement_faults_to_hold=self.replacement_faults_to_hold,
        )

    def settings_problems(self) -> list[tuple[str | None, str]]:
        problems: list[tuple[str | None, str]] = []
        problem = heartbeat_threshold_problem(self.heartbeat_loss_threshold, self.heartbeat_interval)
        if problem:
            problems.append(("heartbeat_loss_threshold", problem))
        if (problem := impaired_window_problem(self.impaired_window)) is not None:
            problems.append(("impaired_window", problem))
        if self.allow_other_azs and not self.subnets and self.launch_template:
            problems.append(("subnets", "allow_other_azs needs the group's subnets to move a replacement to"))
        if len(set(self.daemon_services)) != len(self.daemon_services):
            problems.append(("daemon_services", "daemon_services names a service more than once"))
        if self.bug_report and self.evidence_bucket is None:
            problems.append(("bug_report", "bug_report needs the group's evidence_bucket to upload the report to"))
        if self.repair_retry_delay > MAX_REPAIR_RETRY_DELAY:
            problems.append(
                (
                    "repair_retry_delay",
                    f"repair_retry_delay must be at most {format_seconds(MAX_REPAIR_RETRY_DELAY)}, "
                    f"not {format_seconds(self.repair_retry_delay)}",
                )
            )
        return problems


def impaired_window_problem(window: timedelta) -> str | None:
    if timedelta(0) < window <= MAX_IMPAIRED_WINDOW:
        return None
    return (
        f"impaired_window must be more than 0s and at most {format_seconds(MAX_IMPAIRED_WINDOW)}, "
        f"not {format_seconds(window)}"
    )


class GroupConfigOverrides(BaseModel):
    """What an operator changed on a running group; unset fields fall back to the worker's settings."""

    auto_repair: AutoRepair | None = None
    max_draining_percent: int | None = None
    heartbeat_loss_threshold: timedelta | None = None
    max_impaired_percent: int | None = None
    min_impaired: int | None = None
    impaired_window: timedelta | None = None
    max_repairs_per_day: int | None = None
    remediation: Remediation | None = None

    def apply(self, group: CapacityGroup) -> CapacityGroup:
        return group.model_copy(update=self.model_dump(exclude_none=True))


class GroupConfigUpdate(BaseModel):
    """`autorepair group update`: the fields to change (None: leave as is). Checked by the update's validator,
    not here, so that a bad value reaches the workflow and is refused there with a clear message."""

    auto_repair: AutoRepair | None = None
    max_draining_percent: int | None = None
    heartbeat_loss_threshold: timedelta | None = None
    max_impaired_percent: int | None = None
    min_impaired: int | None = None
    impaired_window: timedelta | None = None
    max_repairs_per_day: int | None = None
    remediation: Remediation | None = None
    # Drop every live override first (back to the worker's settings), then apply the fields above, if any.
    reset: bool = False
    # Let held repairs through again (the breaker never resets by itself); with discard_held, the held repairs are
    # let go instead and their instances must prove their fault again.
    resume: bool = False
    discard_held: bool = False
    requested_by: Name = ""

    def changes(self) -> GroupConfigOverrides:
        return GroupConfigOverrides.model_validate(
            self.model_dump(exclude={"requested_by", "reset", "resume", "discard_held"})
        )

    def problems(self, group: CapacityGroup | None = None) -> list[str]:
        """What is wrong with this update, for the operator; empty when it may be applied. `group`: the group's
        effective configuration now (settings + live overrides), to check the threshold against its
        heartbeat_interval; without it only the bounds are checked."""
        problems = []
        if not (self.reset or self.resume) and self.changes() == GroupConfigOverrides():
            problems.append(
                "nothing to change: give auto_repair, max_draining_percent, heartbeat_loss_threshold, "
                "max_impaired_percent, min_impaired, impaired_window, max_repairs_per_day, remediation, reset or resume"
            )
        if self.discard_held and not self.resume:
            problems.append("discard_held goes with resume: --resume --discard-held")
        impaired = self.max_impaired_percent
        if impaired is not None and not MIN_IMPAIRED_PERCENT <= impaired <= MAX_IMPAIRED_PERCENT:
            problems.append(
                f"max_impaired_percent must be between {MIN_IMPAIRED_PERCENT} and {MAX_IMPAIRED_PERCENT}, "
                f"not {impaired}"
            )
        if self.min_impaired is not None and not 0 <= self.min_impaired <= 100_000:
            problems.append(f"min_impaired must be between 0 and 100000, not {self.min_impaired}")
        if self.impaired_window is not None and (problem := impaired_window_problem(self.impaired_window)):
            problems.append(problem)
        budget = self.max_repairs_per_day
        if budget is not None and not 1 <= budget <= MAX_REPAIRS_PER_DAY:
            problems.append(f"max_repairs_per_day must be between 1 and {MAX_REPAIRS_PER_DAY}, not {budget}")
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
    updated_at: Timestamp | None = None
    updated_by: Name = ""
    revision: int = 0
