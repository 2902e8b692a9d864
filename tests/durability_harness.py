"""What tests/test_repair_durability.py needs to kill a repair in a chosen phase and prove it still ends exactly once.

- `EngineProcess`: `autorepair worker` as a child process, so it can be SIGKILLed and started again.
- `HoldingAws`: a loopback proxy in front of moto that forwards every call and, for one chosen call, holds moto's
  answer back: AWS has done the work (the instance launched, the container instance DRAINING, the instance
  terminated) and the worker has not heard so. A kill then leaves the step done in AWS and not in the history.
- `durable_fleet`: the simulated fleet with the timings, workload and group settings a phase needs, the engine
  behind the proxy and in its own process.
- The checks: which phase the server recorded, whether anything but the expected calls is in flight, and the
  exactly-once state of EC2 and of the drain semaphore afterwards.

The repair's workflow id is always read from its health workflow's view or listed by search attribute, never built:
its scheme is not this module's to know.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import Counter
from collections.abc import AsyncIterator, Collection, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from temporalio.api.enums.v1 import EventType, PendingActivityState, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowExecutionStatus

from contract import names
from contract import search_attributes as sa
from contract.names import GROUP_TAG
from contract.repair import RepairPhase
from simulator.aws_proxy import HOP_BY_HOP, forward, parse_request
from simulator.engine_process import EngineProcess
from simulator.fleet import SimTiming, SimulatedFleet
from simulator.fleet_aws import SimWorkload
from tests.fleet import Fleet, assert_start_before_stop
from tests.harness import eventually, make_settings, unique, worker_process
from workflows.models import RepairStatus

# Below botocore's 60 s read timeout: a held answer must never turn into botocore's own retry of the call, which
# moto (it ignores ClientToken) would answer with a second instance that real AWS would not launch.
MAX_HOLD_S = 45.0
QUERY_TIMEOUT = timedelta(seconds=5)


# --- the worker process -----------------------------------------------------------------------------------------


# --- the proxy that holds one answer ----------------------------------------------------------------------------


@dataclass
class HeldCall:
    """The first `action` request whose body names `needle`: forwarded to moto at once, answered only on release."""

    action: str
    needle: str
    taken: bool = False
    arrived: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)


class HoldingAws:
    """Loopback HTTP proxy to moto that holds back the answers of the calls `hold()` names (one call each)."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        assert parts.scheme == "http" and parts.hostname, upstream
        self.upstream = (parts.hostname, parts.port or 80)
        self._lock = threading.Lock()
        self._holds: list[HeldCall] = []
        self._seen: list[tuple[str, str]] = []  # (action, path and body) of every request, in arrival order
        self._server = _QuietServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def hold(self, action: str, needle: str) -> HeldCall:
        held = HeldCall(action=action, needle=needle)
        with self._lock:
            self._holds.append(held)
        return held

    def release_all(self) -> None:
        with self._lock:
            for held in self._holds:
                held.released.set()

    def requests(self, action: str, needle: str) -> int:
        """Requests for `action` whose path or body names `needle` (each botocore attempt counts)."""
        with self._lock:
            return sum(1 for seen_action, text in self._seen if seen_action == action and needle in text)

    def _claim(self, action: str, text: str) -> HeldCall | None:
        with self._lock:
            self._seen.append((action, text))
            for held in self._holds:
                if not held.taken and held.action == action and held.needle in text:
                    held.taken = True
                    return held
            return None

    def __enter__(self) -> HoldingAws:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="holding-aws", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release_all()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a caller SIGKILLed mid-request resets its connection: expected here, not worth a traceback


def _handler_for(proxy: HoldingAws) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            request = parse_request({k.lower(): v for k, v in self.headers.items()}, self.path, body)
            held = proxy._claim(request.action, self.path + "\n" + body.decode("utf-8", "replace"))
            forwarded = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP]
            status, upstream_headers, out_body = forward(proxy.upstream, self.command, self.path, forwarded, body)
            if held is not None:
                held.arrived.set()
                held.released.wait(MAX_HOLD_S)
            try:
                self.send_response(status)
                for name, value in upstream_headers:
                    if name.lower() not in HOP_BY_HOP | {"server", "date"}:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(out_body)))
                self.end_headers()
                self.wfile.write(out_body)
            except OSError:
                # The caller was SIGKILLed while its answer was held: nobody is left to tell.
                self.close_connection = True

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


