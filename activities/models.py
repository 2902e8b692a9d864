"""Inputs and outputs of the activities, and the events they publish."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field, field_validator

from contract.breaker import ImpairmentReport

# The events are the contract's (contract/events.py): re-exported for those that import them from here.
from contract.event_types import EventType as EventType
from contract.events import BREAKER_DETAIL_TYPE as BREAKER_DETAIL_TYPE
from contract.events import CONTROL_DETAIL_TYPE as CONTROL_DETAIL_TYPE
from contract.events import GROUP_DETAIL_TYPE as GROUP_DETAIL_TYPE
from contract.events import HEALTH_DETAIL_TYPE as HEALTH_DETAIL_TYPE
from contract.events import REPAIR_DETAIL_TYPE as REPAIR_DETAIL_TYPE
from contract.events import Event
from contract.groups import GroupConfigOverrides, GroupConfigState
from contract.probe import GpuFinding, ProbeSourceHealth
from contract.repair import MAX_VERDICTS_KEPT, GpuVerdict, RepairInput, RepairProgress

# The publish activity's input: an event as its workflow built it.
FleetEvent = Event

# A repair's news goes out in batches of at most this many events (workflows/repair_context.py): what one
# `publish_news` publishes one after another within its timeout.
MAX_NEWS_EVENTS = 16


class RepairNews(BaseModel):
    """What a repair made known since its last batch went out: its events, in the order its steps made them, and its
    latest progress for the instance's health workflow (each progress carries the whole state, so the latest is all
    the health workflow needs)."""

    events: list[Event] = Field(default_factory=list, max_length=MAX_NEWS_EVENTS)
    progress: RepairProgress | None = None
    health_workflow_id: str = ""
    # Made by the workflow, so a retried activity signals with the same id and Temporal drops the second signal.
    signal_request_id: str = ""


class GroupRef(BaseModel):
    group: str


class GroupCapacityRequest(BaseModel):
    group: str
    # The drain semaphore's live overrides: the cap follows from the settings with these applied.
    overrides: GroupConfigOverrides = Field(default_factory=GroupConfigOverrides)
    # Their DRAINING is a repair's own: counted by its permit, not again as out of service.
    held_instance_ids: list[str] = Field(default_factory=list)


class GroupCapacity(BaseModel):
    group: str
    instance_count: int
    max_draining: int
    # Members DRAINING in ECS that no permit covers: a failed repair's instance, or one an operator drained.
    out_of_service: int = 0
    out_of_service_ids: list[str] = Field(default_factory=list)  # the first OUT_OF_SERVICE_IDS_MAX of them


class PreviousGroupConfig(BaseModel):
    """The live configuration an earlier, closed run of the group's semaphore left in its memo (None: none)."""

    state: GroupConfigState | None = None
    run_id: str = ""


class GroupConfigRequest(BaseModel):
    group: str
    # The drain semaphore holds the overrides and applies them itself: it asks for the settings alone.
    live_overrides: bool = True


class InstancesGoneRequest(BaseModel):
    group: str  # its ECS cluster is where a deregistration is looked for
    instance_ids: list[str]


class GoneCause(StrEnum):
    """Why a silent instance counts as having left on purpose: the strongest of what the reads said."""

    EC2_TERMINATED = "ec2_terminated"  # shutting-down or terminated in EC2
    EC2_STOPPED = "ec2_stopped"  # stopping or stopped in EC2 (a repair never stops an instance)
    ASG_LEAVING = "asg_leaving"  # scale-in, lifecycle hook, detach or standby in its Auto Scaling group
    ECS_DEREGISTERED = "ecs_deregistered"  # no longer registered in its group's ECS cluster
    SPOT_INTERRUPTION = "spot_interruption"  # its Spot request says EC2 is taking it back
    CAPACITY_BLOCK_ENDING = "capacity_block_ending"  # its Capacity Block ended or is about to
    # A cause a newer worker knows and this one does not: still gone, since only a gone instance is reported.
    OTHER = "other"


