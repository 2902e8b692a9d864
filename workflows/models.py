"""The workflows' own state, the signals they send each other, and their query views.

What others send or start them with is in the contract (contract/). The health shapes use ECS's camelCase names on
purpose: the `healthStatus` an operator queries is the one DescribeContainerInstances returns.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field, model_validator

from contract.aws_status import AwsInstanceStatus
from contract.breaker import BreakerHold, BreakerView, FleetBreakerInput
from contract.formats import iso
from contract.groups import CapacityGroup, GroupConfigState
from contract.health import CheckType, HealthInput, HealthState
from contract.instances import ClearedFinding, Exclusion
from contract.limits import Id, OptionalId, Text, Timestamp, Token
from contract.liveness import IgnoreHeartbeats, LivenessInput
from contract.probe import GpuFinding, ProbeSourceHealth
from contract.repair import GpuVerdict, InPlaceFix, PhaseStep, RepairAction, RepairPhase
from contract.semaphore import PermitRequest, SemaphoreInput
from workflows.breaker import BreakerBook

# --- Health workflow -------------------------------------------------------------------------------------------


class HealthCheckResult(BaseModel):
    type: CheckType
    status: HealthState
    statusReason: str | None = None
    lastUpdated: Timestamp
    lastStatusChange: Timestamp


class ContainerInstanceHealthStatus(BaseModel):
    overallStatus: HealthState
    details: list[HealthCheckResult]


class RepairView(BaseModel):
    workflow_id: str
    phase: RepairPhase
    reason: str
    started_at: Timestamp
    replacement_instance_id: str | None = None
    error: str | None = None


class RepairRetry(BaseModel):
    """An instance's failed repairs in a row and what comes next: retried with backoff by its health workflow
    (workflows/health_repairs.py) until the group's max_repair_attempts, then left for an operator."""

    failed: int = 0  # attempts that failed since the incident began (or an operator's `instance repair`)
    max_attempts: int = 0  # the group's max_repair_attempts when the last one failed
    error: str | None = None  # the last failed attempt's
    next_at: Timestamp | None = None  # when the next attempt starts; None: none is waiting to
    reason: str | None = None  # the failed attempt's reason, which the next one repeats
    exhausted: bool = False  # every attempt allowed failed: nothing more until `autorepair instance repair`
    # A failed attempt's workflow id, told by its progress and not yet counted by the run loop; the last counted.
    to_count: str | None = None
    last_counted: str | None = None

    def afresh(self) -> RepairRetry:
        """Nothing failed (an operator's `instance repair` or `clear`); a failure already counted stays counted."""
        return RepairRetry(last_counted=self.last_counted)

    def text(self) -> str | None:
        """For describe-instances and the Web UI; None while nothing failed or a retry runs."""
        if self.exhausted:
            return f"repairs exhausted after {self.failed} attempts"
        if self.next_at is not None:
            return (
                f"repair failed ({self.error or 'no error given'}), next try at {iso(self.next_at, 'seconds')} "
                f"(attempt {self.failed + 1} of {self.max_attempts})"
            )
        return None


class AwsChecks(BaseModel):
    """What AWS said of the instance (workflows/health_aws_checks.py): the last picture, since when each part has
    been bad, and which impairments this workflow made of it."""

    last: AwsInstanceStatus | None = None  # the newest picture applied, told by the reader or confirmed
    # An EC2 status check went impaired then (insufficient-data in between does not end it; ok does), and the ECS
    # agent was first seen disconnected then: each grace runs from here, whatever reasons come and go meanwhile.
    status_bad_since: Timestamp | None = None
    agent_down_since: Timestamp | None = None
    # What this workflow made IMPAIRED: EC2_STATUS for a status check (when), or for a scheduled event (its key);
    # AGENT_CONNECTIVITY for the ECS agent (when). Set OK by anyone else (a clear, a fix in place): proven afresh.
    status_impaired_at: Timestamp | None = None
    event_impaired: str | None = None
    agent_impaired_at: Timestamp | None = None
    events_told: list[str] = Field(default_factory=list)  # published as ScheduledEventFound (newest kept)
    events_dismissed: list[str] = Field(default_factory=list)  # their impairment cleared: not repaired for again
    fix_seen: Timestamp | None = None  # the last fix in place (a reboot, a GPU reset) taken into account
    next_at: Timestamp | None = None  # a grace or a lead time ends: the run loop looks again
    next_what: str = ""
    look: bool = False  # a new picture: the run loop looks at once
    # The group's ECS daemon services AWS says are missing here, each since the first picture that said so, and those
    # this workflow put on DAEMON's down list (workflows/health_daemon_rules.py).
    daemons_missing_since: dict[str, datetime] = Field(default_factory=dict)
    daemons_impaired: list[str] = Field(default_factory=list)