# --- the fleet --------------------------------------------------------------------------------------------------


@dataclass
class DurableFleet:
    """The simulated fleet (moto direct), the engine in `worker` (AWS through `aws`), and the module's server."""

    fleet: Fleet
    worker: EngineProcess
    aws: HoldingAws
    instances: int

    @property
    def client(self) -> Client:
        return self.fleet.client

    @property
    def sim(self) -> SimulatedFleet:
        return self.fleet.sim


@asynccontextmanager
async def durable_fleet(
    client: Client,
    moto_endpoint: str,
    tmp_path: Path,
    *,
    instances: int = 5,
    timing: Mapping[str, Any] | None = None,
    workload: SimWorkload | None = None,
    group_settings: Mapping[str, Any] | None = None,
    events: Mapping[str, Any] | None = None,
) -> AsyncIterator[DurableFleet]:
    """`instances` healthy simulated instances of a new group, repaired by a worker process that talks to AWS through
    a `HoldingAws`. `timing` overrides the compressed simulation timings, `group_settings` the group's settings,
    `events` the event settings."""
    group = unique("gpu")
    sim_timing = SimTiming.compressed().model_copy(update=dict(timing or {}))
    events_path = tmp_path / "events.jsonl"
    with HoldingAws(moto_endpoint) as aws:
        settings = make_settings(
            client,
            aws.url,
            events_path,
            group=group,
            cluster=group,
            launch_template=f"{group}-lt",
            heartbeat_loss_threshold=sim_timing.heartbeat_loss_threshold,
            heartbeat_interval=sim_timing.heartbeat_interval,
        )
        # A dead permit holder is not what these tests make: its check may wait, and so fires less often mid-kill.
        changes = {"permit_reclaim_interval": timedelta(seconds=30), **(group_settings or {})}
        settings = settings.model_copy(
            update={
                "groups": [settings.groups[0].model_copy(update=changes)],
                "events": settings.events.model_copy(update=dict(events or {})),
            }
        )
        sim = SimulatedFleet(
            group=group,
            cluster=group,
            state_dir=tmp_path / "fleet",
            instances=instances,
            seed=13,
            launch_template=f"{group}-lt",
            endpoint_url=moto_endpoint,
            client=client,
            task_queue=settings.temporal.task_queue,
            timing=sim_timing,
            workload=workload,
        )
        async with AsyncExitStack() as stack:
            worker = await stack.enter_async_context(worker_process(settings, tmp_path / "worker.log"))
            await sim.setup()
            stack.push_async_callback(sim.close)
            fleet = Fleet(
                sim=sim, settings=settings, events_path=events_path, client=client, moto_endpoint=moto_endpoint
            )
            durable = DurableFleet(fleet=fleet, worker=worker, aws=aws, instances=instances)
            await fleet.all_healthy(instances)
            yield durable


# --- looking at repairs -----------------------------------------------------------------------------------------


async def repair_id(fleet: DurableFleet, instance_id: str) -> str:
    """The id of the instance's repair, as its health workflow reports it."""
    view = await eventually(
        lambda: fleet.sim.health(instance_id), lambda v: v is not None and v.repair is not None, within=60, every=0.2
    )
    assert view is not None and view.repair is not None
    return view.repair.workflow_id


async def repair_status(client: Client, workflow_id: str) -> RepairStatus:
    handle = client.get_workflow_handle(workflow_id)
    return await handle.query(names.QUERY_STATUS, result_type=RepairStatus, rpc_timeout=QUERY_TIMEOUT)


async def in_phase(client: Client, workflow_id: str, phase: RepairPhase, *, within: float = 60) -> RepairStatus:
    return await eventually(
        lambda: repair_status(client, workflow_id), lambda s: s.phase is phase, within=within, every=0.2
    )