class GoneInstance(BaseModel):
    instance_id: str
    # EC2's state name: shutting-down, terminated, stopping, stopped; or pending/running when another service (Auto
    # Scaling, ECS, Spot, the Capacity Block) says the instance is leaving.
    state: str
    # Human-readable, strongest cause first, e.g. EC2's StateTransitionReason ("User initiated (2026-12-01 10:00:00
    # GMT)") or "Auto Scaling group g6-asg has it Standby: put in standby".
    reason: str = ""
    # Payloads of older workers have none: they only ever reported instances terminated or shutting down in EC2.
    cause: GoneCause = GoneCause.EC2_TERMINATED

    @field_validator("cause", mode="before")
    @classmethod
    def _lenient_cause(cls, value: object) -> object:
        # Lenient on the wire: an unknown cause must not make a whole batch of departures undecodable.
        try:
            return GoneCause(value) if isinstance(value, str) else GoneCause.OTHER
        except ValueError:
            return GoneCause.OTHER


class InstancesGone(BaseModel):
    """Of the instances asked about, those that left on purpose (GoneCause says which way)."""

    gone: list[GoneInstance] = Field(default_factory=list)


class InstanceRef(BaseModel):
    group: str
    instance_id: str


class KnownInstance(InstanceRef):
    """An instance and, where the workflow knows it (set_draining's answer, the replacement's wait's), its container
    instance: described by ARN, one call on the repair's path, instead of found by a list and a describe. An ARN that
    is no longer the instance's connected registration (its agent registered anew, say) is found again."""

    container_instance_arn: str | None = None


class DrainResult(BaseModel):
    container_instance_arn: str
    availability_zone: str | None = None
    subnet_id: str | None = None


class LaunchRequest(BaseModel):
    group: str
    impaired_instance_id: str
    availability_zone: str | None = None
    subnet_id: str | None = None
    # Same token on every retry of one replacement attempt (a new one per attempt): a retried launch returns the
    # instance that attempt already launched, never one an earlier attempt gave up on.
    client_token: str = Field(min_length=1, max_length=64)
    # The workflow's first try with this token: no launch can have used it yet, so the first attempt of the activity
    # launches without looking for one first. False (a retry, or a payload of an older workflow): it looks.
    first_try: bool = False


class SubnetZonesRequest(BaseModel):
    subnet_ids: list[str]


class SubnetZones(BaseModel):
    zones: dict[str, str]  # subnet id -> its AZ; a subnet EC2 does not know is left out


class ExpectedGpus(BaseModel):
    """How many GPUs the instance's type has, as EC2 says (DescribeInstanceTypes' GpuInfo)."""

    instance_type: str | None = None  # None: EC2 does not know the instance (any more)
    gpus: int | None = None  # None: the type has no GPU information


class LaunchResult(BaseModel):
    replacement_instance_id: str
    already_existed: bool = False


class ContainerInstanceRef(BaseModel):
    container_instance_arn: str


class TaskInfo(BaseModel):
    task_arn: str
    stop_timeout_seconds: int


class InstanceTasks(BaseModel):
    tasks: list[TaskInfo]


class TasksWait(KnownInstance):
    """Wait while the instance's tasks stop, looking every `poll_seconds`: answered at `until` (the next stop timeout),
    or at once when no task is left or one starts that the workflow has not seen (its stop timeout is its own)."""

    until: datetime
    known: list[str] = Field(default_factory=list)
    poll_seconds: float = Field(gt=0)


class StopTasksRequest(BaseModel):
    group: str
    task_arns: list[str]
    reason: str


class StopTasksResult(BaseModel):
    stopped: int


class TerminateResult(BaseModel):
    previous_state: str | None = None
    already_terminated: bool = False


class StartRepairRequest(BaseModel):
    repair: RepairInput
    summary: str = Field(description="One line for the Web UI's list view")
    # The progress token of this instance's earlier repair, which ended without replacing it (withdrawn by an
    # operator's control, or failed): a new repair may then run under the same id. Empty: never a second repair.
    # Only for a repair under the legacy id (RepairInput.attempt 0); an attempt has an id of its own.
    replaces_token: str = ""
    # The instance's earlier attempt, which ended without replacing it: the new one starts once it has closed (it
    # may still be handing its permit back), so that one instance never has two repairs running.
    previous_workflow_id: str = ""


