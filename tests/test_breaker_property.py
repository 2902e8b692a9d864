"""The drain semaphore and its breaker against random schedules, on Temporal's time-skipping test server (issue 12,
"Proof").

Each example is one capacity group of 1 to 200 instances, its real DrainSemaphoreWorkflow (under the worker's
SANDBOX runner) and a schedule drawn by hypothesis: impairments (some of them heartbeat losses whose silences began
together, the monitoring-outage rule), stub repairs asking for a permit, repairs that finish or crash without a
release, time skips, operator updates (the drain cap, the breaker's thresholds, the repair budget, a reset),
resumes with and without --discard-held, the fleet breaker's hold and resume notices, and worker restarts. Most
steps let the semaphore settle before the next one; some do not, so that signals and updates also land while it is
busy (a quarter of the schedules give the activities it awaits 50 ms, as real ones take). Checked, per example:

- never more holders at once than the cap in force when a grant was made (from the grants' times and the releases,
  against the cap of the operator updates' times), and never more grants in a day than the repair budget;
- never a grant while held: granted_at is never inside [tripped_at, resume) of a hold;
- a repair let go by `--resume --discard-held` is never granted, and every one waiting at that moment is let go;
- the breaker trips when the impairments counted since the last resume, within the window, are over the rule
  (percentage or monitoring outage), and a hold never counts more impairments than were reported;
- each trip published a RepairsHeld event and each resume a RepairsResumed one;
- what the semaphore knew when it granted, from the order of its history: no grant once a fleet hold notice had
  arrived (until a resume), nor once impairments over the rule had arrived, counted or not;
- no waiter waits while a permit is free and nothing holds; the cap shown is the one in force;
- the semaphore never failed: still running, answering its query, no failed workflow task but those the server
  itself causes (below).

Scaffolding, and why:
- The test server has no visibility and no search attributes, so the activities the semaphore calls are stubbed by
  name (StubActivities), and stub repairs (StubRepair, workflow id `repair/<instance>`, which the semaphore
  insists on) ask for permits and give them back.
- The test server never moves a workflow task off the sticky queue of a worker that is gone (a real server does
  once nobody polls it; this one holds the task for ever, and with it the whole server's time skipping). The
  semaphore's worker therefore reaches the server through a small gRPC relay (StickyRelay; grpcio comes with the
  OTLP exporter) that notes its sticky queue; after a restart a janitor fails what lands there with
  RESET_STICKY_TASK_QUEUE, as an older server did after the sticky schedule-to-start timeout, and the new worker
  replays the whole history. Those failures are the only failed workflow tasks allowed. The stub repairs' worker
  keeps no cache at all, so nothing of theirs is ever left on a sticky queue.
- The test server also loses its time-skipping lock for good when a workflow is terminated in the middle of a
  workflow task, so crashes (and restarts) happen at rest: Example.quiet.
- Hypothesis does not drive pytest-asyncio coroutines, so the test is synchronous: one long-lived event loop owns
  the server, the relay, the clients and the workers (BreakerHarness), and runs one example at a time.

`.venv/bin/pytest tests/test_breaker_property.py` runs 100 derandomized schedules and three fixed ones (about 100 s
on two cores); the longer profile, `BREAKER_PROPERTY_EXAMPLES=1000 .venv/bin/pytest tests/test_breaker_property.py`,
runs 1,000 with the same code. test_what_lands_during_a_grant_pass_counts pins the races this test found in
DrainSemaphoreWorkflow (a cap changed, a fleet hold or impairments arriving while a grant pass awaited an activity),
now fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType, QueryResultType, TaskQueueKind, WorkflowTaskFailedCause
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import (
    PollWorkflowTaskQueueRequest,
    RespondQueryTaskCompletedRequest,
    RespondWorkflowTaskFailedRequest,
)
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.models import (
    FleetEvent,
    GroupCapacity,
    GroupCapacityRequest,
    GroupConfigRequest,
    GroupRef,
    PreviousGroupConfig,
    RepairsOfGroup,
    WorkflowRuns,
)
from contract import names
from contract.breaker import (
    OUTAGE_SPREAD,
    REPAIR_BUDGET_PERIOD,
    BreakerHold,
    FleetHoldAnswer,
    FleetHoldQuery,
    HoldCause,
    HoldNotice,
    ImpairmentReport,
    ResumeRecord,
)
from contract.groups import CapacityGroup, GroupConfigOverrides, GroupConfigState, GroupConfigUpdate
from contract.ids import repair_workflow_id, semaphore_workflow_id
from contract.semaphore import PermitDenial, PermitRequest, SemaphoreInput
from simulator.servers import find_binary
from worker.main import SANDBOX
from workflows.drain_semaphore import DrainSemaphoreWorkflow
from workflows.models import PermitGrant, PermitRelease, SemaphoreView

MAX_GROUP = 200
MAX_STEPS = 8
# A holder's permit is checked every reclaim interval while it holds (1 minute by default): long enough here that a
# day's skip wakes the semaphore 50 times, not 1,440, and short enough that a 31-minute skip reclaims a crashed
# repair's permit.
RECLAIM_INTERVAL = timedelta(minutes=30)
# Time skips: seconds, minutes (short of the reclaim interval), past the reclaim interval and the breaker's 30-minute
# window, past the repair budget's day.
SKIPS = (10, 21 * 60, 31 * 60, 25 * 3600)
# The real repair asks again every 5 minutes (workflows/repair.py, PERMIT_REQUEST_REFRESH); less often here, so that a
# day's skip wakes each waiting stub 12 times, not 288; still after the reclaim interval, as there.
REQUEST_REFRESH = timedelta(hours=2)
SETTLE_WITHIN = 30.0  # seconds of real time; an example normally settles in milliseconds
POLL_FIRST, POLL_MOST = 0.003, 0.05
HOLDER_QUEUE_SUFFIX = "-holders"
# The janitor's own failures (RESET_STICKY_TASK_QUEUE), and what the server fails by itself when a signal races a
# close or continue-as-new (tests/test_signal_fuzz.py explains these).
RESET_STICKY = WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_STICKY_TASK_QUEUE
SERVER_CAUSED = {
    RESET_STICKY,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND,
}


# --- the schedules --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Impair:
    """`share` percent of the group (rounded up) becomes IMPAIRED now, from instance `start` on; with `outage`, as
    heartbeat losses whose silences began within seconds of each other."""

    share: int
    start: int
    outage: bool
    settle: bool = True


@dataclass(frozen=True)
class Request:
    """Stub repairs start for `count` instances from `start` on (those without a running repair) and ask for a
    permit."""

    count: int
    start: int
    settle: bool = True


@dataclass(frozen=True)
class Finish:
    """`count` running repairs from `start` on (in start order) finish: each releases its permit (or its place in
    line) and completes."""

    count: int
    start: int
    settle: bool = True


@dataclass(frozen=True)
class Crash:
    """`count` running repairs are terminated without a release: the semaphore must reclaim their permits. Always
    at rest (Example.quiet says why)."""

    count: int
    start: int
    settle: bool = True


@dataclass(frozen=True)
class Skip:
    seconds: int
    settle: bool = True


@dataclass(frozen=True)
class SetCap:
    percent: int
    settle: bool = True


@dataclass(frozen=True)
class SetBreaker:
    percent: int
    min_impaired: int
    settle: bool = True


@dataclass(frozen=True)
class SetBudget:
    per_day: int
    settle: bool = True


@dataclass(frozen=True)
class Reset:
    settle: bool = True


@dataclass(frozen=True)
class Pause:
    """Real seconds without a step: lets a pinned schedule put its next step in the middle of the semaphore's work.
    Never drawn (the drawn schedules get there by not settling, and by the activities' latency)."""

    seconds: float
    settle: bool = False


@dataclass(frozen=True)
class FleetHold:
    """The fleet breaker tells the semaphore that it holds every group (its HoldNotice)."""

    settle: bool = True


@dataclass(frozen=True)
class FleetResume:
    """The fleet breaker, holding, tells the semaphore it resumed, with or without --discard-held (at rest first, as
    Resume). Nothing is sent when the fleet breaker does not hold: it never sends a resume then."""

    discard: bool


@dataclass(frozen=True)
class Resume:
    """Always settles afterwards (the resume's exact time is read from the semaphore then); with `discard` also
    before (which repairs wait, and must all be let go, is only known at rest)."""

    discard: bool


@dataclass(frozen=True)
class Restart:
    """Both workers shut down and start afresh: sticky caches dropped, every history replayed. Always at rest."""


Step = (
    Impair
    | Request
    | Finish
    | Crash
    | Skip
    | SetCap
    | SetBreaker
    | SetBudget
    | Reset
    | Resume
    | Restart
    | FleetHold
    | FleetResume
    | Pause
)


@dataclass(frozen=True)
class Schedule:
    size: int
    draining_percent: int
    steps: tuple[Step, ...]
    # Seconds a stubbed activity takes, by name (the real ones call ECS, EC2 and Temporal, in tens or hundreds of
    # milliseconds): a quarter of the drawn schedules look the group and its repairs up in 50 ms, so that steps
    # that do not wait land in the middle of a grant pass; a pinned race takes longer, to be certain.
    latency: tuple[tuple[str, float], ...] = ()


def schedules(max_steps: int = MAX_STEPS) -> st.SearchStrategy[Schedule]:
    # Mostly settled, so that the checks at rest apply; now and then the next step lands while the semaphore works.
    settle = st.sampled_from([True, True, True, False])
    index = st.integers(0, MAX_GROUP - 1)
    # Impairments of up to 45% of the group at once: over the default 30% in one step, or in two; every one costs
    # the semaphore an activity (its report to the fleet breaker), so a whole group of 200 would only be slower.
    kinds: dict[str, tuple[int, st.SearchStrategy[Step]]] = {
        # kind: (weight, steps); faults, repairs and resumes are what the properties are about.
        "impair": (4, st.builds(Impair, st.integers(1, 45), index, st.booleans(), settle)),
        "request": (4, st.builds(Request, st.integers(1, 10), index, settle)),
        "finish": (3, st.builds(Finish, st.integers(1, 8), index, settle)),
        "resume": (3, st.builds(Resume, st.booleans())),
        "skip": (1, st.builds(Skip, st.sampled_from(SKIPS), settle)),
        "cap": (1, st.builds(SetCap, st.integers(1, 100), settle)),
        "breaker": (1, st.builds(SetBreaker, st.integers(1, 100), st.integers(0, 10), settle)),
        "budget": (1, st.builds(SetBudget, st.integers(1, 20), settle)),
        "crash": (1, st.builds(Crash, st.integers(1, 3), index, settle)),
        "reset": (1, st.builds(Reset, settle)),
        "restart": (1, st.just(Restart())),
        "fleet hold": (1, st.builds(FleetHold, settle)),
        "fleet resume": (1, st.builds(FleetResume, st.booleans())),
    }
    # one_of would treat repeated branches as one: weigh by repeating the kind's name instead.
    step = st.sampled_from([kind for kind, (weight, _) in kinds.items() for _ in range(weight)]).flatmap(
        lambda kind: kinds[kind][1]
    )
    lookups = (("describe_group_capacity", 0.05), ("find_running_repairs", 0.05))
    return st.builds(
        Schedule,
        st.integers(1, MAX_GROUP),
        st.integers(1, 100),
        st.lists(step, min_size=1, max_size=max_steps).map(tuple),
        st.sampled_from([(), (), (), lookups]),
    )


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
    # Repairs of the group that the test started, by workflow id: their run id (None until the start returned).
    running: dict[str, str | None] = field(default_factory=dict)
    closed: set[tuple[str, str]] = field(default_factory=set)
    latency: dict[str, float] = field(default_factory=dict)


class StubActivities:
    """The semaphore's activities, by name, over the examples' groups (the test server can answer none of them)."""

    def __init__(self) -> None:
        self.groups: dict[str, GroupStub] = {}

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
        ]

    @activity.defn(name="get_group_config")
    async def get_group_config(self, request: GroupConfigRequest) -> CapacityGroup:
        stub = self.groups[request.group]
        await asyncio.sleep(stub.latency.get("get_group_config", 0.0))
        return stub.overrides.apply(stub.group) if request.live_overrides else stub.group

    @activity.defn(name="describe_group_capacity")
    async def describe_group_capacity(self, request: GroupCapacityRequest) -> GroupCapacity:
        stub = self.groups[request.group]
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


