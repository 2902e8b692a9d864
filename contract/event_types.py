"""Every event type's own fields, one model each: the typed constructor a workflow builds its event with, and what
the event's `detail` holds on the wire (contract/events.py wraps it in the envelope; docs/events/schemas/ has the
JSON Schema of each, generated from these by `python -m contract.event_schemas`).

The field names are the wire names, kept from the flat events of schema_version 1; no field shares a name with an
envelope key, so nothing in `detail` can be mistaken for the event's own id, type or time. Optional fields are always
sent, as null when there is nothing to say.
"""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, computed_field

from contract.breaker import BreakerHold, HoldCause
from contract.health import CheckType, HealthState
from contract.instances import ClearedFinding
from contract.limits import Timestamp
from contract.probe import GpuFinding
from contract.repair import PhaseStep, RepairAction


class EventType(StrEnum):
    HEALTH_CHANGED = "HealthChanged"
    REPAIR_STARTED = "RepairStarted"
    DRAIN_PERMIT_GRANTED = "DrainPermitGranted"
    DRAINING = "Draining"
    REPLACEMENT_LAUNCHED = "ReplacementLaunched"
    REPLACEMENT_LAUNCH_FAILED = "ReplacementLaunchFailed"
    REPLACEMENT_READY = "ReplacementReady"
    TASKS_STOPPED = "TasksStopped"
    TERMINATED = "Terminated"
    REPAIR_COMPLETED = "RepairCompleted"
    REPAIR_FAILED = "RepairFailed"
    DRAIN_PERMIT_RELEASED = "DrainPermitReleased"
    GROUP_CONFIG_CHANGED = "GroupConfigChanged"
    INSTANCE_RETIRED = "InstanceRetired"
    INSTANCE_RETURNED = "InstanceReturned"
    INSTANCE_UNMONITORED = "InstanceUnmonitored"
    INSTANCE_EXCLUDED = "InstanceExcluded"
    INSTANCE_INCLUDED = "InstanceIncluded"
    REPAIR_REQUESTED = "RepairRequested"
    FINDING_CLEARED = "FindingCleared"
    REPAIRS_HELD = "RepairsHeld"
    REPLACEMENT_FAULTED_EARLY = "ReplacementFaultedEarly"
    FIX_VERIFIED = "FixVerified"
    REPAIRS_RESUMED = "RepairsResumed"
    REPAIR_DISCARDED = "RepairDiscarded"
    REPLACEMENT_ABANDONED = "ReplacementAbandoned"
    GPU_RESET_STARTED = "GpuResetStarted"
    GPU_RESET_COMPLETED = "GpuResetCompleted"
    REBOOT_STARTED = "RebootStarted"
    REBOOT_COMPLETED = "RebootCompleted"
    ESCALATED = "Escalated"
    REPAIRS_EXHAUSTED = "RepairsExhausted"
    SCHEDULED_EVENT_FOUND = "ScheduledEventFound"
    EVIDENCE_STORED = "EvidenceStored"
    EVIDENCE_NOT_STORED = "EvidenceNotStored"
    QUARANTINED = "Quarantined"


class EventDetail(BaseModel):
    """One event type's own fields. Unknown keys are refused: a misspelt field is an error where the event is built."""

    # Every field is sent (null where there is nothing to say): the schema requires each.
    model_config = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True)

    TYPE: ClassVar[EventType]

    def wire(self) -> dict[str, Any]:
        """What a workflow hands the publish activity: the fields in JSON form, without the computed ones (those the
        activity adds again, so they do not fill the workflow's history twice)."""
        return self.model_dump(mode="json", exclude=set(type(self).model_computed_fields))


# --- Shapes of other roles' records, as events carry them. Extra keys pass: a record that gains a field must not make
# an event unbuildable inside a workflow (tests/test_event_schemas.py keeps the field lists equal).


class HealthCheck(BaseModel):
    """One of the instance's health checks, as ECS's healthStatus.details names them (workflows/models.py's
    HealthCheckResult)."""

    model_config = ConfigDict(extra="allow", json_schema_serialization_defaults_required=True)

    type: CheckType
    status: HealthState
    statusReason: str | None = None
    lastUpdated: Timestamp
    lastStatusChange: Timestamp