async def recorded_phase(client: Client, workflow_id: str) -> str | None:
    """The phase the server has on record (the RepairPhase search attribute): with no worker, it cannot move."""
    described = await client.get_workflow_handle(workflow_id).describe(rpc_timeout=QUERY_TIMEOUT)
    return described.typed_search_attributes.get(sa.REPAIR_PHASE)


async def in_flight(client: Client, task_queue: str) -> dict[str, list[tuple[str, str]]]:
    """Every pending activity of the running workflows on the task queue: workflow id -> [(activity, state)]."""
    found: dict[str, list[tuple[str, str]]] = {}
    query = f"TaskQueue = {sa.quoted(task_queue)} AND ExecutionStatus = 'Running'"
    async for execution in client.list_workflows(query, rpc_timeout=QUERY_TIMEOUT):
        described = await client.get_workflow_handle(execution.id).describe(rpc_timeout=QUERY_TIMEOUT)
        pending = described.raw_description.pending_activities
        if pending:
            found[execution.id] = [(p.activity_type.name, PendingActivityState.Name(p.state)) for p in pending]
    return found


async def quiet_but(client: Client, task_queue: str, expected: Mapping[str, str], *, within: float = 60) -> None:
    """Wait until the calls in flight on the task queue are exactly `expected` (workflow id -> activity, started).

    A kill then costs only what the test means it to: every other step either is done or has not begun, so no other
    workflow waits out an activity timeout that has nothing to do with the phase under test."""
    deadline = asyncio.get_running_loop().time() + within
    want = {wf: [(activity, "PENDING_ACTIVITY_STATE_STARTED")] for wf, activity in expected.items()}
    # Twice in a row: one look takes a describe per workflow, and a workflow described early in it may have started
    # a call by the end (a grant pass, a published event); two in a row mean every workflow is at rest.
    looks = [await in_flight(client, task_queue)]
    while looks[-2:] != [want, want]:
        assert asyncio.get_running_loop().time() < deadline, f"in flight on {task_queue}: {looks[-1]}, not {want}"
        await asyncio.sleep(0.2)
        looks = [*looks[-1:], await in_flight(client, task_queue)]


async def repairs_of(client: Client, group: str) -> dict[str, list[WorkflowExecutionStatus | None]]:
    """Every repair workflow execution of the group, by instance, listed by its search attributes."""
    query = f"WorkflowType = {sa.quoted(names.REPAIR_WORKFLOW)} AND CapacityGroup = {sa.quoted(group)}"
    found: dict[str, list[WorkflowExecutionStatus | None]] = {}
    async for execution in client.list_workflows(query, rpc_timeout=QUERY_TIMEOUT):
        instance = execution.typed_search_attributes.get(sa.INSTANCE_ID) or "?"
        found.setdefault(instance, []).append(execution.status)
    return found


# --- exactly once -----------------------------------------------------------------------------------------------


def group_ec2_states(fleet: Fleet) -> dict[str, str]:
    """Every EC2 instance tagged with the group (initial ones and replacements): id -> state."""
    paginator = fleet.ec2().get_paginator("describe_instances")
    states: dict[str, str] = {}
    for page in paginator.paginate(Filters=[{"Name": f"tag:{GROUP_TAG}", "Values": [fleet.group]}]):
        for reservation in page["Reservations"]:
            for instance in reservation["Instances"]:
                states[instance["InstanceId"]] = instance["State"]["Name"]
    return states


async def assert_repaired_exactly_once(
    durable: DurableFleet, impaired: Collection[str], *, tolerating: Collection[str] = ()
) -> None:
    """Each impaired instance repaired once (assert_instance_repaired_once), and the group whole afterwards."""
    for instance_id in impaired:
        await assert_instance_repaired_once(durable, instance_id, tolerating=tolerating)
    await assert_group_whole(durable, impaired)