class ClaimKind(StrEnum):
    TAKEN = "Taken"  # its repair is started, or about to be (the run loop reads the group first)
    WITHHELD = "Withheld"  # IMPAIRED but not repaired: the group's auto repair is DISABLED, or an operator excluded it


class RepairClaim(BaseModel):
    """The run loop's hold on an impairment: while there is one, no other repair is started for it."""

    kind: ClaimKind
    why: str = ""  # WITHHELD: why, in a phrase (`describe-instances` shows it as repairWithheld)
    since: Timestamp | None = None  # workflow time; None only when decoded from a run that did not keep it


class HealthCarry(BaseModel):
    """All state a health workflow carries across continue-as-new."""

    checks: dict[CheckType, HealthCheckResult] = Field(default_factory=dict)
    findings: list[GpuFinding] = Field(default_factory=list)
    seen_finding_ids: list[str] = Field(default_factory=list)
    warning_counts: dict[str, int] = Field(default_factory=dict, description="'<pci>/<reason>' -> count")
    started_at: Timestamp | None = None
    last_heartbeat: Timestamp | None = None
    repair: RepairView | None = None
    # Whether the run loop has taken this impairment, and since when: its repair started (or about to), or withheld
    # and why. Set and released only by InstanceHealth (workflows/instance_health.py); None: nothing taken.
    repair_claim: RepairClaim | None = None
    rejected_signals: int = 0
    # Signals that were well formed but not from who may send them (a repair_progress without our repair's token).
    forged_signals: int = 0
    # Entries the bounded state had to let go of (warning kinds, daemons down) since the workflow started.
    dropped_entries: int = 0
    # The token the repair we started puts in its progress (RepairInput.progress_token); never in a query.
    repair_token: str | None = None
    heartbeats_ignored_until: Timestamp | None = None
    # Why it retired without a repair (it left on purpose), if it did.
    retired_reason: str | None = None
    # A game day not yet passed to the liveness tracker.
    game_day_to_tell: IgnoreHeartbeats | None = None
    probe_sources: list[ProbeSourceHealth] = Field(default_factory=list)  # as the last heartbeat reported them
    # Reasons (DAEMON_<unit>) of critical daemons reported down and not yet back, oldest first.
    daemons_down: list[str] = Field(default_factory=list)
    # Reasons (CONTAINER_RUNTIME_<unit>) of critical container runtimes reported down or hung, oldest first.
    runtimes_down: list[str] = Field(default_factory=list)
    # Operator controls (workflows/health_controls.py): who excluded it from repair and why; the reason of a repair
    # an operator asked for and the run loop has not started yet; impairments operators cleared as false (bounded).
    excluded: Exclusion | None = None
    operator_repair: str | None = None
    cleared_findings: list[ClearedFinding] = Field(default_factory=list)
    # The breaker: this impairment was told to the group's semaphore (once per impairment, until back to OK); a
    # heartbeat loss to be judged afresh by the tracker (an operator cleared it, or its held repair was discarded).
    impairment_reported: bool = False
    # Left on purpose but may come back (retired_reason says why): nothing watched until heard from again.
    dormant: bool = False
    # An activity that failed (workflows/health_retry.py): how often in a row, what it said, when to try again.
    activity_failures: int = 0
    last_activity_error: Text | None = None
    retry_at: Timestamp | None = None
    recheck_loss: bool = False
    # The number of the last repair attempt started (its id: repair/<instance>/<n>), and the failed ones retried.
    repair_attempt: int = 0
    # The probe's boot as its last forwarded heartbeat said, and the last fix in place (workflows/health_ladder.py).
    boot_id: str | None = None
    last_in_place_fix: InPlaceFix | None = None
    # Every fix in place, newest last (at most MAX_FIXES_KEPT): the group's max_fixes_in_place rule counts them.
    in_place_fixes: list[InPlaceFix] = Field(default_factory=list)
    # NVIDIA's standing verdicts on the GPUs (one per GPU and verdict, the newest; at most MAX_VERDICTS_KEPT): they
    # choose a reboot-first repair's remedy (RepairInput.nvidia_verdicts).
    nvidia_verdicts: list[GpuVerdict] = Field(default_factory=list)
    # The GPUs the probe last said NVML enumerates, and how many the instance's type has (read once from EC2):
    # fewer seen than the type has impairs ACCELERATED_COMPUTE.
    # No report from its probe within first_report_timeout of the start (watched by AWS alone) until it reports.
    unmonitored: bool = False
    gpu_count: int | None = None
    instance_type: str | None = None
    expected_gpus: int | None = None
    expected_gpus_read: bool = False
    repair_retry: RepairRetry = Field(default_factory=RepairRetry)
    aws: AwsChecks = Field(default_factory=AwsChecks)

    @model_validator(mode="before")
    @classmethod
    def _claim_from_flags(cls, data: Any) -> Any:
        """Runs that continued-as-new before the claim carried it as two flags: `repair_requested` (taken) and
        `repair_withheld` (why not repaired, which implied taken). Their time was not kept: `since` stays unknown."""
        if not isinstance(data, dict) or not {"repair_requested", "repair_withheld"} & data.keys():
            return data
        data = dict(data)
        requested, withheld = data.pop("repair_requested", False), data.pop("repair_withheld", None)
        if "repair_claim" not in data:
            if withheld is not None:
                data["repair_claim"] = RepairClaim(kind=ClaimKind.WITHHELD, why=withheld)
            elif requested:
                data["repair_claim"] = RepairClaim(kind=ClaimKind.TAKEN)
        return data