class GateResult(BaseModel):
    """One check of the gate a fix or a replacement passes (workflows/fix_gate.py's GateCheck)."""

    model_config = ConfigDict(extra="allow", json_schema_serialization_defaults_required=True)

    name: str
    passed: bool
    detail: str = ""


class ConfigChange(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True)

    old: Any = None
    new: Any = None


# --- From an instance's health workflow (health/<instance-id>) --------------------------------------------------------


class HealthChanged(EventDetail):
    """The instance's health changed: ECS's healthStatus, and the GPU finding behind an impairment."""

    TYPE = EventType.HEALTH_CHANGED
    overall_status: HealthState
    details: list[HealthCheck]
    finding: GpuFinding | None = None

    # ECS's "Container Instance Health Change" event says healthChecks and overallStatus where its API says details
    # and overallStatus: a consumer written for ECS's event reads ours at the same place.
    @computed_field  # type: ignore[prop-decorator]
    @property
    def healthChecks(self) -> list[HealthCheck]:
        return self.details

    @computed_field  # type: ignore[prop-decorator]
    @property
    def overallStatus(self) -> HealthState:
        return self.overall_status


class InstanceUnmonitored(EventDetail):
    """A member whose probe has not reported within first_report_timeout of its health workflow's start."""

    TYPE = EventType.INSTANCE_UNMONITORED
    first_report_timeout: str


class InstanceRetired(EventDetail):
    """The instance left on purpose (not by a repair): watched no more (may_return: until heard from again)."""

    TYPE = EventType.INSTANCE_RETIRED
    reason: str
    may_return: bool


class InstanceReturned(EventDetail):
    """A dormant instance was heard from again: watched as before."""

    TYPE = EventType.INSTANCE_RETURNED
    left_because: str | None = None


class OperatorControl(EventDetail):
    """An operator's per-instance control (contract/instances.py)."""

    requested_by: str
    reason: str


class InstanceExcluded(OperatorControl):
    """The instance is excluded from repair (still watched); `repair` says what became of a running repair."""

    TYPE = EventType.INSTANCE_EXCLUDED
    repair_workflow_id: str | None = None
    repair: str | None = None  # what became of a running repair


class InstanceIncluded(OperatorControl):
    """The instance may be repaired again; the exclusion it ends, and whether its repair starts now."""

    TYPE = EventType.INSTANCE_INCLUDED
    excluded_by: str
    excluded_reason: str
    excluded_since: Timestamp
    repair_re_armed: bool


class RepairRequested(OperatorControl):
    """An operator asked for a repair now (through the drain cap); the repair's own events follow."""

    TYPE = EventType.REPAIR_REQUESTED
    overall_status: HealthState


class FindingCleared(OperatorControl):
    """An operator cleared a false finding: its checks back to OK, the finding kept as cleared."""

    TYPE = EventType.FINDING_CLEARED
    cleared: list[ClearedFinding]
    repair_workflow_id: str | None = None
    repair: str | None = None


class ScheduledEventFound(EventDetail):
    """EC2 scheduled an event that takes the instance away; published once, when first seen."""

    TYPE = EventType.SCHEDULED_EVENT_FOUND
    code: str
    ec2_event_id: str = Field(description="EC2's id of the scheduled event (instance-event-...)")
    description: str
    deadline: Timestamp = Field(description="EC2's NotBefore")
    not_after: Timestamp | None = None
    repair_at: Timestamp = Field(description="When the repair starts: scheduled_event_lead before the deadline")


class RepairsExhausted(EventDetail):
    """Every repair attempt the group allows failed: nothing more until an operator's `autorepair instance repair`."""

    TYPE = EventType.REPAIRS_EXHAUSTED
    attempts: int
    max_repair_attempts: int
    error: str | None = None
    reason: str | None = None
    repair_workflow_id: str


# --- From a repair (repair/<instance-id>/<n>) -------------------------------------------------------------------------