# --- the relay and the janitor (worker restarts on the test server) ----------------------------------------------

POLL_WORKFLOW_TASK = "/temporal.api.workflowservice.v1.WorkflowService/PollWorkflowTaskQueue"
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


class StickyRelay(grpc.GenericRpcHandler):
    """Passes the workers' calls through to the test server unchanged, telling of each sticky queue they poll."""

    def __init__(self, upstream: grpc.aio.Channel, tell: Callable[[str], None]) -> None:
        self._upstream = upstream
        self._tell = tell
        self._sticky_queues: set[str] = set()

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        call = self._upstream.unary_unary(method)

        async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if method == POLL_WORKFLOW_TASK:
                queue = PollWorkflowTaskQueueRequest.FromString(request).task_queue
                if queue.kind == TaskQueueKind.TASK_QUEUE_KIND_STICKY and queue.name not in self._sticky_queues:
                    self._sticky_queues.add(queue.name)
                    self._tell(queue.name)
            try:
                return await call(request, metadata=context.invocation_metadata(), timeout=context.time_remaining())
            except grpc.aio.AioRpcError as err:
                context.set_trailing_metadata(err.trailing_metadata() or ())
                await context.abort(err.code(), err.details() or "")
                raise  # abort raises; this keeps type checkers honest

        return grpc.unary_unary_rpc_method_handler(relay)


