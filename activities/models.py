"""Inputs and outputs of the activities, and the events they publish."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from contract.formats import iso
from contract.groups import GroupConfigOverrides, GroupConfigState
from contract.repair import RepairInput


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
    # A group-level event: instance_id is empty, `changes` holds each changed field's old and new value.
    GROUP_CONFIG_CHANGED = "GroupConfigChanged"
    # The instance left on purpose (terminated by someone other than a repair): watched no more, never repaired.
    INSTANCE_RETIRED = "InstanceRetired"


HEALTH_DETAIL_TYPE = "Instance Health Change"
REPAIR_DETAIL_TYPE = "Instance Repair Step"
GROUP_DETAIL_TYPE = "Capacity Group Configuration Change"


class FleetEvent(BaseModel):
    """One line of the event stream. `fields` holds the type-specific keys (e.g. `replacement_instance_id`)."""

    event_id: str = Field(description="Deterministic per workflow step, so consumers can drop redeliveries")
    time: datetime
    type: EventType
    group: str
    instance_id: str
    workflow_id: str = ""
    fields: dict[str, Any] = Field(default_factory=dict)

    @property
    def detail_type(self) -> str:
        if self.type is EventType.GROUP_CONFIG_CHANGED:
            return GROUP_DETAIL_TYPE
        health = (EventType.HEALTH_CHANGED, EventType.INSTANCE_RETIRED)
        return HEALTH_DETAIL_TYPE if self.type in health else REPAIR_DETAIL_TYPE

    def line(self) -> dict[str, Any]:
        """The flat JSON-lines shape: time, type, group, instance_id, then the type's own keys."""
        head = {
            "time": iso(self.time),
            "type": self.type.value,
            "group": self.group,
            "instance_id": self.instance_id,
            "workflow_id": self.workflow_id,
            "event_id": self.event_id,
        }
        return head | self.fields


class GroupRef(BaseModel):
    group: str


class GroupCapacityRequest(BaseModel):
    group: str
    # The drain semaphore's live overrides: the cap follows from the settings with these applied.
    overrides: GroupConfigOverrides = Field(default_factory=GroupConfigOverrides)


class GroupCapacity(BaseModel):
    group: str
    instance_count: int
    max_draining: int


class PreviousGroupConfig(BaseModel):
    """The live configuration an earlier, closed run of the group's semaphore left in its memo (None: none)."""

    state: GroupConfigState | None = None
    run_id: str = ""


class GroupConfigRequest(BaseModel):
    group: str
    # The drain semaphore holds the overrides and applies them itself: it asks for the settings alone.
    live_overrides: bool = True


class InstancesGoneRequest(BaseModel):
    group: str
    instance_ids: list[str]


class GoneInstance(BaseModel):
    instance_id: str
    state: str  # EC2's: shutting-down or terminated
    reason: str = ""  # EC2's StateTransitionReason, e.g. "User initiated (2026-12-01 10:00:00 GMT)"


class InstancesGone(BaseModel):
    """Of the instances asked about, those EC2 says are terminated or terminating."""

    gone: list[GoneInstance] = Field(default_factory=list)


class InstanceRef(BaseModel):
    group: str
    instance_id: str


class DrainResult(BaseModel):
    container_instance_arn: str
    availability_zone: str | None = None
    subnet_id: str | None = None


class LaunchRequest(BaseModel):
    group: str
    impaired_instance_id: str
    availability_zone: str | None = None
    subnet_id: str | None = None
    # Same token on every retry of one repair's launch: the activity returns the instance it already launched.
    client_token: str = Field(min_length=1, max_length=64)


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


class StartRepairResult(BaseModel):
    workflow_id: str
    already_running: bool
    # The progress token of the repair that runs under that id: the one just started, or one started earlier.
    progress_token: str = ""


class PermitRequestOrder(BaseModel):
    """Ask the group's drain semaphore for a permit, starting the semaphore if it is not running."""

    group: str
    holder_workflow_id: str
    holder_run_id: str
    instance_id: str
    token: str  # the repair's secret for this request (PermitRequest.token)


class WorkflowRun(BaseModel):
    workflow_id: str
    run_id: str | None = None


class WorkflowRuns(BaseModel):
    runs: list[WorkflowRun]


class RepairsOfGroup(BaseModel):
    """Which of these runs are running repair workflows of the group."""

    group: str
    runs: list[WorkflowRun]