class HealthRun(HealthInput):
    """A health workflow's input: what started it, and what an earlier run carried over (continue-as-new)."""

    carry: HealthCarry | None = None


class RepairStance(StrEnum):
    """Where an instance stands with repair, one answer to "why is it (not) being repaired?"."""

    NOT_NEEDED = "NotNeeded"  # nothing impaired, nothing asked
    DUE = "Due"  # the run loop starts its repair now
    STARTING = "Starting"  # its start was asked for
    REPAIRING = "Repairing"  # a repair runs
    BACKING_OFF = "BackingOff"  # starting it failed (an activity); tried again at `until`
    RETRY_WAITING = "RetryWaiting"  # a repair failed; the next attempt starts at `until`
    EXHAUSTED = "Exhausted"  # every attempt allowed failed: only an operator's `instance repair` starts another
    WITHHELD = "Withheld"  # its group's auto repair is DISABLED
    EXCLUDED = "Excluded"  # an operator excluded it
    DORMANT = "Dormant"  # it left on purpose and may come back
    RETIRED = "Retired"  # replaced, or gone for good


class RepairDecision(BaseModel):
    stance: RepairStance
    why: str = ""
    until: Timestamp | None = None
    since: Timestamp | None = None  # since when it stands so, where the state knows (withheld, starting, excluded, ...)


class InstanceHealthView(BaseModel):
    instance_id: str
    group: str
    healthStatus: ContainerInstanceHealthStatus
    recent_findings: list[GpuFinding]
    warning_counts: dict[str, int]
    repair: RepairView | None
    last_heartbeat: Timestamp | None
    rejected_signals: int
    retired: bool
    retired_reason: str | None = None
    forged_signals: int = 0
    dropped_entries: int = 0
    # Derived from repair_claim (its why, when WITHHELD), not carried: kept for the readers of this name
    # (`describe-instances`' repairWithheld, scripts, the tests).
    repair_withheld: str | None = None
    repair_claim: RepairClaim | None = None
    heartbeats_ignored_until: Timestamp | None = None
    probe_sources: list[ProbeSourceHealth] = Field(default_factory=list)
    # The tracker that knows when this instance was last heard (its `last_heard` query); None before the group is read.
    liveness_workflow_id: str | None = None
    last_activity_error: str | None = None
    excluded: Exclusion | None = None
    cleared_findings: list[ClearedFinding] = Field(default_factory=list)
    repair_retry: RepairRetry = Field(default_factory=RepairRetry)
    boot_id: str | None = None
    last_in_place_fix: InPlaceFix | None = None
    in_place_fixes: list[InPlaceFix] = Field(default_factory=list)
    nvidia_verdicts: list[GpuVerdict] = Field(default_factory=list)
    gpu_count: int | None = None
    expected_gpus: int | None = None
    # Derived from the state above (InstanceHealth.repair_decision): why it is, or is not, being repaired.
    repair_decision: RepairDecision | None = None


# --- Drain semaphore -------------------------------------------------------------------------------------------


class PermitRelease(BaseModel):
    holder_workflow_id: Id
    token: Token = ""  # the token of the holder's request: only the holder can give its permit back
    # The instance that took over from the repaired one, when the repair completed with a replacement: the semaphore
    # counts its fault within replacement_fault_window as early (ReplacementFaultedEarly).
    replacement_instance_id: OptionalId | None = None


class PermitGrant(BaseModel):
    group: Id
    holder_workflow_id: Id
    granted_at: Timestamp
    token: Token = ""  # the token of the request it answers: a repair takes no grant without its own
    # AZs where the group's launches met capacity errors lately: a repair that may move starts elsewhere.
    avoid_azs: list[str] = Field(default_factory=list)