async def sticky_janitor(client: Client, queue: str) -> None:
    """Fail every workflow task that lands on a dead worker's sticky queue, so that the server reschedules it on the
    normal queue with the whole history; queries that land there fail and are asked again."""
    while True:
        task = await client.workflow_service.poll_workflow_task_queue(
            PollWorkflowTaskQueueRequest(
                namespace=client.namespace,
                task_queue=TaskQueue(name=queue, kind=TaskQueueKind.TASK_QUEUE_KIND_STICKY),
                identity="sticky-janitor",
            )
        )
        if not task.task_token:
            continue
        if task.HasField("query"):
            await client.workflow_service.respond_query_task_completed(
                RespondQueryTaskCompletedRequest(
                    namespace=client.namespace,
                    task_token=task.task_token,
                    completed_type=QueryResultType.QUERY_RESULT_TYPE_FAILED,
                    error_message="the worker that held this workflow is gone",
                )
            )
            continue
        await client.workflow_service.respond_workflow_task_failed(
            RespondWorkflowTaskFailedRequest(
                namespace=client.namespace,
                task_token=task.task_token,
                cause=WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_STICKY_TASK_QUEUE,
                identity="sticky-janitor",
            )
        )


# --- the harness -----------------------------------------------------------------------------------------------


class BreakerHarness:
    """One event loop, one time-skipping server, the relay, and the two workers (the semaphore's under SANDBOX with
    the stub activities; the stub repairs' unsandboxed, on a queue of their own), for any number of examples."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.stubs = StubActivities()
        self.task_queue = f"breaker-property-{uuid.uuid4().hex[:8]}"
        self.restarts = 0
        self.examples = 0
        self._janitors: set[asyncio.Task[None]] = set()
        self.sticky_queues: set[str] = set()  # of the current semaphore worker, as the relay tells
        self._workers: list[tuple[Worker, asyncio.Task[None]]] = []
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        self.env = await WorkflowEnvironment.start_time_skipping(
            test_server_existing_path=find_binary("temporal-test-server"), data_converter=pydantic_data_converter
        )
        self.client = self.env.client
        # In this process: a relay process of its own was slower on two cores (measured), not faster.
        self._upstream = grpc.aio.insecure_channel(self.client.service_client.config.target_host, options=UNLIMITED)
        self._relay = grpc.aio.server(options=UNLIMITED)
        self._relay.add_generic_rpc_handlers([StickyRelay(self._upstream, self.sticky_queues.add)])
        port = self._relay.add_insecure_port("127.0.0.1:0")
        await self._relay.start()
        self.worker_client = await Client.connect(
            f"127.0.0.1:{port}", namespace=self.client.namespace, data_converter=pydantic_data_converter
        )
        self._start_workers()

    def _start_workers(self) -> None:
        workers = [
            Worker(
                self.worker_client,
                task_queue=self.task_queue,
                workflows=[DrainSemaphoreWorkflow],
                activities=self.stubs.activities(),
                workflow_runner=SANDBOX,
            ),
            # The stub repairs keep no cache: every workflow task replays their short histories, nothing is left on
            # a sticky queue when their worker restarts, and their many calls need not go through the relay.
            Worker(
                self.client,
                task_queue=self.task_queue + HOLDER_QUEUE_SUFFIX,
                workflows=[StubRepair],
                workflow_runner=UnsandboxedWorkflowRunner(),
                max_cached_workflows=0,
            ),
        ]
        self._workers = [(worker, asyncio.ensure_future(worker.run())) for worker in workers]

    async def restart_workers(self) -> set[asyncio.Task[None]]:
        """Shut both workers down and start new ones; the janitors returned must run until every running workflow
        has had a workflow task on the new workers."""
        dead = set(self.sticky_queues)
        self.sticky_queues.clear()
        for worker, task in self._workers:
            await worker.shutdown()
            await task
        janitors = {asyncio.ensure_future(sticky_janitor(self.client, queue)) for queue in dead}
        self._janitors |= janitors
        self._start_workers()
        self.restarts += 1
        return janitors

    async def stop_janitors(self, janitors: set[asyncio.Task[None]]) -> None:
        for janitor in janitors:
            janitor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await janitor
        self._janitors -= janitors

    def run(self, schedule: Schedule) -> ExampleReport:
        self.examples += 1
        example = self.loop.create_task(Example(self, schedule).run())
        try:
            return self.loop.run_until_complete(example)
        except BaseException:
            # Interrupted (a timeout's signal, ^C): let the example clean up, or the next one would share this
            # loop with it.
            example.cancel()
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(example)
            raise

    def close(self) -> None:
        async def stop() -> None:
            try:
                await self.stop_janitors(set(self._janitors))
                for worker, task in self._workers:
                    await worker.shutdown()
                    await task
                await self._relay.stop(None)
                await self._upstream.close()
            finally:
                await self.env.shutdown()  # whatever else failed: no test server left running
            # Calls still open in the SDK's own threads (long polls) fail now that the server is gone; let them
            # land while this loop runs. And gRPC's asyncio engine runs until its last channel and server are
            # freed: freed only at interpreter exit, both abort it (PyGILState_Release while finalizing).
            await asyncio.sleep(0.5)
            del self._relay, self._upstream
            gc.collect()

        self.loop.run_until_complete(stop())
        self.loop.close()


# --- one example -----------------------------------------------------------------------------------------------


@dataclass
class Holder:
    instance_id: str
    token: str
    handle: WorkflowHandle[Any, Any]
    run_id: str
    view: HolderView | None = None
    crashed_at: datetime | None = None  # the server's time once the test had terminated it
    crashed_step: int | None = None
    finishing: bool = False
    closed: bool = False


@dataclass
class ConfigChange:
    at: datetime
    effective: CapacityGroup


@dataclass
class ExampleReport:
    """What an example did, for the benchmark's summary."""

    grants: int = 0
    holds: dict[str, int] = field(default_factory=dict)
    resumes: int = 0
    discarded: int = 0
    restarts: int = 0
    fleet_holds: int = 0
    late_reports: int = 0  # grants made while reports that were over the rule had arrived but were not yet counted
    replays: int = 0  # the semaphore's workflow tasks moved off a dead worker: its history replayed afresh
    refused_resumes: int = 0
    semaphore_events: int = 0