class RepairStarted(EventDetail):
    """A repair started, for `reason`."""

    TYPE = EventType.REPAIR_STARTED
    reason: str


class DrainPermitGranted(EventDetail):
    """The group's drain semaphore granted the repair a permit."""

    TYPE = EventType.DRAIN_PERMIT_GRANTED


class Draining(EventDetail):
    """The instance is DRAINING in ECS: no new tasks are placed on it."""

    TYPE = EventType.DRAINING


class DrainPermitReleased(EventDetail):
    """The repair handed its drain permit back (only if one was granted)."""

    TYPE = EventType.DRAIN_PERMIT_RELEASED


class ReplacementLaunched(EventDetail):
    """A replacement was launched, in the impaired instance's AZ where it can be."""

    TYPE = EventType.REPLACEMENT_LAUNCHED
    replacement_instance_id: str
    attempt: int


class ReplacementLaunchFailed(EventDetail):
    """A launch failed; it is tried again after `retry_in_seconds`."""

    TYPE = EventType.REPLACEMENT_LAUNCH_FAILED
    error: str
    attempt: int
    retry_in_seconds: int
    availability_zone: str | None = None  # the AZ out of capacity, and where the next try goes
    next_try: str | None = None


class ReplacementReady(EventDetail):
    """The replacement is ACTIVE in ECS (and passed the gate where the group verifies replacements)."""

    TYPE = EventType.REPLACEMENT_READY
    replacement_instance_id: str
    attempt: int  # 0: an earlier attempt's replacement, adopted
    adopted: bool = False
    checks: list[GateResult] | None = None  # the replacement's gate, where the group verifies replacements


class ReplacementAbandoned(EventDetail):
    """A replacement not ready in time was terminated; another is launched unless `attempts_left` is 0."""

    TYPE = EventType.REPLACEMENT_ABANDONED
    attempt: int
    replacement_instance_id: str
    why: str
    error: str
    attempts_left: int


class TasksStopped(EventDetail):
    """The instance's tasks stopped, each within its stop timeout or at it (`forced`)."""

    TYPE = EventType.TASKS_STOPPED
    tasks: int
    forced: int  # stopped at their stop timeout


class Terminated(EventDetail):
    """The impaired instance was terminated."""

    TYPE = EventType.TERMINATED
    evidence: str | None = None  # s3://... where the group keeps evidence and it was stored


class RepairCompleted(EventDetail):
    """The repair is done: replaced, or fixed in place (`action`)."""

    TYPE = EventType.REPAIR_COMPLETED
    replacement_instance_id: str | None = None  # None: fixed in place
    reason: str
    action: RepairAction
    timeline: list[PhaseStep]
    evidence: str | None = None


class RepairFailed(EventDetail):
    """The repair failed or was cancelled; the instance was not replaced."""

    TYPE = EventType.REPAIR_FAILED
    error: str
    reason: str
    timeline: list[PhaseStep]


class RepairDiscarded(RepairFailed):
    """A held repair let go by `--resume --discard-held`: its instance was never touched."""

    TYPE = EventType.REPAIR_DISCARDED


class LadderStep(EventDetail):
    """The remediation ladder's events say which fault they act on."""

    reason: str
    gpu: str | None = None  # the finding's PCI address
    nvidia_action: str | None = None


class GpuResetStarted(LadderStep):
    """The remediation ladder's GPU reset was sent (SSM Run Command `command_id`)."""

    TYPE = EventType.GPU_RESET_STARTED
    command_id: str


class GpuResetCompleted(LadderStep):
    """The GPU is back and its sources OK."""

    TYPE = EventType.GPU_RESET_COMPLETED
    took_seconds: int


class RebootStarted(LadderStep):
    """The remediation ladder rebooted the instance."""

    TYPE = EventType.REBOOT_STARTED
    boot_id_before: str | None = None
    token: str


class RebootCompleted(LadderStep):
    """The probe heartbeats from a new boot, its GPUs OK, the ECS agent connected."""

    TYPE = EventType.REBOOT_COMPLETED
    took_seconds: int


