"""Inputs, signals and query results of the workflows.

Every model here crosses a process boundary (probe -> Temporal -> worker -> CLI), so each one is a pydantic model
that the pydantic data converter turns into JSON. The health shapes use ECS's camelCase names on purpose: the
`healthStatus` an operator queries is the one DescribeContainerInstances returns.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum

from pydantic import BaseModel, Field


class HealthState(StrEnum):
    OK = "OK"
    IMPAIRED = "IMPAIRED"
    INSUFFICIENT_DATA = "INSUFFICIENT_DATA"
    INITIALIZING = "INITIALIZING"


# Most severe first: the overall status is the most severe detail.
SEVERITY = [HealthState.IMPAIRED, HealthState.INSUFFICIENT_DATA, HealthState.INITIALIZING, HealthState.OK]


class CheckType(StrEnum):
    ACCELERATED_COMPUTE = "ACCELERATED_COMPUTE"
    AGENT_CONNECTIVITY = "AGENT_CONNECTIVITY"
    CONTAINER_RUNTIME = "CONTAINER_RUNTIME"
    DAEMON = "DAEMON"


class AutoRepair(StrEnum):
    ENABLED = "ENABLED"
    DISABLED = "DISABLED"


class RepairPhase(StrEnum):
    WAITING_FOR_PERMIT = "WaitingForPermit"
    DRAINING = "Draining"
    LAUNCHING_REPLACEMENT = "LaunchingReplacement"
    WAITING_FOR_REPLACEMENT = "WaitingForReplacement"
    STOPPING_TASKS = "StoppingTasks"
    TERMINATING = "Terminating"
    COMPLETED = "Completed"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


# --- What the node probe sends -------------------------------------------------------------------------------


class GpuRef(BaseModel):
    """Which GPU a finding is about. NVML and the kernel log both name it by PCI address; NVML adds the UUID."""

    pci: str | None = None  # dddd:bb:dd, lower case, no function
    uuid: str | None = None
    mig_gpu_instance: int | None = None
    mig_compute_instance: int | None = None


class GpuFinding(BaseModel):
    """One classified GPU fault on one instance (a burst of identical lines arrives as one finding with a count)."""

    finding_id: str = Field(min_length=1, description="Stable id: a redelivered finding is recognised and dropped")
    instance_id: str = Field(min_length=1)
    group: str = Field(min_length=1)
    kind: str = Field(
        min_length=1, description="xid, sxid, gpu_fallen_off_bus, gpu_init_failed, nvml, dcgm, daemon, daemon_recovered"
    )
    code: int | None = None
    reason: str = Field(min_length=1, description="ECS-style status reason, e.g. XID_79")
    impairs: bool
    rule: str = ""
    source: str = ""
    gpu: GpuRef = Field(default_factory=GpuRef)
    message: str = ""
    raw: str = ""
    count: int = Field(default=1, ge=1)
    observed_at: datetime


class ProbeSourceHealth(BaseModel):
    """One source of the node probe (kmsg, nvml, dcgm, daemons, ...) as it last reported itself."""

    name: str
    state: HealthState  # OK, or INSUFFICIENT_DATA while it cannot see what it watches
    reason: str | None = None
    gpu_source: bool = True  # False for the daemons check: its being down says nothing about the GPUs


class Heartbeat(BaseModel):
    instance_id: str = Field(min_length=1)
    group: str = Field(min_length=1)
    sent_at: datetime
    # INSUFFICIENT_DATA while any GPU source of the probe is down: a fault only it would see could be missed, and
    # not knowing is never a reason to impair.
    gpu_health: HealthState = HealthState.OK
    gpu_health_reason: str | None = None
    sources: list[ProbeSourceHealth] = Field(default_factory=list)


class HeartbeatLossInjection(BaseModel):
    """Game day: the health workflow ignores heartbeats for `duration`, exactly as if the probe were silent."""

    duration: timedelta = Field(gt=timedelta(0))
    requested_by: str = ""


class RepairProgress(BaseModel):
    """The repair workflow keeps the instance's health workflow told of where it is."""

    workflow_id: str
    phase: RepairPhase
    replacement_instance_id: str | None = None
    error: str | None = None
    finished: bool = False