class Example:
    def __init__(self, harness: BreakerHarness, schedule: Schedule) -> None:
        self.h = harness
        self.s = schedule
        self.group_name = f"bp-{uuid.uuid4().hex[:10]}"
        self.group = CapacityGroup(
            name=self.group_name,
            cluster=self.group_name,
            max_draining_percent=schedule.draining_percent,
            permit_reclaim_interval=RECLAIM_INTERVAL,
        )
        self.stub = GroupStub(group=self.group, size=schedule.size, latency=dict(schedule.latency))
        self.instances = [f"i-{self.group_name}-{index}" for index in range(schedule.size)]
        self.holders: list[Holder] = []
        self.changes: list[ConfigChange] = []
        self.effective = self.group
        self.holds: dict[datetime, BreakerHold] = {}
        self.resumes: list[ResumeRecord] = []
        # Impairments as the test reported them: the latest of each instance, (at, silent_since), as the breaker's
        # book keeps them; and every report, since a hold may trip on a book that later reports changed.
        self.impaired: dict[str, tuple[datetime, datetime | None]] = {}
        self.reports: list[ImpairmentReport] = []
        self.last_resume_at: datetime | None = None
        # Repairs waiting when a --discard-held resume was sent, with the step's index: each must be denied (unless
        # it had crashed before: the denial cannot reach it), and never granted.
        self.discarded: dict[tuple[str, str], int] = {}
        self.cap_lowered = False
        self.fleet_held = False
        self.problems: list[str] = []
        self.step_index = -1
        self.report = ExampleReport()
        self._handle: WorkflowHandle[Any, Any] | None = None

    # -- running --

    @property
    def semaphore(self) -> WorkflowHandle[Any, Any]:
        assert self._handle is not None
        return self._handle

    async def run(self) -> ExampleReport:
        self.h.stubs.groups[self.group_name] = self.stub
        try:
            self._handle = await self.h.client.start_workflow(
                names.SEMAPHORE_WORKFLOW,
                SemaphoreInput(group=self.group_name),
                id=semaphore_workflow_id(self.group_name),
                task_queue=self.h.task_queue,
            )
            # Later steps follow whichever run is current (continue-as-new).
            self._handle = self.h.client.get_workflow_handle(semaphore_workflow_id(self.group_name))
            await self.settle()
            for index, step in enumerate(self.s.steps):
                self.step_index = index
                await self.apply(step)
                if getattr(step, "settle", True):
                    # After a skip the stub repairs' timers may have them asking again: wait for them too.
                    await (self.quiet() if isinstance(step, Skip) else self.settle())
                    await self.observe(step)
            self.step_index = len(self.s.steps)
            await self.finish([holder for holder in self.holders if not holder.closed and not holder.finishing])
            await self.settle()
            await self.observe(None)
            await self.collect_views()
            await self.check_semaphore_alive()
            self.check_grants()
            self.check_events()
        finally:
            await self.clean_up()
            del self.h.stubs.groups[self.group_name]
        if self.problems:
            raise AssertionError(
                f"{len(self.problems)} properties failed for group {self.group_name} (size {self.s.size}):\n- "
                + "\n- ".join(self.problems[:20])
            )
        return self.report

    async def apply(self, step: Step) -> None:
        if isinstance(step, Impair):
            await self.impair(step)
        elif isinstance(step, Request):
            await self.request(step)
        elif isinstance(step, Finish):
            await self.finish(self.pick(step.count, step.start))
        elif isinstance(step, Crash):
            await self.crash(self.pick(step.count, step.start))
        elif isinstance(step, Skip):
            await self.h.env.sleep(timedelta(seconds=step.seconds))
        elif isinstance(step, SetCap):
            await self.update(GroupConfigUpdate(max_draining_percent=step.percent, requested_by="property"))
        elif isinstance(step, SetBreaker):
            await self.update(
                GroupConfigUpdate(
                    max_impaired_percent=step.percent, min_impaired=step.min_impaired, requested_by="property"
                )
            )
        elif isinstance(step, SetBudget):
            await self.update(GroupConfigUpdate(max_repairs_per_day=step.per_day, requested_by="property"))
        elif isinstance(step, Reset):
            await self.update(GroupConfigUpdate(reset=True, requested_by="property"))
        elif isinstance(step, Resume):
            await self.resume(step)
        elif isinstance(step, FleetHold):
            await self.fleet_hold()
        elif isinstance(step, FleetResume):
            await self.fleet_resume(step)
        elif isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
        else:
            await self.restart()

    async def impair(self, step: Impair) -> None:
        now = await self.h.env.get_current_time()
        count = max(1, math.ceil(self.s.size * step.share / 100))
        chosen = [self.instances[(step.start + i) % self.s.size] for i in range(count)]
        reports = []
        for i, instance in enumerate(chosen):
            # Silences that began within 20 s of each other look like one outage to the breaker.
            silent_since = now - timedelta(minutes=10) + timedelta(seconds=(i * 7) % 20) if step.outage else None
            reports.append(
                ImpairmentReport(instance_id=instance, group=self.group_name, at=now, silent_since=silent_since)
            )
            self.reports.append(reports[-1])
            previous = self.impaired.get(instance)
            if previous is None or previous[0] < now:
                self.impaired[instance] = (now, silent_since)
        await asyncio.gather(*(self.semaphore.signal(names.SIGNAL_IMPAIRED, report) for report in reports))

    async def request(self, step: Request) -> None:
        busy = {holder.instance_id for holder in self.holders if not holder.closed}
        chosen = [self.instances[(step.start + i) % self.s.size] for i in range(min(step.count, self.s.size))]
        await asyncio.gather(
            *(self.start_repair(instance) for instance in dict.fromkeys(chosen) if instance not in busy)
        )

    async def start_repair(self, instance: str) -> None:
        workflow_id = repair_workflow_id(instance)
        self.stub.running[workflow_id] = None
        token = uuid.uuid4().hex
        handle = await self.h.client.start_workflow(
            StubRepair.run,
            HolderInput(group=self.group_name, instance_id=instance, token=token),
            id=workflow_id,
            task_queue=self.h.task_queue + HOLDER_QUEUE_SUFFIX,
        )
        run_id = handle.result_run_id or ""
        self.stub.running[workflow_id] = run_id
        self.holders.append(Holder(instance_id=instance, token=token, handle=handle, run_id=run_id))

    def pick(self, count: int, start: int) -> list[Holder]:
        live = [holder for holder in self.holders if not holder.closed and not holder.finishing]
        if not live:
            return []
        return list({id(live[(start + i) % len(live)]): live[(start + i) % len(live)] for i in range(count)}.values())

    async def finish(self, holders: Sequence[Holder]) -> None:
        for holder in holders:
            holder.finishing = True
        await asyncio.gather(*(holder.handle.signal(StubRepair.finish) for holder in holders))

    async def crash(self, holders: Sequence[Holder]) -> None:
        await self.quiet()
        for holder in holders:
            await holder.handle.terminate("crash in the breaker property test")
            # Only now may the stub report it closed: the semaphore cannot let its permit go any earlier.
            holder.crashed_at = await self.h.env.get_current_time()
            holder.crashed_step = self.step_index
            holder.closed = True
            self.stub.running.pop(holder.handle.id, None)
            self.stub.closed.add((holder.handle.id, holder.run_id))

    async def update(self, update: GroupConfigUpdate) -> None:
        state = await self.semaphore.execute_update(names.UPDATE_GROUP, update, result_type=GroupConfigState)
        if state.effective is None or state.updated_at is None:
            self.problems.append(f"step {self.step_index}: update {update} answered without a configuration")
            return
        if state.effective.max_draining(self.s.size) < self.effective.max_draining(self.s.size):
            self.cap_lowered = True
        self.effective = state.effective
        self.stub.overrides = state.overrides
        self.changes.append(ConfigChange(at=state.updated_at, effective=state.effective))

    async def resume(self, step: Resume) -> None:
        waiting: set[tuple[str, str]] = set()
        if step.discard:
            # Which repairs wait is only known at rest: one granted meanwhile is rightly not let go.
            await self.settle()
            view = await self.state()
            waiting = {(w.holder_workflow_id, w.holder_run_id or "") for w in view.waiters}
        try:
            await self.semaphore.execute_update(
                names.UPDATE_GROUP,
                GroupConfigUpdate(resume=True, discard_held=step.discard, requested_by="property"),
                result_type=GroupConfigState,
            )
        except WorkflowUpdateFailedError:
            self.report.refused_resumes += 1  # the validator refuses a resume when nothing holds
            return
        await self.settle()
        view = await self.state()
        record = view.breaker.last_resume
        if record is None or (self.resumes and record.at == self.resumes[-1].at):
            self.problems.append(f"step {self.step_index}: a resume was accepted but left no record")
            return
        self.resumes.append(record)
        self.last_resume_at = record.at
        if record.held is not None:
            self.holds.setdefault(record.held.tripped_at, record.held)
        if step.discard:
            self.discarded |= dict.fromkeys(waiting, self.step_index)
            self.report.discarded += len(waiting)
            if view.waiters:
                self.problems.append(
                    f"step {self.step_index}: still waiting after --discard-held: "
                    f"{[w.holder_workflow_id for w in view.waiters]}"
                )

    async def fleet_hold(self) -> None:
        now = await self.h.env.get_current_time()
        hold = BreakerHold(
            cause=HoldCause.FLEET,
            message="repairs of the fleet held (breaker property test)",
            tripped_at=now,
            count=0,
            threshold=0.0,
            window=timedelta(minutes=30),
        )
        self.fleet_held = True
        self.report.fleet_holds += 1
        await self.semaphore.signal(names.SIGNAL_FLEET_HOLD, HoldNotice(held=hold, by="property"))

    async def fleet_resume(self, step: FleetResume) -> None:
        if not self.fleet_held:
            return
        waiting: set[tuple[str, str]] = set()
        if step.discard:
            await self.settle()
            waiting = {(w.holder_workflow_id, w.holder_run_id or "") for w in (await self.state()).waiters}
        self.fleet_held = False
        notice = HoldNotice(held=None, discard_held=step.discard, by="property")
        await self.semaphore.signal(names.SIGNAL_FLEET_HOLD, notice)
        if step.discard:
            await self.settle()
            view = await self.state()
            self.discarded |= dict.fromkeys(waiting, self.step_index)
            self.report.discarded += len(waiting)
            if view.waiters:
                self.problems.append(
                    f"step {self.step_index}: still waiting after the fleet's --discard-held: "
                    f"{[w.holder_workflow_id for w in view.waiters]}"
                )

    async def restart(self) -> None:
        await self.quiet()
        janitors = await self.h.restart_workers()
        self.report.restarts += 1
        try:
            # A release by nobody changes nothing, but it is a workflow task, which the janitor moves off the dead
            # worker's queue: once it is done on the new worker, nothing of this example is left on the old one.
            nudge = PermitRelease(holder_workflow_id=repair_workflow_id("nudge"))
            await self.semaphore.signal(names.SIGNAL_RELEASE, nudge)
            await self.settle()
        finally:
            await self.h.stop_janitors(janitors)

    # -- waiting and observing --

    async def settle(self) -> None:
        """Until every new repair has asked, every finishing one has completed, and the semaphore has no workflow
        task, activity or outgoing signal in flight."""
        deadline = asyncio.get_running_loop().time() + SETTLE_WITHIN
        delay = POLL_FIRST
        quiet_length = -1
        while True:
            pending: list[str] = []
            for holder in self.holders:
                if holder.finishing and not holder.closed:
                    description = await holder.handle.describe()
                    if description.status == WorkflowExecutionStatus.RUNNING:
                        pending.append(f"{holder.handle.id} finishing")
                    else:
                        holder.closed = True
                        self.stub.running.pop(holder.handle.id, None)
                        self.stub.closed.add((holder.handle.id, holder.run_id))
                elif not holder.closed and (holder.view is None or not holder.view.requested):
                    holder.view = await self.query_holder(holder)
                    if holder.view is None or not holder.view.requested:
                        pending.append(f"{holder.handle.id} not asked yet")
            if not pending:
                # The history's length is cheap to ask; only a history that stopped growing is read and scanned.
                description = await self.semaphore.describe()
                length = description.raw_description.workflow_execution_info.history_length
                if length != quiet_length:
                    quiet_length = length
                    pending.append("the semaphore's history is growing")
                else:
                    pending += open_work([event async for event in self.semaphore.fetch_history_events()])
                    if not pending:
                        return
            if asyncio.get_running_loop().time() > deadline - SETTLE_WITHIN + 2:
                # Busy for seconds: a workflow task that fails and is retried (a replay that went another way)
                # never settles; say so now, with its message, rather than after the deadline.
                failures = failed_tasks([event async for event in self.semaphore.fetch_history_events()])
                if failures:
                    raise AssertionError(f"step {self.step_index} ({self.describe_step()}): {failures[-1]}")
            if asyncio.get_running_loop().time() > deadline:
                hint = ""
                if isinstance(
                    self.s.steps[self.step_index] if 0 <= self.step_index < len(self.s.steps) else None, Restart
                ):
                    # A replay that took another path fails or stalls its workflow task; the server records only
                    # the first failure of a task, and after a restart that one is the janitor's.
                    hint = " (after a restart: most likely the new worker's replay of the history went another way)"
                raise AssertionError(
                    f"step {self.step_index} ({self.describe_step()}): the semaphore and its repairs did not settle "
                    f"within {SETTLE_WITHIN}s: {pending[:10]}{hint}"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MOST)

    async def quiet(self) -> None:
        """Settled, and no stub repair in the middle of a workflow task either (a query answers only after it).
        The test server leaks its time-skipping lock for good when a workflow is terminated in the middle of one
        (every later skip then times out), and a worker shut down mid-task leaves the task to time out (10 s)."""
        await self.settle()
        for holder in self.holders:
            while not holder.closed and (view := await self.query_holder(holder)) is None:
                await asyncio.sleep(POLL_MOST)
            if not holder.closed:
                holder.view = view

    async def query_holder(self, holder: Holder) -> HolderView | None:
        try:
            return await holder.handle.query(StubRepair.view, rpc_timeout=timedelta(seconds=2))
        except Exception:  # answered by the janitor (the worker is gone) or not yet: asked again
            return None

    async def state(self) -> SemaphoreView:
        return await self.semaphore.query(
            names.QUERY_STATE, result_type=SemaphoreView, rpc_timeout=timedelta(seconds=10)
        )

    def describe_step(self) -> str:
        if 0 <= self.step_index < len(self.s.steps):
            return repr(self.s.steps[self.step_index])
        return "start" if self.step_index < 0 else "wind-down"

    async def observe(self, step: Step | None) -> None:
        """The semaphore's view once settled: what it holds, and what must be true of it at rest."""
        view = await self.state()
        where = f"step {self.step_index} ({self.describe_step()})"
        held = view.breaker.held
        if held is not None:
            self.holds.setdefault(held.tripped_at, held)
        cap = self.effective.max_draining(self.s.size)
        if view.group_size:
            if view.group_size != self.s.size:
                self.problems.append(f"{where}: group size {view.group_size}, expected {self.s.size}")
            if view.capacity != cap:
                self.problems.append(f"{where}: the semaphore's cap is {view.capacity}, the one in force {cap}")
        if not self.cap_lowered and len(view.holders) > cap:
            self.problems.append(f"{where}: {len(view.holders)} holders over the cap of {cap}")
        if held is None and view.breaker.fleet_held is None and view.waiters and len(view.holders) < view.capacity:
            self.problems.append(
                f"{where}: {len(view.waiters)} waiting while {len(view.holders)} of {view.capacity} permits are "
                "held and nothing holds repairs"
            )
        if isinstance(step, Impair):
            self.check_trip(view, where)

    def check_trip(self, view: SemaphoreView, where: str) -> None:
        """Must the breaker hold now? Counted conservatively: impairments clearly after the last resume and clearly
        within the window, against the rule in force (the count happened after the update returned)."""
        if view.breaker.held is not None:
            return
        rule = self.effective.breaker_rule()
        now = max(at for at, _ in self.impaired.values())
        since = now - rule.impaired_window + timedelta(minutes=1)
        if self.last_resume_at is not None:
            since = max(since, self.last_resume_at + timedelta(seconds=1))
        counted = {instance: seen for instance, seen in self.impaired.items() if seen[0] >= since}
        threshold = rule.threshold(self.s.size)
        outage = largest_outage([silent for _, silent in counted.values() if silent is not None])
        if len(counted) > threshold:
            self.problems.append(
                f"{where}: not held with {len(counted)} of {self.s.size} impaired in the window, over the "
                f"threshold {threshold:g}"
            )
        elif outage > rule.min_impaired:
            self.problems.append(
                f"{where}: not held with {outage} heartbeat losses that began within {OUTAGE_SPREAD.seconds}s "
                f"(min_impaired {rule.min_impaired})"
            )

    async def collect_views(self) -> None:
        for holder in self.holders:
            if holder.crashed_at is None:
                # Through the workers' plain client: the environment's client lets time skip while it waits for a
                # result, and a skip to the next timer (none, here: the semaphore's ten-year run timeout) is not
                # what the schedule said.
                handle = self.h.worker_client.get_workflow_handle(
                    holder.handle.id, run_id=holder.run_id, result_type=HolderView
                )
                holder.view = await handle.result()

    async def check_semaphore_alive(self) -> None:
        description = await self.semaphore.describe()
        if description.status != WorkflowExecutionStatus.RUNNING:
            self.problems.append(f"the semaphore is {description.status}, not running")
        run_id: str | None = description.run_id
        runs: list[list[HistoryEvent]] = []
        while run_id:
            handle = self.h.client.get_workflow_handle(semaphore_workflow_id(self.group_name), run_id=run_id)
            run_id = None
            events = [event async for event in handle.fetch_history_events()]
            runs.insert(0, events)
            self.report.semaphore_events += len(events)
            self.report.replays += sum(
                event.workflow_task_failed_event_attributes.cause == RESET_STICKY
                for event in events
                if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
            )
            self.problems += failed_tasks(events)
            if events and events[0].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
                run_id = events[0].workflow_execution_started_event_attributes.continued_execution_run_id or None
        self.check_grants_in_order(Timeline.of(runs))

    # -- the properties over the whole example --

    def check_grants(self) -> None:
        granted = [h for h in self.holders if h.view is not None and h.view.granted_at is not None]
        self.report.grants = len(granted)
        for holder in self.holders:
            view = holder.view
            if view is None:
                self.problems.append(f"{holder.handle.id}: no record of what it saw")
                continue
            key = (holder.handle.id, holder.run_id)
            if view.foreign_tokens:
                self.problems.append(f"{key[0]}: {view.foreign_tokens} grants or denials with another's token")
            if view.denied_after_grant or view.granted_after_denial or (view.denied and view.granted_at):
                self.problems.append(f"{key[0]}: both granted (at {view.granted_at}) and denied")
            gone = holder.crashed_step is not None and holder.crashed_step < self.discarded.get(key, -1)
            if key in self.discarded and not view.denied and not gone:
                self.problems.append(f"{key[0]}: waiting at a --discard-held resume, never denied")
            if key in self.discarded and view.granted_at is not None:
                self.problems.append(f"{key[0]}: discarded, then granted at {view.granted_at}")
        for holder in granted:
            self.check_cap_at_grant(holder, granted)
            self.check_budget_at_grant(holder, granted)
            self.check_not_held_at_grant(holder)

    def check_grants_in_order(self, timeline: Timeline) -> None:
        """What the semaphore knew when it granted, from the order of its history: a signal recorded before the
        completion of the workflow task that sent a grant had been handed to that task or an earlier one.

        - No grant after a fleet hold notice had arrived, until a resume notice had.
        - No grant after impairments over the rule had arrived (the semaphore counts what arrived before any grant:
          "never a grant past the rule"): the latest report of each instance handed over since the last resume
          (one handed to the resume's own task is left out: it may have come first), within the window, against
          the highest threshold in force."""
        for task, grant in timeline.grants:
            where = f"grant to {grant.holder_workflow_id} at {grant.granted_at.isoformat()} (workflow task {task})"
            notices = [notice for at, notice in timeline.fleet if at <= task]
            if notices and notices[-1].held is not None:
                self.problems.append(f"{where}: the fleet's hold notice had arrived, and no resume")
            resumed = max((at for at in timeline.resumes if at <= task), default=0)
            window = max(group.impaired_window for group in self.in_force(grant.granted_at))
            known: dict[str, ImpairmentReport] = {}
            for at, report in timeline.reports:
                if resumed < at <= task and report.at >= grant.granted_at - window + timedelta(minutes=1):
                    known[report.instance_id] = report
            rules = [group.breaker_rule() for group in self.in_force(grant.granted_at)]
            threshold = max(rule.threshold(self.s.size) for rule in rules)
            outage = largest_outage([r.silent_since for r in known.values() if r.silent_since is not None])
            if len(known) > threshold or outage > max(rule.min_impaired for rule in rules):
                self.report.late_reports += 1
                self.problems.append(
                    f"{where}: {len(known)} impairments had arrived since the last resume (threshold "
                    f"{threshold:g}; {outage} heartbeat losses together), not yet counted"
                )

    def ending(self, holder: Holder) -> datetime | None:
        """No earlier than this the semaphore let the permit go (None: not before the example's end)."""
        assert holder.view is not None
        if holder.crashed_at is not None:
            return holder.crashed_at
        return holder.view.released_at

    def in_force(self, at: datetime) -> list[CapacityGroup]:
        """The configurations that may have been in force at `at`: the latest before it, and any made at that very
        millisecond (which of the two the semaphore saw is not known)."""
        before = [change.effective for change in self.changes if change.at < at]
        same = [change.effective for change in self.changes if change.at == at]
        return [before[-1] if before else self.group, *same]

    def check_cap_at_grant(self, holder: Holder, granted: Sequence[Holder]) -> None:
        assert holder.view is not None and holder.view.granted_at is not None
        at = holder.view.granted_at
        holding = [
            other
            for other in granted
            if other is not holder
            and other.view is not None
            and other.view.granted_at is not None
            and other.view.granted_at <= at
            and ((end := self.ending(other)) is None or end > at)
        ]
        cap = max(group.max_draining(self.s.size) for group in self.in_force(at))
        if len(holding) + 1 > cap:
            self.problems.append(
                f"{holder.handle.id} granted at {at.isoformat()} with {len(holding)} others holding "
                f"({', '.join(sorted(o.instance_id for o in holding))}): over the cap of {cap}"
            )

    def check_budget_at_grant(self, holder: Holder, granted: Sequence[Holder]) -> None:
        assert holder.view is not None and holder.view.granted_at is not None
        at = holder.view.granted_at
        budgets = [group.max_repairs_per_day for group in self.in_force(at)]
        if any(budget is None for budget in budgets):
            return
        budget = max(b for b in budgets if b is not None)
        since = at - REPAIR_BUDGET_PERIOD
        resumed = [record.at for record in self.resumes if record.at < at]
        if resumed:
            since = max(since, resumed[-1])
        day = [
            other
            for other in granted
            if other.view is not None and other.view.granted_at is not None and since < other.view.granted_at <= at
        ]
        if len(day) > budget:
            self.problems.append(
                f"{holder.handle.id} granted at {at.isoformat()}: {len(day)} grants within a day, over the budget "
                f"of {budget}"
            )

    def check_not_held_at_grant(self, holder: Holder) -> None:
        assert holder.view is not None and holder.view.granted_at is not None
        at = holder.view.granted_at
        for tripped_at, hold in self.holds.items():
            ended = next((r.at for r in self.resumes if r.held is not None and r.held.tripped_at == tripped_at), None)
            if tripped_at < at and (ended is None or at < ended):
                until = ended.isoformat() if ended else "the end"
                self.problems.append(
                    f"{holder.handle.id} granted at {at.isoformat()} while held ({hold.cause}, tripped at "
                    f"{tripped_at.isoformat()}, resumed at {until})"
                )

    def check_events(self) -> None:
        held_events = [e for e in self.stub.events if e.type.value == "RepairsHeld"]
        resumed_events = [e for e in self.stub.events if e.type.value == "RepairsResumed"]
        published = {BreakerHold.model_validate(e.fields).tripped_at for e in held_events}
        for tripped_at, hold in self.holds.items():
            if tripped_at not in published:
                self.problems.append(f"hold tripped at {tripped_at.isoformat()} ({hold.cause}): no RepairsHeld event")
            self.report.holds[hold.cause.value] = self.report.holds.get(hold.cause.value, 0) + 1
            self.check_hold_counts(hold)
        for event in held_events:
            hold = BreakerHold.model_validate(event.fields)
            self.holds.setdefault(hold.tripped_at, hold)
        if len(resumed_events) != len(self.resumes):
            self.problems.append(f"{len(self.resumes)} resumes, {len(resumed_events)} RepairsResumed events")
        for event, record in zip(resumed_events, self.resumes, strict=False):
            if event.fields.get("discard_held") != record.discard_held:
                self.problems.append(f"RepairsResumed at {event.time.isoformat()} says discard_held wrongly")
        self.report.resumes = len(self.resumes)

    def check_hold_counts(self, hold: BreakerHold) -> None:
        """A hold never counts more than was reported since the resume before it: an upper bound (the window is not
        applied, and every instance with any such report counts, whatever later reports replaced)."""
        resumed = [record.at for record in self.resumes if record.at <= hold.tripped_at]
        since = resumed[-1] - timedelta(seconds=1) if resumed else None
        reports = [r for r in self.reports if (since is None or r.at >= since) and r.at <= hold.tripped_at]
        impaired = {r.instance_id for r in reports}
        silent = {r.instance_id for r in reports if r.silent_since is not None}
        if hold.cause is HoldCause.IMPAIRED_PERCENT and not hold.threshold < hold.count <= len(impaired):
            self.problems.append(
                f"hold at {hold.tripped_at.isoformat()} counts {hold.count} impaired (threshold {hold.threshold:g}); "
                f"{len(impaired)} instances were reported since the last resume"
            )
        if hold.cause is HoldCause.MONITORING_OUTAGE and not hold.threshold < hold.count <= len(silent):
            self.problems.append(
                f"hold at {hold.tripped_at.isoformat()} counts an outage of {hold.count} (min_impaired "
                f"{hold.threshold:g}); {len(silent)} heartbeat losses were reported since the last resume"
            )

    async def clean_up(self) -> None:
        for holder in self.holders:
            if not holder.closed:
                with contextlib.suppress(Exception):
                    await holder.handle.terminate("example over")
        if self._handle is not None:
            with contextlib.suppress(Exception):
                await self._handle.terminate("example over")