class Permit(BaseModel):
    holder_workflow_id: str
    holder_run_id: str | None = None
    instance_id: str = ""
    since: Timestamp
    token: str = ""
    # The Auto Scaling group's new instance this repair claimed as its replacement (claim_replacement).
    replacement_instance_id: str | None = None


class SemaphoreRun(SemaphoreInput):
    """A drain semaphore's input: what started it, and what an earlier run carried over (continue-as-new)."""

    holders: list[Permit] = Field(default_factory=list)
    waiters: list[PermitRequest] = Field(default_factory=list)
    max_holders_seen: int = 0
    rejected_signals: int = 0
    forged_signals: int = 0
    dropped_requests: int = 0
    config: GroupConfigState | None = None
    breaker: BreakerBook | None = None
    fleet_hold: BreakerHold | None = None
    # AZ -> when a launch there last met a capacity error (workflows/semaphore_zones.py).
    launch_failures: dict[str, datetime] = Field(default_factory=dict)


class SemaphoreView(BaseModel):
    group: str
    capacity: int
    group_size: int
    holders: list[Permit]
    out_of_service: int = 0  # DRAINING without a permit: counted against the cap
    launch_failures: dict[str, datetime] = Field(default_factory=dict)  # AZ -> last capacity error
    waiters: list[PermitRequest]
    max_holders_seen: int
    rejected_signals: int
    forged_signals: int = 0
    dropped_requests: int = 0
    breaker: BreakerView = Field(default_factory=BreakerView)


# --- Liveness tracker ------------------------------------------------------------------------------------------


class ReporterSeen(BaseModel):
    """A reporter (one ingest or probe process) as the tracker last heard from it, by the tracker's clock."""

    last_at: Timestamp
    report_every: float  # seconds
    relay: bool = True


class LivenessCarry(BaseModel):
    """All state a liveness tracker carries across continue-as-new. Times are whole epoch seconds: compact, since
    a shard may hold 20,000 instances."""

    heard: dict[str, int] = Field(default_factory=dict, description="instance -> last receipt, reporters' clocks")
    lost: list[str] = Field(default_factory=list)
    ignored_until: dict[str, int] = Field(default_factory=dict)
    reporters: dict[str, ReporterSeen] = Field(default_factory=dict)
    last_report_at: Timestamp | None = None
    # The pipeline went silent (no batch for longer than reporters promised): nothing is declared meanwhile, and
    # after it speaks again nothing before `floor`, a full window later.
    silent_since: Timestamp | None = None
    floor: Timestamp | None = None
    # The last silence noticed (when batches came again, or a timer found the relays overdue): from the last
    # batch before it to the first after it (None while it lasts).
    last_silence_from: Timestamp | None = None
    last_silence_to: Timestamp | None = None
    group: CapacityGroup | None = None
    declared_lost: int = 0
    recovered: int = 0
    dropped_instances: int = 0
    forgotten: int = 0
    rejected_signals: int = 0


class LivenessRun(LivenessInput):
    carry: LivenessCarry | None = None


class LivenessView(BaseModel):
    group: str
    shard: int
    shards: int
    instances: int
    lost: list[str]
    window_s: float | None
    grace_s: float | None
    reporters: dict[str, ReporterSeen]
    last_report_at: Timestamp | None
    silent_since: Timestamp | None
    floor: Timestamp | None
    declared_lost: int
    last_silence_from: Timestamp | None = None
    last_silence_to: Timestamp | None = None
    recovered: int
    dropped_instances: int
    forgotten: int
    rejected_signals: int


# --- Repair workflow -------------------------------------------------------------------------------------------


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
    rejected_signals: int = 0
    forged_signals: int = 0
    # The remediation ladder: what was done (None: not decided yet), and why a rung was skipped or did not work.
    action: RepairAction | None = None
    escalated: str | None = None
    evidence: str | None = None  # the incident's evidence in S3, once stored


class RepairResult(BaseModel):
    instance_id: str
    replacement_instance_id: str | None = None  # None: fixed in place (action says how)
    tasks_stopped: int
    tasks_forced: int
    timeline: list[PhaseStep] = Field(default_factory=list)
    action: RepairAction = RepairAction.REPLACE
    escalated: str | None = None
    evidence: str | None = None


class FleetBreakerRun(FleetBreakerInput):
    """The fleet breaker's input: what an earlier run carried over (continue-as-new)."""

    book: BreakerBook | None = None
    group_sizes: dict[str, int] = Field(default_factory=dict)
    rejected_signals: int = 0