# --- Health workflow -------------------------------------------------------------------------------------------


class HealthCheckResult(BaseModel):
    type: CheckType
    status: HealthState
    statusReason: str | None = None
    lastUpdated: datetime
    lastStatusChange: datetime


class ContainerInstanceHealthStatus(BaseModel):
    overallStatus: HealthState
    details: list[HealthCheckResult]


class RepairView(BaseModel):
    workflow_id: str
    phase: RepairPhase
    reason: str
    started_at: datetime
    replacement_instance_id: str | None = None
    error: str | None = None


class HealthCarry(BaseModel):
    """All state a health workflow carries across continue-as-new."""

    checks: dict[CheckType, HealthCheckResult] = Field(default_factory=dict)
    findings: list[GpuFinding] = Field(default_factory=list)
    seen_finding_ids: list[str] = Field(default_factory=list)
    warning_counts: dict[str, int] = Field(default_factory=dict, description="'<pci>/<reason>' -> count")
    started_at: datetime | None = None
    last_heartbeat: datetime | None = None
    repair: RepairView | None = None
    repair_requested: bool = False
    rejected_signals: int = 0
    # Why an IMPAIRED instance is not being repaired (auto repair DISABLED); cleared when the group is re-ENABLED.
    repair_withheld: str | None = None
    heartbeats_ignored_until: datetime | None = None
    probe_sources: list[ProbeSourceHealth] = Field(default_factory=list)  # as the last heartbeat reported them
    # Reasons (DAEMON_<unit>) of critical daemons reported down and not yet back, oldest first.
    daemons_down: list[str] = Field(default_factory=list)


class HealthInput(BaseModel):
    instance_id: str
    group: str
    carry: HealthCarry | None = None


class InstanceHealthView(BaseModel):
    instance_id: str
    group: str
    healthStatus: ContainerInstanceHealthStatus
    recent_findings: list[GpuFinding]
    warning_counts: dict[str, int]
    repair: RepairView | None
    last_heartbeat: datetime | None
    rejected_signals: int
    retired: bool
    repair_withheld: str | None = None
    heartbeats_ignored_until: datetime | None = None
    probe_sources: list[ProbeSourceHealth] = Field(default_factory=list)


# --- Drain semaphore -------------------------------------------------------------------------------------------


class PermitRequest(BaseModel):
    holder_workflow_id: str = Field(min_length=1)
    holder_run_id: str | None = None
    instance_id: str = ""
    requested_at: datetime | None = None


class PermitRelease(BaseModel):
    holder_workflow_id: str = Field(min_length=1)


class PermitGrant(BaseModel):
    group: str
    holder_workflow_id: str
    granted_at: datetime


class Permit(BaseModel):
    holder_workflow_id: str
    holder_run_id: str | None = None
    instance_id: str = ""
    since: datetime


class SemaphoreInput(BaseModel):
    group: str
    holders: list[Permit] = Field(default_factory=list)
    waiters: list[PermitRequest] = Field(default_factory=list)
    max_holders_seen: int = 0
    rejected_signals: int = 0
    config: GroupConfigState | None = None


class SemaphoreView(BaseModel):
    group: str
    capacity: int
    group_size: int
    holders: list[Permit]
    waiters: list[PermitRequest]
    max_holders_seen: int
    rejected_signals: int


# --- Repair workflow -------------------------------------------------------------------------------------------


class RepairInput(BaseModel):
    instance_id: str
    group: str
    reason: str
    finding: GpuFinding | None = None


class PhaseStep(BaseModel):
    phase: RepairPhase
    started_at: datetime


class RepairStatus(BaseModel):
    """What an operator asks of a repair, running or closed: where it is, and how long each phase took."""

    workflow_id: str
    instance_id: str
    group: str
    reason: str
    phase: RepairPhase
    replacement_instance_id: str | None = None
    error: str | None = None
    timeline: list[PhaseStep] = Field(default_factory=list)