def largest_outage(silences: Sequence[datetime]) -> int:
    """The most silences that began within OUTAGE_SPREAD of one another (the breaker's outage rule)."""
    ordered = sorted(silences)
    best = start = 0
    for end in range(len(ordered)):
        while ordered[end] - ordered[start] > OUTAGE_SPREAD:
            start += 1
        best = max(best, end - start + 1)
    return best


@dataclass
class Timeline:
    """A semaphore's history as what its workflow tasks saw: each signal by the first task it was handed to, each
    grant and each resume by the task that made it (tasks numbered by their completions, across runs)."""

    grants: list[tuple[int, PermitGrant]] = field(default_factory=list)
    reports: list[tuple[int, ImpairmentReport]] = field(default_factory=list)
    fleet: list[tuple[int, HoldNotice]] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, runs: Sequence[Sequence[HistoryEvent]]) -> Timeline:
        timeline = cls()
        done = 0  # workflow tasks completed so far
        convert = pydantic_data_converter.payload_converter
        for events in runs:
            for event in events:
                kind = event.event_type
                if kind == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                    done += 1
                elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                    signal = event.workflow_execution_signaled_event_attributes
                    payloads = signal.input.payloads
                    # Handed to the next task to complete (a signal that came during a task is recorded after it).
                    if signal.signal_name == names.SIGNAL_IMPAIRED and len(payloads) == 1:
                        timeline.reports.append((done + 1, convert.from_payload(payloads[0], ImpairmentReport)))
                    elif signal.signal_name == names.SIGNAL_FLEET_HOLD and len(payloads) == 1:
                        timeline.fleet.append((done + 1, convert.from_payload(payloads[0], HoldNotice)))
                elif kind == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
                    command = event.signal_external_workflow_execution_initiated_event_attributes
                    if command.signal_name == names.SIGNAL_PERMIT_GRANTED:
                        timeline.grants.append((done, convert.from_payload(command.input.payloads[0], PermitGrant)))
                elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
                    request = event.workflow_execution_update_accepted_event_attributes.accepted_request.input
                    update = convert.from_payload(request.args.payloads[0], GroupConfigUpdate)
                    if request.name == names.UPDATE_GROUP and update.resume:
                        # The handler resumes before its first await: in the task that accepted it.
                        timeline.resumes.append(done)
        return timeline