class StartRepairResult(BaseModel):
    workflow_id: str
    already_running: bool
    # The progress token of the repair that runs under that id: the one just started, or one started earlier.
    progress_token: str = ""


class WithdrawRepairRequest(BaseModel):
    """Ask a repair that waits for its drain permit to stand down (its `withdraw_repair` update)."""

    workflow_id: str
    token: str  # the repair's progress token: it takes the withdrawal only from the health workflow that started it
    reason: str


class WithdrawRepairResult(BaseModel):
    # True: the repair will not touch the instance (it stood down, or had closed already). False: it holds its
    # permit and is left to finish.
    withdrawn: bool
    detail: str = ""


class PermitRequestOrder(BaseModel):
    """Ask the group's drain semaphore for a permit, starting the semaphore if it is not running."""

    group: str
    holder_workflow_id: str
    holder_run_id: str
    instance_id: str
    token: str  # the repair's secret for this request (PermitRequest.token)
    critical: bool = True


class WorkflowRun(BaseModel):
    workflow_id: str
    run_id: str | None = None


class WorkflowRuns(BaseModel):
    runs: list[WorkflowRun]


class SignalTo(BaseModel):
    workflow_id: str
    run_id: str | None = None
    payload: dict[str, Any]  # the signal's one argument, as JSON: the receiver reads it into its own model


class SignalsToSend(BaseModel):
    """One signal to each of these runs (WorkflowOps.send_signals): a drain semaphore's grants of a batch."""

    signal: str
    to: list[SignalTo]


# A semaphore's impairments passed on to the fleet breaker in one activity: a surge's worth, each a signal.
FLEET_REPORTS_AT_ONCE = 100


class FleetReports(BaseModel):
    """Impairments a semaphore counted together, for the fleet breaker (BreakerOps.report_many_to_fleet_breaker)."""

    reports: list[ImpairmentReport] = Field(max_length=FLEET_REPORTS_AT_ONCE)


class RepairsOfGroup(BaseModel):
    """Which of these runs are running repair workflows of the group."""

    group: str
    runs: list[WorkflowRun]


class ReplacementWait(InstanceRef):
    """Wait for a replacement (`instance_id`) to be ACTIVE in the group's cluster, until `ready_by` at the latest."""

    # Fixed by the workflow when the wait starts, so a retried wait (a worker lost) does not start the clock again.
    # None (a payload of an older workflow): only the activity's own timeout ends the wait.
    ready_by: datetime | None = None


class ReplacementRef(BaseModel):
    """A replacement that a repair gives up on, and the impaired instance it was launched for."""

    group: str
    instance_id: str
    impaired_instance_id: str


class ReplacementCheck(BaseModel):
    """Whether an earlier attempt's replacement serves: running, tagged for this impaired instance, ACTIVE in ECS."""

    serving: bool
    why: str = ""  # when it does not


# --- The remediation ladder's rung in place (activities/remediation.py) ----------------------------------------------


class RebootRequest(BaseModel):
    group: str
    instance_id: str
    # The same on every retry of the step: an instance already tagged with it was rebooted by this step already.
    token: str = Field(min_length=1, max_length=64)


class RebootResult(BaseModel):
    already_rebooted: bool = False


class GpuResetRequest(BaseModel):
    group: str
    instance_id: str
    gpu: str  # PCI address, as the finding names it (dddd:bb:dd)
    token: str = Field(min_length=1, max_length=64)  # in the command's comment: a retry finds the command it sent


class HostCommand(BaseModel):
    command_id: str


class GpuResetCheck(BaseModel):
    group: str
    instance_id: str
    command_id: str


class GpuResetStatus(BaseModel):
    """Where the reset command is. `done` false: still running (or not yet known to SSM); then `reset` says whether
    the GPU was reset, and `why` what the command said when it was not (the driver refused: processes hold the GPU,
    or the system resets its GPUs only together, as NVSwitch systems do)."""

    done: bool
    reset: bool = False
    status: str = ""
    exit_code: int | None = None
    why: str = ""