class RepairResult(BaseModel):
    instance_id: str
    replacement_instance_id: str
    tasks_stopped: int
    tasks_forced: int
    timeline: list[PhaseStep] = Field(default_factory=list)


# --- Capacity groups -------------------------------------------------------------------------------------------


class CapacityGroup(BaseModel):
    """One capacity group (ECS's capacity provider): the unit of the drain cap and of the auto-repair switch."""

    name: str = Field(min_length=1)
    cluster: str = Field(min_length=1, description="ECS cluster the group's container instances register with")
    launch_template: str | None = Field(default=None, description="Launch template name or id for replacements")
    launch_template_version: str = "$Latest"
    auto_scaling_group: str | None = None
    auto_repair: AutoRepair = AutoRepair.ENABLED
    max_draining_percent: int = Field(default=20, ge=1, le=100)
    heartbeat_loss_threshold: timedelta = timedelta(minutes=10)
    # How long a replacement may take from launch to ACTIVE in ECS before the wait is retried.
    replacement_ready_timeout: timedelta = timedelta(minutes=20)
    # How often the repair looks at the draining instance's tasks between stop-timeout deadlines.
    task_poll_interval: timedelta = timedelta(seconds=15)
    # How often the drain semaphore checks that its permit holders are still running.
    permit_reclaim_interval: timedelta = timedelta(minutes=1)

    def max_draining(self, instance_count: int) -> int:
        """ECS's cap: max(1, floor(n * pct / 100)); below 9 instances at 20% that is one at a time."""
        return drain_cap(instance_count, self.max_draining_percent)


def drain_cap(instance_count: int, percent: int) -> int:
    return max(1, instance_count * percent // 100)


# --- Live group configuration (held by the group's drain semaphore) -----------------------------------------

MAX_HEARTBEAT_LOSS_THRESHOLD = timedelta(days=1)


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
    requested_by: str = ""

    def changes(self) -> GroupConfigOverrides:
        return GroupConfigOverrides.model_validate(self.model_dump(exclude={"requested_by", "reset"}))

    def problems(self) -> list[str]:
        problems = []
        if not self.reset and self.changes() == GroupConfigOverrides():
            problems.append(
                "nothing to change: give auto_repair, max_draining_percent, heartbeat_loss_threshold or reset"
            )
        if self.max_draining_percent is not None and not 1 <= self.max_draining_percent <= 100:
            problems.append(f"max_draining_percent must be between 1 and 100, not {self.max_draining_percent}")
        threshold = self.heartbeat_loss_threshold
        if threshold is not None and not timedelta(0) < threshold <= MAX_HEARTBEAT_LOSS_THRESHOLD:
            problems.append(
                f"heartbeat_loss_threshold must be more than 0s and at most {MAX_HEARTBEAT_LOSS_THRESHOLD}, "
                f"not {threshold}"
            )
        return problems


class GroupConfigState(BaseModel):
    """The semaphore's `group_config` query and `update_group` result: the overrides, and the effective
    configuration as the semaphore last read it (worker settings + overrides; None before its first read)."""

    group: str
    overrides: GroupConfigOverrides = Field(default_factory=GroupConfigOverrides)
    effective: CapacityGroup | None = None
    updated_at: datetime | None = None
    updated_by: str = ""
    revision: int = 0


# The semaphore keeps its GroupConfigState in this memo key, so that a run started after an operator terminated the
# last one can take the live overrides over (WorkflowOps.previous_group_config).
GROUP_CONFIG_MEMO = "group_config"


class PreviousGroupConfig(BaseModel):
    """The live configuration an earlier, closed run of the group's semaphore left in its memo (None: none)."""

    state: GroupConfigState | None = None
    run_id: str = ""


class GroupCapacity(BaseModel):
    group: str
    instance_count: int
    max_draining: int