def failed_tasks(events: Sequence[HistoryEvent]) -> list[str]:
    """The workflow task failures of a history that the server did not cause itself."""
    failures = []
    for event in events:
        if event.event_type != EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
            continue
        attributes = event.workflow_task_failed_event_attributes
        if attributes.cause not in SERVER_CAUSED:
            cause = WorkflowTaskFailedCause.Name(attributes.cause).removeprefix("WORKFLOW_TASK_FAILED_CAUSE_")
            failures.append(f"workflow task failed (event {event.event_id}, {cause}): {attributes.failure.message}")
    return failures


def open_work(events: Sequence[HistoryEvent]) -> list[str]:
    """What a workflow's history shows in flight: a workflow task, activities, signals to other workflows."""
    task = False
    activities: set[int] = set()
    signals: set[int] = set()
    for event in events:
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
            task = True
        elif kind in (
            EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED,
            EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED,
            EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT,
        ):
            task = False
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            activities.add(event.event_id)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            activities.discard(event.activity_task_completed_event_attributes.scheduled_event_id)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
            activities.discard(event.activity_task_failed_event_attributes.scheduled_event_id)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
            activities.discard(event.activity_task_timed_out_event_attributes.scheduled_event_id)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED:
            activities.discard(event.activity_task_canceled_event_attributes.scheduled_event_id)
        elif kind == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            signals.add(event.event_id)
        elif kind == EventType.EVENT_TYPE_EXTERNAL_WORKFLOW_EXECUTION_SIGNALED:
            signals.discard(event.external_workflow_execution_signaled_event_attributes.initiated_event_id)
        elif kind == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_FAILED:
            signals.discard(event.signal_external_workflow_execution_failed_event_attributes.initiated_event_id)
    pending = ["a workflow task"] if task else []
    pending += [f"activity {i}" for i in sorted(activities)] + [f"signal {i}" for i in sorted(signals)]
    return pending


