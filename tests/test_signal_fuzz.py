"""Signal fuzzing: nothing a signal says may wedge a workflow.

Each of the four workflow types (an instance's health workflow, a group's drain semaphore, an instance's repair and a
group's liveness tracker) gets 1,000 random signals against the real Temporal dev server, with `autorepair worker`:
mostly the real signal names (`contract/names.py`), some random names; no payload, several payloads, null, numbers,
strings, lists, nested dicts, dicts shaped like the real models with wrong types, missing or extra fields and
out-of-range values (durations such as "P9000Y" or "-PT1S", timestamps in year 1 or 9999 or malformed, huge counts,
unicode, empty strings; liveness batches timed in year 1 or in the last second of 9999, for a shard out of range, of
20,001 instances); mostly small, a few just under the server's 2 MB payload limit. They go out 20 at a time, in batches
of 40 per workflow that it handles before the next (the near-limit ones one by one): the test is about what signals say,
not about the server's buffer of signals that arrive while a workflow task runs. Afterwards, for every workflow:

1. no run of it (continue-as-new is followed run by run) has a WorkflowTaskFailed event, other than those the server
   itself fails because of when signals arrived (SERVER_RETRIED; counted in the summary);
2. it is still running: none of these signals is legitimate enough to close it (see `check_workflow`); the tracker
   may declare the instances it was told of lost, and telling their (non-existent) health workflows must not fail it;
3. it still answers its query within a few seconds.

The signals are drawn from a seeded `random.Random`; the seed is printed, and `AUTOREPAIR_FUZZ_SEED=<seed>` replays
the same signals (sent concurrently, so their order on the server can still differ). A failure lists, per
workflow, each failed workflow task's message with the signals that workflow task handled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
from pydantic import BaseModel
from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError

from contract import names
from contract.groups import AutoRepair
from contract.health import HealthState
from contract.ids import health_workflow_id, liveness_workflow_id, semaphore_workflow_id
from contract.probe import Heartbeat
from contract.repair import RepairInput, RepairPhase
from contract.semaphore import SemaphoreInput
from node_probe.delivery.reporter import Reporter
from tests.harness import eventually, make_settings, unique, worker_process
from tests.signal_fuzzer import SIGNALS_PER_WORKFLOW, Ids, Signal, SignalFuzzer
from workflows.models import (
    InstanceHealthView,
    LivenessRun,
    LivenessView,
    Permit,
    RepairStatus,
    SemaphoreRun,
    SemaphoreView,
)

IN_FLIGHT = 20
# Signals sent to one workflow before it must catch up: the server fails a running workflow task (FORCE_CLOSE) once
# over 100 signals or 2 MB arrived while it ran, which says nothing about the workflow.
BATCH = 40
QUERY_WITHIN = 5.0  # seconds
SETTLE_WITHIN = 60.0  # seconds, for the workflows to work through what they were sent
SEND_WITHIN = 120.0  # seconds, for all the signals to be sent
# The liveness tracker also acts on its own timer: once the signals are sent, the test waits one window and grace of
# its group (6 s and 2 s) and a little more, so that what it was told is also acted on before the checks.
TRACKER_TIMERS = 10.0  # seconds

CLOSED_EVENTS = {
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED: "completed",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED: "failed",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED: "terminated",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT: "timed out",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED: "cancelled",
}

# Workflow tasks the server fails by itself because of when signals arrived, never because of what they said or what
# the workflow did with them: it flushes signals buffered while a task ran (over 100 of them or 2 MB: FORCE_CLOSE),
# refuses a close or continue-as-new that raced a new signal (UNHANDLED_COMMAND), or drops a stale sticky task. The
# next workflow task handles the same signals; one that kept failing would still show in `settle` and the query.
SERVER_RETRIED = {
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_STICKY_TASK_QUEUE,
}


# --- the workflows under test ------------------------------------------------------------------------------------


@dataclass
class Target:
    label: str
    workflow_id: str
    first_run_id: str
    query: str
    view: type[BaseModel]
    # Beyond running and answering: what the view must show (None: fine).
    check_view: Callable[[Any], str | None] = lambda _: None
    # What the summary says of the view.
    describe: Callable[[Any], str] = lambda view: f"rejected_signals={getattr(view, 'rejected_signals', '?')}"
    send_errors: Counter[str] = field(default_factory=Counter)
    send_error_examples: dict[str, str] = field(default_factory=dict)


async def send_all(client: Client, target: Target, signals: list[Signal], gate: asyncio.Semaphore) -> None:
    handle = client.get_workflow_handle(target.workflow_id)  # no run id: the latest run, across continue-as-new

    async def send(signal: Signal) -> None:
        async with gate:
            try:
                await handle.signal(signal.name, args=signal.args, rpc_timeout=timedelta(seconds=30))
            except Exception as err:  # refused by the client or the server: counted, not a workflow failure
                status = err.status.name if isinstance(err, RPCError) else type(err).__name__
                key = f"{status}: {str(err).splitlines()[0][:160] if str(err) else ''}"
                target.send_errors[key] += 1
                target.send_error_examples.setdefault(key, signal.describe())

    small = [signal for signal in signals if not signal.large]
    pace = True
    for start in range(0, len(small), BATCH):
        await asyncio.gather(*(send(signal) for signal in small[start : start + BATCH]))
        if pace:
            # Once it is closed or its workflow task keeps failing there is nothing to wait for: send the rest.
            state = await settle(client, target.workflow_id, quiet_polls=1, every=0.1, within=15, stuck_attempt=2)
            pace = state == "settled"
    # The near-limit ones one at a time, each once the workflow is idle: the server buffers the signals that arrive
    # while a workflow task runs, at most 2 MB of them, and force-closes the running task when that overflows.
    for signal in signals:
        if signal.large:
            if pace:
                pace = await settle(client, target.workflow_id, stuck_attempt=2) == "settled"
            await send(signal)


async def settle(
    client: Client,
    workflow_id: str,
    *,
    quiet_polls: int = 3,
    every: float = 0.5,
    within: float = SETTLE_WITHIN,
    stuck_attempt: int = 3,
) -> str:
    """Wait until the latest run has no workflow task left to do (or one that keeps failing), or has closed."""
    handle = client.get_workflow_handle(workflow_id)
    deadline = time.monotonic() + within
    quiet = 0
    while time.monotonic() < deadline:
        description = await handle.describe()
        if description.status != WorkflowExecutionStatus.RUNNING:
            return f"closed ({description.status.name if description.status else '?'})"
        raw = description.raw_description
        if raw.HasField("pending_workflow_task"):
            if raw.pending_workflow_task.attempt >= stuck_attempt:
                return f"stuck: workflow task attempt {raw.pending_workflow_task.attempt}"
            quiet = 0
        else:
            quiet += 1
            if quiet >= quiet_polls:
                return "settled"
        await asyncio.sleep(every)
    return f"still busy after {within:.0f}s"


def _signal_text(event: HistoryEvent) -> str:
    attrs = event.workflow_execution_signaled_event_attributes
    payloads = []
    for payload in attrs.input.payloads:
        data = payload.data.decode("utf-8", "replace")
        payloads.append(data if len(data) <= 240 else f"{data[:240]}... ({len(data):,} bytes)")
    return f"{attrs.signal_name!r} [{', '.join(payloads)}]"


def _close_details(event: HistoryEvent) -> str:
    """What the run closed with: its result, failure or termination reason, cut short."""
    if event.HasField("workflow_execution_completed_event_attributes"):
        payloads = event.workflow_execution_completed_event_attributes.result.payloads
        text = " ".join(p.data.decode("utf-8", "replace") for p in payloads)
    elif event.HasField("workflow_execution_failed_event_attributes"):
        text = event.workflow_execution_failed_event_attributes.failure.message
    elif event.HasField("workflow_execution_terminated_event_attributes"):
        text = event.workflow_execution_terminated_event_attributes.reason
    else:
        text = ""
    return text if len(text) <= 600 else f"{text[:600]}..."


async def check_history(client: Client, target: Target) -> tuple[list[str], int, Counter[str]]:
    """Every run from the first, following continue-as-new: each WorkflowTaskFailed and each close other than
    continue-as-new, with the signals the workflow task before it handled."""
    problems: list[str] = []
    retried: Counter[str] = Counter()
    run_id: str | None = target.first_run_id
    runs = 0
    while run_id is not None and runs < 500:
        runs += 1
        history = await client.get_workflow_handle(target.workflow_id, run_id=run_id).fetch_history()
        pending: list[str] = []  # signals since the last completed workflow task
        recent: deque[str] = deque(maxlen=12)  # the last signals, whichever task handled them
        reported = 0
        for event in history.events:
            kind = event.event_type
            if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                pending.append(_signal_text(event))
                recent.append(pending[-1])
            elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                pending = []
            elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                attrs = event.workflow_task_failed_event_attributes
                cause = WorkflowTaskFailedCause.Name(attrs.cause).removeprefix("WORKFLOW_TASK_FAILED_CAUSE_")
                if attrs.cause in SERVER_RETRIED:
                    retried[cause] += 1
                    continue
                stack = attrs.failure.stack_trace.strip().splitlines()[-4:]
                reported += 1
                if reported <= 5:
                    problems.append(
                        f"WorkflowTaskFailed (run {run_id}, event {event.event_id}, {cause}): "
                        f"{attrs.failure.message}\n      at: {' | '.join(s.strip() for s in stack)}"
                        + "".join(f"\n      signal: {s}" for s in pending[-8:])
                    )
            elif kind in CLOSED_EVENTS:
                problems.append(
                    f"closed: {CLOSED_EVENTS[kind]} (run {run_id}, event {event.event_id}): {_close_details(event)}"
                    + "".join(f"\n      after signal: {s}" for s in recent)
                )
        if reported > 5:
            problems.append(f"... and {reported - 5} more WorkflowTaskFailed in run {run_id}")
        last = history.events[-1] if history.events else None
        if last is not None and last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
            run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
        else:
            run_id = None
    return problems, runs, retried


async def check_workflow(client: Client, target: Target, settled: str) -> tuple[list[str], str]:
    problems, runs, retried = await check_history(client, target)
    handle = client.get_workflow_handle(target.workflow_id)
    description = await handle.describe()
    # All four must still be running. None of the signals sent could legitimately close one: the health workflow's
    # group has auto repair DISABLED, so no repair of its instance exists and every repair_progress it got was
    # forged (a forged "Completed" must not retire it); the semaphore never closes; the repair waits behind a
    # permit that is never given up, and no permit_granted it got names both its group and itself; the liveness
    # tracker only ever continues as new.
    if description.status != WorkflowExecutionStatus.RUNNING:
        problems.append(f"not running: {description.status.name if description.status else '?'}")
    summary = f"{runs} runs, {settled}, {sum(target.send_errors.values())} signals refused at send"
    if retried:
        summary += f", workflow tasks failed by the server and retried: {dict(retried)}"
    try:
        async with asyncio.timeout(QUERY_WITHIN + 1):
            view = await handle.query(
                target.query, result_type=target.view, rpc_timeout=timedelta(seconds=QUERY_WITHIN)
            )
    except Exception as err:
        problems.append(f"query {target.query!r} not answered within {QUERY_WITHIN:.0f}s: {type(err).__name__}: {err}")
    else:
        if not isinstance(view, target.view):
            problems.append(f"query {target.query!r} answered {type(view).__name__}, not {target.view.__name__}")
        elif (wrong := target.check_view(view)) is not None:
            problems.append(wrong)
        else:
            summary += f", {target.describe(view)}"
    return problems, summary


def _tracker_of(group: str) -> Callable[[LivenessView], str | None]:
    def check(view: LivenessView) -> str | None:
        if view.group != group or view.window_s is None:
            return f"liveness tracker answers for group {view.group!r} (window {view.window_s}), not {group!r}"
        return None

    return check


def _describe_tracker(view: LivenessView) -> str:
    return (
        f"rejected_signals={view.rejected_signals}, instances={view.instances}, lost={len(view.lost)}, "
        f"declared_lost={view.declared_lost}, recovered={view.recovered}, forgotten={view.forgotten}, "
        f"dropped_instances={view.dropped_instances}, reporters={len(view.reporters)}, window_s={view.window_s}"
    )


def _no_forged_launch_outcomes(view: SemaphoreView) -> str | None:
    # No launch_outcome sent carries a permit holder's token: none may mark an AZ out of capacity.
    return f"forged launch outcomes recorded: {view.launch_failures}" if view.launch_failures else None


def _repair_still_waiting(view: RepairStatus) -> str | None:
    if view.phase is not RepairPhase.WAITING_FOR_PERMIT:
        return f"repair left {RepairPhase.WAITING_FOR_PERMIT.value} for {view.phase.value} without a real permit"
    return None


# --- the test --------------------------------------------------------------------------------------------------


async def test_random_signals_never_wedge_a_workflow(client: Client, aws_env: str, tmp_path: Path) -> None:
    """1,000 random signals to each workflow type: no workflow task fails, each keeps running and answering."""
    seed = int(os.environ.get("AUTOREPAIR_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
    print(f"\nsignal fuzz seed: {seed} (AUTOREPAIR_FUZZ_SEED={seed} replays these signals)")
    rng = random.Random(seed)

    health_group, semaphore_group, repair_group = unique("g-health"), unique("g-sem"), unique("g-repair")
    liveness_group = unique("g-live")
    ids = Ids(
        health_instance=unique("i-fuzz-health"),
        health_group=health_group,
        semaphore_group=semaphore_group,
        repair_instance=unique("i-fuzz-repair"),  # not in ECS: a repair that got past its permit would fail
        repair_group=repair_group,
        liveness_group=liveness_group,
    )
    base = make_settings(
        client,
        aws_env,
        tmp_path / "events.jsonl",
        group=health_group,
        cluster=health_group,
        # Monitor only: whatever the fuzz does to its health, the instance is never repaired, so there is no
        # real repair whose progress could legitimately retire the health workflow.
        auto_repair=AutoRepair.DISABLED,
    )
    health_settings = base.groups[0]
    settings = base.model_copy(
        update={
            "groups": [
                health_settings,
                health_settings.model_copy(
                    update={"name": semaphore_group, "cluster": semaphore_group, "auto_repair": AutoRepair.ENABLED}
                ),
                health_settings.model_copy(
                    update={"name": repair_group, "cluster": repair_group, "auto_repair": AutoRepair.ENABLED}
                ),
                # The tracker reads its group's threshold (6 s: a window of 6 s and 2 s of grace) when it starts.
                health_settings.model_copy(update={"name": liveness_group, "cluster": liveness_group}),
            ]
        }
    )
    # The semaphores count their group's instances in ECS before a grant; a missing cluster is a permanent error.
    ecs = boto3.client("ecs", endpoint_url=aws_env, region_name="us-east-1")
    for group in (semaphore_group, repair_group):
        ecs.create_cluster(clusterName=group)

    fuzzer = SignalFuzzer(rng, ids)
    health_signals = fuzzer.signals(
        [
            names.SIGNAL_GPU_FINDING,
            names.SIGNAL_HEARTBEAT,
            names.SIGNAL_REPAIR_PROGRESS,
            names.SIGNAL_INJECT_HEARTBEAT_LOSS,
            names.SIGNAL_LIVENESS,
        ]
    )
    semaphore_signals = fuzzer.signals([names.SIGNAL_REQUEST, names.SIGNAL_RELEASE])
    repair_signals = fuzzer.signals([names.SIGNAL_PERMIT_GRANTED])
    # Batches twice as often: they are what the tracker's state is made of.
    liveness_signals = fuzzer.signals(
        [
            names.SIGNAL_LIVENESS_REPORT,
            names.SIGNAL_LIVENESS_REPORT,
            names.SIGNAL_IGNORE_HEARTBEATS,
            names.SIGNAL_GROUP_CHANGED,
        ]
    )

    task_queue = settings.temporal.task_queue
    started: list[str] = []
    async with worker_process(settings, tmp_path / "worker.log"):
        try:
            # The health workflow, started as the probe starts it: signal-with-start with a first heartbeat.
            health_id = health_workflow_id(ids.health_instance)
            await Reporter(client).send_heartbeat(
                Heartbeat(instance_id=ids.health_instance, group=health_group, sent_at=datetime.now(UTC)), task_queue
            )
            started.append(health_id)
            health = client.get_workflow_handle(health_id)
            health_first_run = (await health.describe()).run_id
            await eventually(
                lambda: health.query(names.QUERY_HEALTH, result_type=InstanceHealthView),
                lambda v: v.healthStatus.overallStatus is HealthState.OK,
                within=30,
            )

            # The worker starts each configured group's semaphore at its first look at the group: this one may be
            # running already, and is as good.
            semaphore_id = semaphore_workflow_id(semaphore_group)
            semaphore: WorkflowHandle = await client.start_workflow(
                names.SEMAPHORE_WORKFLOW,
                SemaphoreInput(group=semaphore_group),
                id=semaphore_id,
                task_queue=task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            )
            started.append(semaphore_id)

            # The repair's group semaphore starts with its one permit held by itself (a holder that is always
            # running, so never reclaimed): the repair asks, waits, and is never granted. It replaces the one the
            # worker may have started.
            blocker_id = semaphore_workflow_id(repair_group)
            await client.start_workflow(
                names.SEMAPHORE_WORKFLOW,
                SemaphoreRun(
                    group=repair_group,
                    holders=[
                        Permit(holder_workflow_id=blocker_id, instance_id="fuzz-blocker", since=datetime.now(UTC))
                    ],
                ),
                id=blocker_id,
                task_queue=task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.TERMINATE_EXISTING,
            )
            started.append(blocker_id)
            repair: WorkflowHandle = await client.start_workflow(
                names.REPAIR_WORKFLOW,
                RepairInput(instance_id=ids.repair_instance, group=repair_group, reason="signal fuzz"),
                id=ids.repair_id,
                task_queue=task_queue,
            )
            started.append(ids.repair_id)
            blocker = client.get_workflow_handle(blocker_id)
            await eventually(
                lambda: blocker.query(names.QUERY_STATE, result_type=SemaphoreView),
                lambda v: [w.holder_workflow_id for w in v.waiters] == [ids.repair_id],
                within=30,
            )

            # The liveness tracker, started as the relay starts it but without a first batch: it reads its group.
            liveness_id = liveness_workflow_id(liveness_group)
            liveness: WorkflowHandle = await client.start_workflow(
                names.LIVENESS_WORKFLOW, LivenessRun(group=liveness_group), id=liveness_id, task_queue=task_queue
            )
            started.append(liveness_id)
            await eventually(
                lambda: liveness.query(names.QUERY_LIVENESS, result_type=LivenessView),
                lambda v: v.window_s is not None,
                within=30,
            )

            targets = [
                Target(
                    "health",
                    health_id,
                    health_first_run,
                    names.QUERY_HEALTH,
                    InstanceHealthView,
                ),
                Target(
                    "semaphore",
                    semaphore_id,
                    semaphore.first_execution_run_id or "",
                    names.QUERY_STATE,
                    SemaphoreView,
                    check_view=_no_forged_launch_outcomes,
                ),
                Target(
                    "repair",
                    ids.repair_id,
                    repair.first_execution_run_id or "",
                    names.QUERY_STATUS,
                    RepairStatus,
                    check_view=_repair_still_waiting,
                ),
                Target(
                    "liveness",
                    liveness_id,
                    liveness.first_execution_run_id or "",
                    names.QUERY_LIVENESS,
                    LivenessView,
                    check_view=_tracker_of(liveness_group),
                    describe=_describe_tracker,
                ),
            ]
            plan = {
                "health": health_signals,
                "semaphore": semaphore_signals,
                "repair": repair_signals,
                "liveness": liveness_signals,
            }
            began = time.monotonic()
            gate = asyncio.Semaphore(IN_FLIGHT)
            unsent = None
            try:
                async with asyncio.timeout(SEND_WITHIN):
                    await asyncio.gather(*(send_all(client, t, plan[t.label], gate) for t in targets))
            except TimeoutError:
                unsent = f"sending did not finish within {SEND_WITHIN:.0f}s (signal RPCs or the workflows too slow)"
            sent_in = time.monotonic() - began
            await asyncio.sleep(TRACKER_TIMERS)
            settled = await asyncio.gather(*(settle(client, t.workflow_id) for t in targets))
            print(
                f"sent {len(targets) * SIGNALS_PER_WORKFLOW} signals in {sent_in:.1f}s, "
                f"settled in {time.monotonic() - began:.1f}s"
            )

            report: list[str] = [unsent] if unsent else []
            failed = unsent is not None
            for target, state in zip(targets, settled, strict=True):
                problems, summary = await check_workflow(client, target, state)
                failed = failed or bool(problems)
                report.append(f"{target.label} ({target.workflow_id}): {summary}")
                report += [f"  - {p}" for p in problems]
                for key, n in target.send_errors.most_common(5):
                    report.append(f"  (refused at send x{n}: {key}; e.g. {target.send_error_examples[key]})")
            print("\n".join(report))
            assert not failed, f"seed {seed}:\n" + "\n".join(report)
        finally:
            for workflow_id in started:
                with contextlib.suppress(RPCError):
                    await client.get_workflow_handle(workflow_id).terminate("signal fuzz over")