class HealthViewExcerpt(BaseModel):
    """What the rung reads of the instance's health workflow's `health` query (workflows.models.InstanceHealthView,
    which activities may not import): the probe's boot, its sources, the recent findings and NVIDIA's verdicts."""

    boot_id: str | None = None
    last_heartbeat: datetime | None = None
    probe_sources: list[ProbeSourceHealth] = Field(default_factory=list)
    recent_findings: list[GpuFinding] = Field(default_factory=list)
    # NVIDIA's standing verdicts it holds now: one stated after the repair began still counts before the GPU is touched.
    nvidia_verdicts: list[GpuVerdict] = Field(default_factory=list, max_length=MAX_VERDICTS_KEPT)
    # The GPUs the probe last saw, and how many the instance's type has (None: not known): the fix's gate compares them.
    gpu_count: int | None = None
    expected_gpus: int | None = None


class RecoveryCheck(KnownInstance):
    """Look at an instance as it comes back (its container instance by ARN where the repair knows it)."""


class RecoveryStatus(BaseModel):
    """The instance as the rung sees it while it comes back: the probe's view through its health workflow, and ECS's."""

    probe: HealthViewExcerpt | None = None  # None: the health workflow did not answer
    probe_error: str = ""
    # The health workflow gave no answer (no worker took the query in time, or none was started yet): the engine's
    # own delay, which says nothing of the instance (workflows/repair_ladder.py, WorldWait). False in a look recorded
    # before the field, which a replay must decide as it did then.
    probe_unanswered: bool = False
    agent_connected: bool | None = None  # None: not registered (ACTIVE or DRAINING) in the group's cluster
    container_status: str | None = None


class ActivateResult(BaseModel):
    container_instance_arn: str
    already_active: bool = False


class AwsStatusRequest(BaseModel):
    """Read what AWS says of one instance now (AwsStatusActivities.read_aws_status): a health workflow confirms
    an impairment it was told of before acting on it."""

    group: str
    instance_id: str


# --- Evidence before a termination, and quarantine (activities/evidence.py, FleetActivities.quarantine_instance) -----


class EvidenceRequest(BaseModel):
    group: str
    instance_id: str
    repair_workflow_id: str
    attempt: int = 0
    reason: str = ""
    finding: GpuFinding | None = None
    # When the fault was seen (the finding's time, else the repair's start): the host's kernel log is read from a
    # while before it.
    fault_at: datetime
    # In the SSM command's comment: a retry of the step finds the command it sent.
    token: str = Field(min_length=1, max_length=64)


class EvidenceStored(BaseModel):
    """What the worker stored itself, and the host's command when the group asks for its part."""

    bucket: str
    prefix: str
    objects: list[str] = Field(default_factory=list)  # keys, relative to prefix
    command_id: str | None = None
    command_error: str = ""  # the host's part could not be asked for (no SSM agent, no permission): why


class EvidenceCommandCheck(BaseModel):
    group: str
    instance_id: str
    command_id: str


class GateCommandRequest(BaseModel):
    group: str
    instance_id: str
    token: str = Field(min_length=1, max_length=64)  # in the command's comment: a retry finds the command it sent


class HostCommandCheck(BaseModel):
    instance_id: str
    command_id: str


class CommandStatus(BaseModel):
    """One look at an SSM Run Command on one instance: `done` false while it runs (or SSM does not know it yet)."""

    done: bool
    succeeded: bool = False
    status: str = ""
    exit_code: int | None = None
    output: str = ""  # stdout and stderr, whitespace folded, cut short


class EvidenceFinish(BaseModel):
    group: str
    bucket: str
    prefix: str
    repair_workflow_id: str
    stored: list[str] = Field(default_factory=list)
    # Why the host's part may be missing, from the workflow (the command's status or timeout), for the manifest.
    host_note: str = ""
    host_asked: bool = False


class EvidenceManifest(BaseModel):
    location: str  # s3://bucket/prefix
    objects: list[str] = Field(default_factory=list)
    missing: dict[str, str] = Field(default_factory=dict)  # object -> why it is not there

    @property
    def complete(self) -> bool:
        return not self.missing


class QuarantineResult(BaseModel):
    previous_state: str | None = None
    already_stopped: bool = False
    gone: bool = False  # terminated by someone else before it could be stopped