# --- pytest ------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def breaker_harness() -> Iterator[BreakerHarness]:
    harness = BreakerHarness()
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture(scope="module")
def harness() -> Iterator[BreakerHarness]:
    with breaker_harness() as running:
        yield running


# CI: 100 schedules, the same ones every run (derandomize, no example database). The longer profile runs more of
# them with the same code: BREAKER_PROPERTY_EXAMPLES=1000 .venv/bin/pytest tests/test_breaker_property.py
EXAMPLES = int(os.environ.get("BREAKER_PROPERTY_EXAMPLES", "100"))
CI_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# Scenarios every run covers, whatever the draw: repairs let go on a discarding resume; a crashed holder's permit
# reclaimed and the day's budget spent; a monitoring outage held across worker restarts.
DISCARD = Schedule(
    12, 20, (Request(4, 0), Impair(40, 0, False), Request(4, 4), Resume(True), Finish(8, 0), Request(3, 8))
)
BUDGET = Schedule(10, 30, (SetBudget(3), Request(5, 0), Crash(1, 0), Skip(31 * 60), Finish(2, 1), Resume(False)))
OUTAGE = Schedule(50, 10, (Request(6, 0), Impair(10, 10, True), Restart(), Request(2, 6), Resume(False), Restart()))
# Product bugs the property test found, pinned with the latency that makes each race certain (a grant pass looks
# the group up, then the batch's repairs; what lands meanwhile is not looked at again before the batch is granted):
# - the operator lowers the cap while the pass counts the group: the answer's old cap wins, five granted, not one;
# - the fleet breaker's hold notice arrives while the pass checks its batch: the batch is granted anyway;
# - impairments over the rule arrive then: the batch is granted before they are counted (and the breaker trips).
# Ten or thirteen instances; cap 5 (50%) or 1 (10%); with instant activities each race still hits now and then.
CAP_RACE = Schedule(
    10,
    50,
    (Request(8, 0, settle=False), SetCap(10)),
    latency=(("get_group_config", 0.5), ("describe_group_capacity", 1.0)),
)
FLEET_RACE = Schedule(
    13,
    10,
    (Request(8, 0), Finish(1, 0, settle=False), Pause(0.15), FleetHold(settle=False), Skip(10), FleetResume(False)),
    latency=(("find_running_repairs", 0.3),),
)
REPORT_RACE = Schedule(
    13,
    10,
    (Request(8, 0), Finish(1, 0, settle=False), Pause(0.15), Impair(45, 0, False, settle=False), Skip(10)),
    latency=(("find_running_repairs", 0.3),),
)


# Races the property test found, each fixed in DrainSemaphoreWorkflow: pinned here.
@pytest.mark.parametrize("schedule", [CAP_RACE, FLEET_RACE, REPORT_RACE], ids=["cap", "fleet-hold", "impairments"])
def test_what_lands_during_a_grant_pass_counts(harness: BreakerHarness, schedule: Schedule) -> None:
    harness.run(schedule)


# Passing, about 1 s a schedule (100 s in CI, 20 minutes for 1,000); failing, hypothesis shrinks for up to 5 minutes
# more (its own limit). pytest-timeout's 300 s would cut either short in the middle of an example, and its marker
# wins over --timeout: 3 s a schedule and the 5 minutes.
@pytest.mark.timeout(300 + 3 * EXAMPLES)
@CI_SETTINGS
@example(schedule=DISCARD)
@example(schedule=BUDGET)
@example(schedule=OUTAGE)
@given(schedule=schedules())
def test_semaphore_never_exceeds_the_cap_nor_grants_while_held(harness: BreakerHarness, schedule: Schedule) -> None:
    harness.run(schedule)
