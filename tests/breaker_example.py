"""One example of tests/test_breaker_property.py: a schedule's steps applied to a new capacity group's semaphore
and its stub repairs, on the harness's server and workers, settling between steps."""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError

from contract import names
from contract.breaker import BreakerHold, HoldCause, HoldNotice, ImpairmentReport
from contract.groups import GroupConfigState, GroupConfigUpdate
from contract.ids import repair_workflow_id, semaphore_workflow_id
from contract.semaphore import SemaphoreInput
from tests.breaker_history import RESET_STICKY, Timeline, failed_tasks, open_work
from tests.breaker_oracle import ConfigChange, ExampleOracle, ExampleReport, Holder
from tests.breaker_schedules import (
    Crash,
    Finish,
    FleetHold,
    FleetResume,
    Impair,
    Pause,
    Request,
    Reset,
    Restart,
    Resume,
    Schedule,
    SetBreaker,
    SetBudget,
    SetCap,
    Skip,
    Step,
)
from tests.breaker_stubs import HOLDER_QUEUE_SUFFIX, HolderInput, HolderView, StubRepair
from workflows.models import PermitRelease, SemaphoreView

if TYPE_CHECKING:
    from tests.breaker_harness import BreakerHarness

SETTLE_WITHIN = 30.0  # seconds of real time; an example normally settles in milliseconds
POLL_FIRST, POLL_MOST = 0.003, 0.05


class Example(ExampleOracle):
    """One schedule against a new group's semaphore: applies the steps, waits for the semaphore to settle, and
    records what the properties (ExampleOracle) are checked against."""

    def __init__(self, harness: BreakerHarness, schedule: Schedule) -> None:
        self.h = harness
        super().__init__(schedule, f"bp-{uuid.uuid4().hex[:10]}")
        self.instances = [f"i-{self.group_name}-{index}" for index in range(schedule.size)]
        self.fleet_held = False
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
                self.report.counted_after.append(self.stub.counted)
            self.step_index = len(self.s.steps)
            await self.finish([holder for holder in self.holders if not holder.closed and not holder.finishing])
            await self.settle()
            await self.observe(None)
            await self.collect_views()
            await self.check_semaphore_alive()
            self.check_grants()
            self.check_events()
            self.report.fleet_reports = self.stub.fleet_reports
            self.report.fleet_report_activities = self.stub.fleet_report_activities
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

    async def observe(self, step: Step | None) -> None:
        """The semaphore's view once settled: what it holds, and what must be true of it at rest."""
        self.check_at_rest(await self.state(), step)

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

    async def clean_up(self) -> None:
        for holder in self.holders:
            if not holder.closed:
                with contextlib.suppress(Exception):
                    await holder.handle.terminate("example over")
        if self._handle is not None:
            with contextlib.suppress(Exception):
                await self._handle.terminate("example over")
