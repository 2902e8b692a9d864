"""What tests/test_breaker_property.py stands up in place of the real world: the stub repair that asks the semaphore
for a permit (workflow "BreakerPropertyRepair"), and the semaphore's activities, stubbed by name (the test server
can answer none of them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel
from temporalio import activity, workflow

from activities.models import (
    FleetEvent,
    FleetReports,
    GroupCapacity,
    GroupCapacityRequest,
    GroupConfigRequest,
    GroupRef,
    PreviousGroupConfig,
    RepairsOfGroup,
    SignalsToSend,
    WorkflowRuns,
)
from activities.workflow_ops import WorkflowOps
from contract import names
from contract.breaker import FleetHoldAnswer, FleetHoldQuery, ImpairmentReport
from contract.groups import CapacityGroup, GroupConfigOverrides
from contract.ids import semaphore_workflow_id
from contract.semaphore import PermitDenial, PermitRequest
from workflows.models import PermitGrant, PermitRelease

# The real repair asks again every 5 minutes (workflows/repair.py, PERMIT_REQUEST_REFRESH); less often here, so that a
# day's skip wakes each waiting stub 12 times, not 288; still after the reclaim interval, as there.
REQUEST_REFRESH = timedelta(hours=2)
HOLDER_QUEUE_SUFFIX = "-holders"


# --- the stub repair -------------------------------------------------------------------------------------------


class HolderInput(BaseModel):
    group: str
    instance_id: str
    token: str


class HolderView(BaseModel):
    """What one stub repair saw. Times are the semaphore's (grants) or the repair's own (release)."""

    workflow_id: str
    run_id: str
    requested: bool = False
    requests: int = 1
    granted_at: datetime | None = None
    grants: int = 0
    denied: bool = False
    denied_after_grant: bool = False
    granted_after_denial: bool = False
    foreign_tokens: int = 0
    released_at: datetime | None = None


@workflow.defn(name="BreakerPropertyRepair")
class StubRepair:
    """Stands in for InstanceRepairWorkflow: asks for a permit, takes the grant (or the denial), and on `finish`
    gives the permit back and completes. After a denial it stays open until `finish`, so that a grant sent after
    the discard (a bug) would still be seen."""

    @workflow.init
    def __init__(self, input: HolderInput) -> None:
        info = workflow.info()
        self._view = HolderView(workflow_id=info.workflow_id, run_id=info.run_id)
        self._token = input.token
        self._finish = False

    @workflow.run
    async def run(self, input: HolderInput) -> HolderView:
        semaphore = workflow.get_external_workflow_handle(semaphore_workflow_id(input.group))
        request = PermitRequest(
            holder_workflow_id=self._view.workflow_id,
            holder_run_id=self._view.run_id,
            instance_id=input.instance_id,
            token=input.token,
        )
        await semaphore.signal(names.SIGNAL_REQUEST, request)
        self._view.requested = True
        # Like the real repair, ask again now and then until granted or let go: a repeated request is one, or a
        # grant sent again.
        while not (self._finish or self._view.granted_at or self._view.denied):
            try:
                await workflow.wait_condition(
                    lambda: self._finish or self._view.granted_at is not None or self._view.denied,
                    timeout=REQUEST_REFRESH,
                )
            except TimeoutError:
                self._view.requests += 1
                await semaphore.signal(names.SIGNAL_REQUEST, request)
        await workflow.wait_condition(lambda: self._finish)
        # Sent whether granted or still waiting (a waiting repair that ends gives up its place in line): its time
        # is a lower bound of when the semaphore let the permit go.
        self._view.released_at = workflow.now()
        await semaphore.signal(
            names.SIGNAL_RELEASE, PermitRelease(holder_workflow_id=self._view.workflow_id, token=input.token)
        )
        return self._view

    @workflow.signal(name=names.SIGNAL_PERMIT_GRANTED)
    def permit_granted(self, grant: PermitGrant) -> None:
        if grant.token != self._token:
            self._view.foreign_tokens += 1
            return
        self._view.grants += 1
        if self._view.granted_at is None:
            self._view.granted_at = grant.granted_at
        if self._view.denied:
            self._view.granted_after_denial = True

    @workflow.signal(name=names.SIGNAL_PERMIT_DENIED)
    def permit_denied(self, denial: PermitDenial) -> None:
        if denial.token != self._token:
            self._view.foreign_tokens += 1
            return
        self._view.denied = True
        if self._view.granted_at is not None:
            self._view.denied_after_grant = True

    @workflow.signal
    def finish(self) -> None:
        self._finish = True

    @workflow.query
    def view(self) -> HolderView:
        return self._view


# --- the stubbed activities ------------------------------------------------------------------------------------


@dataclass
class GroupStub:
    group: CapacityGroup
    size: int
    overrides: GroupConfigOverrides = field(default_factory=GroupConfigOverrides)
    events: list[FleetEvent] = field(default_factory=list)
    fleet_reports: int = 0
    fleet_report_activities: int = 0
    counted: int = 0  # describe_group_capacity calls: the semaphore counts the group only when it must
    # Repairs of the group that the test started, by workflow id: their run id (None until the start returned).
    running: dict[str, str | None] = field(default_factory=dict)
    closed: set[tuple[str, str]] = field(default_factory=set)
    latency: dict[str, float] = field(default_factory=dict)


class StubActivities:
    """The semaphore's activities, by name, over the examples' groups (the test server can answer none of them)."""

    def __init__(self) -> None:
        self.groups: dict[str, GroupStub] = {}
        self.ops: WorkflowOps | None = None  # the real send_signals, once the harness has a client

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.get_group_config,
            self.describe_group_capacity,
            self.previous_group_config,
            self.find_running_repairs,
            self.find_closed_workflows,
            self.publish_event,
            self.fleet_hold,
            self.report_to_fleet_breaker,
            self.report_many_to_fleet_breaker,
            self.send_signals,
        ]

    @activity.defn(name="get_group_config")
    async def get_group_config(self, request: GroupConfigRequest) -> CapacityGroup:
        stub = self.groups[request.group]
        await asyncio.sleep(stub.latency.get("get_group_config", 0.0))
        return stub.overrides.apply(stub.group) if request.live_overrides else stub.group

    @activity.defn(name="describe_group_capacity")
    async def describe_group_capacity(self, request: GroupCapacityRequest) -> GroupCapacity:
        stub = self.groups[request.group]
        stub.counted += 1
        await asyncio.sleep(stub.latency.get("describe_group_capacity", 0.0))
        cap = request.overrides.apply(stub.group).max_draining(stub.size)
        return GroupCapacity(group=request.group, instance_count=stub.size, max_draining=cap)

    @activity.defn(name="previous_group_config")
    async def previous_group_config(self, ref: GroupRef) -> PreviousGroupConfig:
        return PreviousGroupConfig()  # every example's group is new

    @activity.defn(name="find_running_repairs")
    async def find_running_repairs(self, request: RepairsOfGroup) -> WorkflowRuns:
        await asyncio.sleep(self.groups[request.group].latency.get("find_running_repairs", 0.0))
        running = self.groups[request.group].running
        return WorkflowRuns(
            runs=[
                run
                for run in request.runs
                if run.workflow_id in running and running[run.workflow_id] in (None, run.run_id)
            ]
        )

    @activity.defn(name="find_closed_workflows")
    async def find_closed_workflows(self, runs: WorkflowRuns) -> WorkflowRuns:
        closed = set().union(*(stub.closed for stub in self.groups.values()))
        return WorkflowRuns(runs=[run for run in runs.runs if (run.workflow_id, run.run_id or "") in closed])

    @activity.defn(name="publish_event")
    async def publish_event(self, event: FleetEvent) -> None:
        self.groups[event.group].events.append(event)

    @activity.defn(name="fleet_hold")
    async def fleet_hold(self, query: FleetHoldQuery) -> FleetHoldAnswer:
        return FleetHoldAnswer()

    @activity.defn(name="report_to_fleet_breaker")
    async def report_to_fleet_breaker(self, report: ImpairmentReport) -> None:
        self.groups[report.group].fleet_reports += 1
        self.groups[report.group].fleet_report_activities += 1

    @activity.defn(name="report_many_to_fleet_breaker")
    async def report_many_to_fleet_breaker(self, batch: FleetReports) -> None:
        for report in batch.reports:
            self.groups[report.group].fleet_reports += 1
        self.groups[batch.reports[0].group].fleet_report_activities += 1

    @activity.defn(name="send_signals")
    async def send_signals(self, order: SignalsToSend) -> WorkflowRuns:
        # The real one (a batch's grants): the test server takes signals as any server does.
        assert self.ops is not None, "the harness sets ops once it has a client"
        return await self.ops.send_signals(order)