class FixVerified(LadderStep):
    """The gate a fix in place passes before the instance returns to work; failed, the repair escalates."""

    TYPE = EventType.FIX_VERIFIED
    passed: bool
    checks: list[GateResult]


class Escalated(LadderStep):
    """A rung of the remediation ladder was skipped or did not work: the repair goes on with `to_action`."""

    TYPE = EventType.ESCALATED
    from_action: RepairAction
    to_action: RepairAction
    why: str


class EvidenceStored(EventDetail):
    """The incident's evidence was stored in S3 before the instance was touched."""

    TYPE = EventType.EVIDENCE_STORED
    reason: str
    evidence: str
    objects: list[str]
    missing: dict[str, str]  # object -> why it is not there
    complete: bool


class EvidenceNotStored(EventDetail):
    """The evidence could not be stored; the repair went on without it."""

    TYPE = EventType.EVIDENCE_NOT_STORED
    reason: str
    why: str


class Quarantined(EventDetail):
    """The impaired instance was stopped and kept, in place of its termination."""

    TYPE = EventType.QUARANTINED
    previous_state: str | None = None
    kept: bool  # false: someone terminated it first
    evidence: str | None = None


# --- From a group's drain semaphore, or the fleet breaker (group "*"); instance_id is empty ---------------------------


class GroupConfigChanged(EventDetail):
    """An operator changed the group's live configuration: each changed field's old and new value."""

    TYPE = EventType.GROUP_CONFIG_CHANGED
    requested_by: str
    revision: int
    changes: dict[str, ConfigChange]
    old: dict[str, Any]
    new: dict[str, Any]


class RepairsHeld(EventDetail):
    """The breaker's hold (contract/breaker.py's BreakerHold), and what it holds."""

    TYPE = EventType.REPAIRS_HELD
    cause: HoldCause
    message: str
    tripped_at: Timestamp
    count: int
    threshold: float
    window: timedelta
    instances: list[str] = Field(default_factory=list)
    held_repairs: list[str] | None = None  # a group's: the repairs waiting for a permit
    groups: list[str] | None = None  # the fleet breaker's: the groups it holds

    @classmethod
    def of(
        cls, hold: BreakerHold, *, held_repairs: list[str] | None = None, groups: list[str] | None = None
    ) -> RepairsHeld:
        return cls(**hold.model_dump(), held_repairs=held_repairs, groups=groups)


class ReplacementFaultedEarly(EventDetail):
    """A replacement faulted soon after taking over: counted toward holding the group's repairs."""

    TYPE = EventType.REPLACEMENT_FAULTED_EARLY
    replacement_instance_id: str
    took_over_at: Timestamp
    faulted_at: Timestamp
    reason: str
    faulted_early: int
    replacement_faults_to_hold: int
    replacement_fault_window: str


class RepairsResumed(EventDetail):
    """An operator resumed repairs the breaker held."""

    TYPE = EventType.REPAIRS_RESUMED
    requested_by: str
    discard_held: bool
    held: BreakerHold | None = None  # the hold it ended
    repairs: list[str] | None = None  # a group's: the repairs held then


DETAILS: dict[EventType, type[EventDetail]] = {
    model.TYPE: model
    for model in (
        HealthChanged,
        InstanceUnmonitored,
        InstanceRetired,
        InstanceReturned,
        InstanceExcluded,
        InstanceIncluded,
        RepairRequested,
        FindingCleared,
        ScheduledEventFound,
        RepairsExhausted,
        RepairStarted,
        DrainPermitGranted,
        Draining,
        DrainPermitReleased,
        ReplacementLaunched,
        ReplacementLaunchFailed,
        ReplacementReady,
        ReplacementAbandoned,
        TasksStopped,
        Terminated,
        RepairCompleted,
        RepairFailed,
        RepairDiscarded,
        GpuResetStarted,
        GpuResetCompleted,
        RebootStarted,
        RebootCompleted,
        FixVerified,
        Escalated,
        EvidenceStored,
        EvidenceNotStored,
        Quarantined,
        GroupConfigChanged,
        RepairsHeld,
        ReplacementFaultedEarly,
        RepairsResumed,
    )
}