async def assert_instance_repaired_once(
    durable: DurableFleet, instance_id: str, *, tolerating: Collection[str] = ()
) -> None:
    """One repair execution of the instance, completed; start-before-stop in its events, each step once; one
    replacement launched (tagged for it) and running; the instance itself terminated."""
    fleet = durable.fleet
    await assert_start_before_stop(fleet, instance_id, tolerating=tolerating)
    completed = WorkflowExecutionStatus.COMPLETED
    repairs = await eventually(
        lambda: repairs_of(durable.client, fleet.group), lambda found: found.get(instance_id) == [completed], within=30
    )
    assert repairs[instance_id] == [completed]


async def assert_group_whole(durable: DurableFleet, impaired: Collection[str]) -> None:
    """EC2 holds the group's instances plus one replacement per impaired instance, and has terminated the impaired
    ones and nothing else; no repair but theirs ran; the drain semaphore holds no permit and has no waiter."""
    fleet = durable.fleet
    states = await asyncio.to_thread(group_ec2_states, fleet)  # off the probes' loop: assert_start_before_stop
    terminated = sorted(i for i, state in states.items() if state == "terminated")
    running = [i for i, state in states.items() if state == "running"]
    assert terminated == sorted(impaired), states
    assert len(running) == durable.instances, states
    assert len(states) == durable.instances + len(impaired), states
    repairs = await repairs_of(durable.client, fleet.group)
    # A repair of another instance comes from a signal nobody meant to send: what the liveness tracker said tells a
    # false heartbeat loss from anything else.
    said = durable.worker.log_tail(20, containing="liveness of")
    assert sorted(repairs) == sorted(impaired), f"repairs: {repairs}\nthe liveness tracker said:\n{said}"
    semaphore = await fleet.semaphore()
    assert semaphore.holders == [] and semaphore.waiters == [], semaphore


# --- which worker did what --------------------------------------------------------------------------------------


def worker_identity(worker: EngineProcess) -> str:
    """The identity the worker process gives Temporal: the SDK's default, pid@host (one host here)."""
    assert worker.pid is not None, "the worker was never started"
    return f"{worker.pid}@{socket.gethostname()}"


async def pollers(client: Client, task_queue: str) -> dict[str, set[str]]:
    """The identities polling the task queue, for workflow tasks and for activity tasks (those the server saw lately:
    a dead poller stays listed a while)."""
    found: dict[str, set[str]] = {}
    kinds = {"workflow": TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, "activity": TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY}
    for kind, queue_type in kinds.items():
        described = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=client.namespace, task_queue=TaskQueue(name=task_queue), task_queue_type=queue_type
            ),
            timeout=QUERY_TIMEOUT,
        )
        found[kind] = {p.identity for p in described.pollers}
    return found


async def task_identities(client: Client, task_queue: str) -> Counter[str]:
    """Who ran the work on the task queue: per worker identity, the workflow tasks and activity tasks it started, as
    every workflow's history records them (an activity still in flight is in no history yet)."""
    ran: Counter[str] = Counter()
    query = f"TaskQueue = {sa.quoted(task_queue)}"
    async for execution in client.list_workflows(query, rpc_timeout=QUERY_TIMEOUT):
        history = await client.get_workflow_handle(execution.id, run_id=execution.run_id).fetch_history(
            rpc_timeout=QUERY_TIMEOUT
        )
        for event in history.events:
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                ran[event.workflow_task_started_event_attributes.identity] += 1
            elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                ran[event.activity_task_started_event_attributes.identity] += 1
    return ran


async def in_flight_by_worker(client: Client, task_queue: str) -> Counter[str]:
    """The activities started and not yet finished on the task queue, per identity of the worker running them."""
    running: Counter[str] = Counter()
    query = f"TaskQueue = {sa.quoted(task_queue)} AND ExecutionStatus = 'Running'"
    async for execution in client.list_workflows(query, rpc_timeout=QUERY_TIMEOUT):
        described = await client.get_workflow_handle(execution.id).describe(rpc_timeout=QUERY_TIMEOUT)
        for pending in described.raw_description.pending_activities:
            if pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED:
                running[pending.last_worker_identity] += 1
    return running
