"""Issue 14's rule for heartbeat loss and DCGM: a grace runs from when the check went bad, and new or alternating
reasons while it stays bad never restart its timer (Karpenter #2833 never repaired a node whose several DCGM failures
kept resetting the condition's transition time). EC2 status checks and the ECS agent: tests/test_aws_signals.py.

Heartbeat loss. Its timer is the liveness tracker's deadline: the last receipt it knows of, plus the window
(max(threshold, report_every)) and the grace (contract/liveness.py, workflows/liveness.py). What counts as being
heard is the design's (docs/operations.md, section 11): every report that passes the ingest is a receipt at the
ingest's receipt time, and a heartbeat's `sent_at` is never read. So a heartbeat replayed through the ingest with an
old `sent_at` does count, at its receipt, and postpones that instance's loss (pinned below, as the design says); so
would a warning finding the ingest relays. What must never postpone a loss is anything that is not a newer receipt:
a batch carrying an older one (another replica's, or a batch that waited out an outage), the same one again, other
instances' receipts, and whatever reaches the health workflow itself (warnings with alternating reasons, heartbeats
with old `sent_at`, AWS's alternating pictures of the ECS agent and the status checks). Once lost, none of these
re-judges the loss: one IMPAIRED, one repair.

DCGM. There is no grace: a "fail" impairs at once and ACCELERATED_COMPUTE stays IMPAIRED until the instance is
replaced; a "warn" is counted, never impairs. The probe holds no timer either: a failing dcgmi or nv-hostengine makes
the source INSUFFICIENT_DATA at the poll that fails and OK at the next that works. With no timer to restart, the
rule's DCGM form is: failures whose system alternates (PCIe, NVLink, Memory, PCIe again), with dcgmi failing in
between for changing reasons, are one impairment dated at the first failure, with the first reason, one breaker
report and one repair; and a failure that lasts through dcgmi's failures is one episode, never a new finding.

On the real Temporal dev server and moto. The repairs are real: the instances are in no ECS cluster, so a repair
begins and then fails at its drain step (all these tests need of it is that it began, once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError

from activities.aws import AwsClients
from contract import names
from contract.aws_status import AwsInstanceStatus, Ec2StatusCheck
from contract.formats import iso
from contract.groups import AutoRepair
from contract.health import CheckType, HealthState
from contract.ids import health_workflow_id, liveness_workflow_id, semaphore_workflow_id
from contract.instances import FindingsClear
from contract.liveness import LivenessInput, LivenessReport, loss_grace
from contract.probe import Heartbeat
from node_probe.delivery.liveness_relay import LivenessRelay, LivenessRoute
from node_probe.delivery.reporter import Reporter
from node_probe.host import CommandResult
from node_probe.probe import Probe, ProbeConfig
from node_probe.sources.dcgm import DcgmHealthSource
from simulator.aws_proxy import FlakyAws
from simulator.events import group_events
from tests.aws_says import AwsSays
from tests.harness import eventually, make_settings, running_worker, unique
from tests.test_aws_signals import aws_settings, history_counts, register
from tests.test_dcgm_source import CHECK, HEALTHY, FakeRunner, report
from tests.test_health_signals import finding, health_of, start_health
from tests.test_probe import running
from worker.aws_watch import aws_watch
from worker.settings import Settings
from workflows.models import HealthCheckResult, InstanceHealthView, LivenessView

THRESHOLD = timedelta(seconds=3)
# The tracker's window is the threshold (its reporters here promise batches more often), its grace 2 s.
DEADLINE = THRESHOLD.total_seconds() + loss_grace(THRESHOLD).total_seconds()
# From the tracker's decision to the health workflow's IMPAIRED: its EC2 look-up (retried against moto), the signal.
LATE = 30.0
# The tracker decides on a timer set for the deadline. The last inputs come half a second before it: had one counted
# as a receipt, or restarted the timer, the decision would come a window and a grace after it, 4.5 s past the deadline.
PROMPT = 3.0
HOSTENGINE_DOWN = "Error: unable to establish a connection to the specified host: localhost\n"
Answer = str | CommandResult | BaseException
DCGMI_DOWN: list[tuple[Answer, str]] = [  # dcgmi failing for one reason after another; what the probe then says
    (CommandResult(255, HOSTENGINE_DOWN), "unable to establish a connection"),
    (TimeoutError(), "did not finish within"),
    (CommandResult(0, "GPU ID | Health\n"), "exited 0"),
    (PermissionError(13, "Permission denied"), "Permission denied"),
]
Transition = tuple[str, str | None, str]


@asynccontextmanager
async def repairing_group(client: Client, aws_env: str, tmp_path: Path, **update: Any) -> AsyncIterator[Settings]:
    """A worker for a new group: auto repair ENABLED (unless `update` says otherwise), a heartbeat loss after 3 s."""
    group = unique("g")
    settings = make_settings(
        client, aws_env, tmp_path / "events.jsonl", group=group, cluster=group, heartbeat_loss_threshold=THRESHOLD
    )
    settings.groups = [settings.groups[0].model_copy(update=update)]
    async with running_worker(settings, client):
        yield settings


def check_of(view: InstanceHealthView, kind: CheckType) -> HealthCheckResult:
    return next(d for d in view.healthStatus.details if d.type is kind)


def published(settings: Settings, tmp_path: Path, instance: str, type: str) -> list[dict[str, Any]]:
    events = group_events(tmp_path / "events.jsonl", settings.groups[0].name, type, instance)
    return sorted(events, key=lambda e: e["time"])


def transitions(settings: Settings, tmp_path: Path, instance: str, check: CheckType) -> list[Transition]:
    """The check's own changes as the published HealthChanged events carry them: (status, reason, since when)."""
    seen: list[Transition] = []
    for event in published(settings, tmp_path, instance, "HealthChanged"):
        for detail in event["detail"]["details"]:
            change = (detail["status"], detail.get("statusReason"), detail["lastStatusChange"])
            if detail["type"] == check.value and (not seen or seen[-1] != change):
                seen.append(change)
    return seen


def times_impaired(settings: Settings, tmp_path: Path, instance: str) -> int:
    """How many times the instance's overall status went to IMPAIRED from something else."""
    statuses = ["OK"] + [
        e["detail"]["overall_status"] for e in published(settings, tmp_path, instance, "HealthChanged")
    ]
    return sum(1 for before, now in pairwise(statuses) if now == "IMPAIRED" != before)


async def scheduled(client: Client, instance: str, activity: str) -> int:
    """How many times the instance's health workflow scheduled this activity."""
    history = await client.get_workflow_handle(health_workflow_id(instance)).fetch_history()
    return sum(
        e.activity_task_scheduled_event_attributes.activity_type.name == activity
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    )


async def assert_one_impairment_one_repair(client: Client, settings: Settings, tmp_path: Path, instance: str) -> None:
    assert times_impaired(settings, tmp_path, instance) == 1
    assert len(published(settings, tmp_path, instance, "RepairStarted")) == 1
    assert await scheduled(client, instance, "start_repair") == 1
    assert (await history_counts(client, instance))[1] == 1  # one impairment told to the breaker


async def end_workflows(client: Client, settings: Settings, *views: InstanceHealthView) -> None:
    group = settings.groups[0].name
    ids = [liveness_workflow_id(group), semaphore_workflow_id(group)]
    for view in views:
        ids += [health_workflow_id(view.instance_id)] + ([view.repair.workflow_id] if view.repair else [])
    for workflow_id in ids:
        with contextlib.suppress(RPCError):  # a repair may have failed already
            await client.get_workflow_handle(workflow_id).terminate("test over")


# --- heartbeat loss -------------------------------------------------------------------------------------------------


def batch(group: str, reporter: str, at: int, heard: dict[str, int], every: float = 1) -> LivenessReport:
    """A reporter's batch made at `at` (epoch seconds), its next due `every` seconds later: instance -> its receipt, in
    seconds before `at`. Not a relay: these are about receipts, not about a silent pipeline."""
    return LivenessReport(
        group=group,
        reporter=reporter,
        at=datetime.fromtimestamp(at, tz=UTC),
        report_every=timedelta(seconds=every),
        relay=False,
        heard=heard,
    )


async def tell_tracker(client: Client, settings: Settings, report: LivenessReport) -> None:
    await client.start_workflow(
        names.LIVENESS_WORKFLOW,
        LivenessInput(group=report.group),
        id=liveness_workflow_id(report.group),
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        start_signal=names.SIGNAL_LIVENESS_REPORT,
        start_signal_args=[report],
    )


def aws_picture(instance: str, group: str, *, agent: bool, system: str = "ok") -> AwsInstanceStatus:
    now = datetime.now(UTC)
    return AwsInstanceStatus(
        instance_id=instance,
        group=group,
        observed_at=now,
        system=Ec2StatusCheck(status=system),
        agent_connected=agent,
        agent_disconnected_since=None if agent else now,
    )


async def noise(handle: WorkflowHandle[Any, Any], instance: str, group: str, round: int, t0: int) -> None:
    """What reaches a silent instance's health workflow without being a receipt: AWS's picture flapping (the ECS
    agent disconnected and back, the system status check insufficient-data and ok), heartbeats signalled to it
    directly with an old sent_at (the second older than the first), and warnings whose reasons alternate (last:
    once they are counted, all of it was taken)."""
    for agent, system in ((False, "ok"), (True, "insufficient-data"), (False, "ok"), (True, "ok")):
        await handle.signal(names.SIGNAL_AWS_STATUS, aws_picture(instance, group, agent=agent, system=system))
    for ago in (60, 120):
        old = Heartbeat(instance_id=instance, group=group, sent_at=datetime.fromtimestamp(t0 - ago, tz=UTC))
        await handle.signal(names.SIGNAL_HEARTBEAT, old)
    dcgm = ("DCGM_PCIE_WARN", "DCGM_NVLINK_WARN")[round % 2]
    warnings = [
        finding(instance, group, f"w-{round}-31", code=31, impairs=False),
        finding(instance, group, f"w-{round}-43", code=43, impairs=False),
        finding(instance, group, f"w-{round}-dcgm", impairs=False).model_copy(
            update={"kind": "dcgm", "code": None, "reason": dcgm}
        ),
    ]
    for warning in warnings:
        await handle.signal(names.SIGNAL_GPU_FINDING, warning)


async def declared_at(client: Client, group: str, instance: str) -> float:
    """When the tracker decided the instance was lost: it asked EC2 whether it had left on purpose."""
    history = await client.get_workflow_handle(liveness_workflow_id(group)).fetch_history()
    for event in history.events:
        if not event.HasField("activity_task_scheduled_event_attributes"):
            continue
        scheduled = event.activity_task_scheduled_event_attributes
        asked = json.loads(scheduled.input.payloads[0].data)
        if scheduled.activity_type.name == "instances_gone" and instance in asked["instance_ids"]:
            return event.event_time.ToDatetime(tzinfo=UTC).timestamp()
    raise AssertionError(f"the tracker never declared {instance} lost")


def disconnected_since(check: HealthCheckResult) -> float:
    reason = check.statusReason or ""
    assert reason.startswith("Agent disconnected since "), reason
    return datetime.fromisoformat(reason.removeprefix("Agent disconnected since ")).timestamp()


def saying(why: str) -> Callable[[HealthCheckResult], bool]:
    return lambda check: why in (check.statusReason or "")


async def test_a_silent_instance_is_lost_a_window_after_its_last_receipt_whatever_arrives_meanwhile(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    """`silent` is last heard at t0. Until a second before its deadline, and after it: batches carrying older
    receipts of it (another replica's; one made before t0 that arrives late) and the same one again, and at its
    health workflow warnings, old heartbeats and AWS flapping. It is lost at t0's deadline as disconnected since
    t0, once, and repaired once. `replayed`, heard at t0 too, then sends one heartbeat with a sent_at a minute old
    through its probe's own relay: by design a receipt at its arrival, so it is lost a window after that arrival."""
    silent, replayed = unique("i-silent"), unique("i-replayed")
    async with repairing_group(client, aws_env, tmp_path) as settings:
        group, task_queue = settings.groups[0].name, settings.temporal.task_queue
        handles = {i: await start_health(client, settings, i) for i in (silent, replayed)}
        for handle in handles.values():
            await eventually(partial(health_of, handle), lambda v: v.healthStatus.overallStatus is HealthState.OK)

        t0 = int(time.time())
        await tell_tracker(client, settings, batch(group, "ingest-a", t0, {silent: 0, replayed: 0}))
        tracker = client.get_workflow_handle(liveness_workflow_id(group))
        await eventually(
            lambda: tracker.query(names.QUERY_LIVENESS, result_type=LivenessView),
            lambda v: v.window_s == THRESHOLD.total_seconds() and v.instances == 2,
            within=30,
            every=0.1,
        )

        # Before the deadline: nothing here is a newer receipt of `silent`.
        now = math.ceil(time.time())
        await tell_tracker(client, settings, batch(group, "ingest-b", now, {silent: now - (t0 - 3)}))  # older
        await tell_tracker(client, settings, batch(group, "ingest-late", t0 - 2, {silent: 0}))  # waited, older
        await tell_tracker(client, settings, batch(group, "ingest-a", t0, {silent: 0}))  # the same one again
        await noise(handles[silent], silent, group, 0, t0)
        # `replayed` through its probe's own relay (a trusted-lab probe): counted at its receipt, sent_at unread.
        route = LivenessRoute.for_probe(settings.groups[0].heartbeat_interval)
        relay = LivenessRelay(Reporter(client), lambda _: route, task_queue, relay=False)
        replayed_at = time.time()
        stale = Heartbeat(instance_id=replayed, group=group, sent_at=datetime.fromtimestamp(t0 - 60, tz=UTC))
        await relay.send_heartbeat(stale, task_queue)
        await asyncio.sleep(max(t0 + DEADLINE - 0.5 - time.time(), 0))
        now = math.ceil(time.time())
        await tell_tracker(client, settings, batch(group, "ingest-b", now, {silent: now - t0}))
        await noise(handles[silent], silent, group, 1, t0)
        assert time.time() < t0 + DEADLINE  # all of it came before the deadline

        view = await eventually(
            lambda: health_of(handles[silent]),
            lambda v: check_of(v, CheckType.AGENT_CONNECTIVITY).status is HealthState.IMPAIRED and v.repair is not None,
            within=t0 + DEADLINE + LATE - time.time(),
            every=0.1,
        )
        lost = check_of(view, CheckType.AGENT_CONNECTIVITY)
        reason = f"Agent disconnected since {iso(datetime.fromtimestamp(t0, tz=UTC))}"
        assert lost.statusReason == reason
        assert t0 + DEADLINE <= await declared_at(client, group, silent) < t0 + DEADLINE + PROMPT
        assert t0 + DEADLINE <= lost.lastStatusChange.timestamp() <= t0 + DEADLINE + LATE
        heard = await tracker.query(names.QUERY_LAST_HEARD, [silent], result_type=dict[str, datetime])
        assert heard == {silent: datetime.fromtimestamp(t0, tz=UTC)}
        assert view.repair is not None and view.repair.reason == reason

        # `replayed`: lost a window after its stale heartbeat arrived, as last heard then (in whole seconds).
        other = await eventually(
            lambda: health_of(handles[replayed]),
            lambda v: check_of(v, CheckType.AGENT_CONNECTIVITY).status is HealthState.IMPAIRED,
            within=replayed_at + DEADLINE + LATE - time.time(),
            every=0.1,
        )
        since = disconnected_since(check_of(other, CheckType.AGENT_CONNECTIVITY))
        assert int(replayed_at) <= since <= replayed_at + 1
        assert check_of(other, CheckType.AGENT_CONNECTIVITY).lastStatusChange.timestamp() >= since + DEADLINE

        # After the loss: the same again, and a batch with an older receipt. Nothing is judged again.
        await noise(handles[silent], silent, group, 2, t0)
        await tell_tracker(client, settings, batch(group, "ingest-b", math.ceil(time.time()), {silent: 30}))
        after = await eventually(lambda: health_of(handles[silent]), lambda v: sum(v.warning_counts.values()) == 9)
        assert after.warning_counts == {
            "0000:9b:00/XID_31": 3,
            "0000:9b:00/XID_43": 3,
            "0000:9b:00/DCGM_PCIE_WARN": 2,
            "0000:9b:00/DCGM_NVLINK_WARN": 1,
        }
        assert check_of(after, CheckType.AGENT_CONNECTIVITY).model_dump(exclude={"lastUpdated"}) == lost.model_dump(
            exclude={"lastUpdated"}
        )
        assert check_of(after, CheckType.ACCELERATED_COMPUTE).status is HealthState.OK  # warnings never impair
        assert after.rejected_signals == 0
        liveness = await tracker.query(names.QUERY_LIVENESS, result_type=LivenessView)
        assert (sorted(liveness.lost), liveness.declared_lost) == (sorted([silent, replayed]), 2)
        assert (liveness.floor, liveness.silent_since, liveness.last_silence_from) == (None, None, None)
        agent = transitions(settings, tmp_path, silent, CheckType.AGENT_CONNECTIVITY)
        assert [(status, why) for status, why, _ in agent] == [("OK", None), ("IMPAIRED", reason)]
        assert datetime.fromisoformat(agent[-1][2]) == lost.lastStatusChange
        await assert_one_impairment_one_repair(client, settings, tmp_path, silent)
        await end_workflows(client, settings, after, await health_of(handles[replayed]))


async def test_the_probe_heard_again_neither_ends_nor_restarts_the_ecs_agents_grace(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    """The ECS agent disconnected past its grace: IMPAIRED since T0. The probe lost (its reason takes over), then
    heard while the agent still is: the agent's reason since T0 again, never OK, no new grace. A clear restarts it."""
    grace = timedelta(seconds=4)
    update = aws_settings(agent_disconnect_grace=grace, auto_repair=AutoRepair.DISABLED)
    with FlakyAws(aws_env) as proxy:
        async with (
            repairing_group(client, proxy.url, tmp_path, **update) as settings,
            AwsClients(settings.aws) as aws,
            aws_watch(settings, client, aws),
        ):
            [instance] = register(aws_env, group := settings.groups[0].name, 1)
            handle = await start_health(client, settings, instance)
            agent = partial(check_now, handle, CheckType.AGENT_CONNECTIVITY)
            AwsSays(proxy).agent(instance, connected=False)
            ecs = await eventually(agent, lambda c: "ECS agent" in str(c.statusReason), within=30, every=0.1)
            await tell_tracker(client, settings, batch(group, "ingest-a", math.ceil(time.time()), {instance: 0}))
            lost = await eventually(agent, lambda c: "Agent disconnected" in str(c.statusReason))
            # Heard again, from a reporter that promises its next batch in a minute: not lost again in this test.
            await tell_tracker(client, settings, batch(group, "ingest-a", math.ceil(time.time()), {instance: 0}, 60))
            await eventually(agent, lambda c: "Agent disconnected" not in str(c.statusReason), every=0.1)
            await asyncio.sleep(grace.total_seconds() + 2)  # a grace restarted by the probe's return would be over
            history = transitions(settings, tmp_path, instance, CheckType.AGENT_CONNECTIVITY)
            assert [why for _, why, _ in history] == [None, ecs.statusReason, lost.statusReason, ecs.statusReason]
            assert {datetime.fromisoformat(since) for _, _, since in history[1:]} == {ecs.lastStatusChange}
            cleared = time.time()
            await handle.execute_update(names.UPDATE_CLEAR_FINDINGS, FindingsClear(reason="false alarm"))
            again = await eventually(agent, lambda c: "ECS agent" in str(c.statusReason), within=LATE, every=0.1)
            assert again.lastStatusChange.timestamp() >= cleared + grace.total_seconds() and again != ecs
            await end_workflows(client, settings, await health_of(handle))


async def check_now(handle: WorkflowHandle[Any, Any], kind: CheckType) -> HealthCheckResult:
    return check_of(await health_of(handle), kind)


# --- DCGM ------------------------------------------------------------------------------------------------------------


class Dcgmi:
    """A dcgmi whose `health -c -j` answers what the test says now: a report, a failed command, an exception."""

    def __init__(self) -> None:
        self.answer: Answer = HEALTHY
        self.polls = 0

    async def __call__(self, argv: Sequence[str], timeout: float) -> CommandResult:
        self.polls += 1
        answer = self.answer
        if isinstance(answer, BaseException):
            raise answer
        return answer if isinstance(answer, CommandResult) else CommandResult(0, answer)

    async def says(self, answer: Answer) -> None:
        """From now on; returns once two polls have had it."""
        self.answer, polls = answer, self.polls
        await eventually(lambda: asyncio.sleep(0, self.polls), lambda n: n >= polls + 2, within=10, every=0.05)


def gpus(gpu0: tuple[str, str] | None = None, gpu1: tuple[str, str] | None = None) -> str:
    """A `dcgmi health -c -j` report: GPU 0 and GPU 1 each with one (system, result), or healthy."""
    entities: dict[str, dict[str, tuple[str, list[str]]]] = {}
    for gpu, incident in (("0", gpu0), ("1", gpu1)):
        if incident is not None:
            system, result = incident
            entities[gpu] = {system: (result, [f"{system}: {result} on GPU {gpu}"])}
    results = {result for _, result in filter(None, (gpu0, gpu1))}
    overall = "Failure" if "Failure" in results else "Warning" if results else "Healthy"
    return report(overall, {"GPU": entities}) if entities else HEALTHY


IDENTITIES = {0: ("0000:17:00", "GPU-0"), 1: ("0000:2a:00", "GPU-1")}


@asynccontextmanager
async def probe_with_dcgm(client: Client, settings: Settings, instance: str, tmp_path: Path) -> AsyncIterator[Dcgmi]:
    """The real probe on `instance`, DCGM its only source (dcgmi's answers scripted), reporting as a trusted-lab
    probe does: through its own relay, straight to Temporal."""
    dcgmi = Dcgmi()
    executable = tmp_path / f"dcgmi-{instance}"  # installed, as far as the source's check can tell; never run
    executable.write_text("#!/bin/sh\nexit 0\n")
    executable.chmod(0o755)
    source = DcgmHealthSource(str(executable), poll_interval=0.1, runner=dcgmi, gpu_lookup=IDENTITIES.get)
    task_queue = settings.temporal.task_queue
    route = LivenessRoute.for_probe(settings.groups[0].heartbeat_interval)
    config = ProbeConfig(
        instance_id=instance,
        group=settings.groups[0].name,
        heartbeat_interval=timedelta(seconds=0.5),
        dedupe_window=timedelta(seconds=0.5),  # a failure back after it cleared is a finding of its own
        retry_max_backoff=timedelta(seconds=0.5),
        task_queue=task_queue,
    )
    relay = LivenessRelay(Reporter(client), lambda _: route, task_queue, relay=False)
    async with running(Probe(config, relay, sources=[source])):
        yield dcgmi


def dcgm_source_state(view: InstanceHealthView) -> tuple[HealthState, str] | None:
    dcgm = next((s for s in view.probe_sources or [] if s.name == "dcgm"), None)
    return None if dcgm is None else (dcgm.state, dcgm.reason or "")


def dcgm_down_for(why: str, view: InstanceHealthView) -> bool:
    """The probe's last heartbeat said DCGM was down, for this reason."""
    state = dcgm_source_state(view)
    return state is not None and state[0] is HealthState.INSUFFICIENT_DATA and why in state[1]


async def test_dcgm_failures_of_alternating_systems_are_one_impairment_at_the_first_and_warnings_none(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    """GPU 0 of `failing` fails in PCIe, then NVLink, then Memory, then PCIe again (each clearing the last), with
    dcgmi failing in between for changing reasons (its heartbeats say so; the Memory failure lasts through one of
    them, and is one episode, reported once) and GPU 1 warning in changing systems;
    `warned` only warns, in changing systems. `failing` is IMPAIRED once, when PCIe first failed, for
    DCGM_PCIE_FAIL, and repaired once; `warned` never changes status."""
    failing, warned = unique("i-failing"), unique("i-warned")
    async with (
        repairing_group(client, aws_env, tmp_path) as settings,
        probe_with_dcgm(client, settings, failing, tmp_path) as bad,
        probe_with_dcgm(client, settings, warned, tmp_path) as warn,
    ):
        handles = {i: client.get_workflow_handle(health_workflow_id(i)) for i in (failing, warned)}
        for handle in handles.values():
            await eventually(
                partial(health_of, handle), lambda v: v.healthStatus.overallStatus is HealthState.OK, every=0.1
            )
        ok_since = check_of(await health_of(handles[warned]), CheckType.ACCELERATED_COMPUTE).lastStatusChange

        first_failed = time.time()
        # (failing's dcgmi, what its heartbeats then say of DCGM when dcgmi fails, warned's dcgmi)
        stages: list[tuple[Answer, str | None, Answer]] = [
            (
                gpus(("PCIe system", "Failure"), ("PCIe system", "Warning")),
                None,
                gpus(None, ("PCIe system", "Warning")),
            ),
            (CommandResult(255, HOSTENGINE_DOWN), "unable to establish", gpus(None, ("NVLINK system", "Warning"))),
            (
                gpus(("NVLINK system", "Failure"), ("NVLINK system", "Warning")),
                None,
                gpus(None, ("Memory system", "Warning")),
            ),
            (TimeoutError(), "did not finish within", gpus(None, ("Thermal system", "Warning"))),
            (
                gpus(("Memory system", "Failure"), ("Thermal system", "Warning")),
                None,
                gpus(None, ("PCIe system", "Warning")),
            ),
            (CommandResult(0, "GPU ID | Health\n"), "exited 0", HEALTHY),
            # The Memory failure (and the Thermal warning) lasted through dcgmi's failure: nothing new to say.
            (gpus(("Memory system", "Failure"), ("Thermal system", "Warning")), None, HEALTHY),
            (gpus(("PCIe system", "Failure"), ("PCIe system", "Warning")), None, HEALTHY),
            (HEALTHY, None, HEALTHY),
        ]
        impaired: HealthCheckResult | None = None
        for for_failing, down_reason, for_warned in stages:
            await asyncio.gather(bad.says(for_failing), warn.says(for_warned))
            if impaired is None:
                view = await eventually(
                    lambda: health_of(handles[failing]),
                    lambda v: v.healthStatus.overallStatus is HealthState.IMPAIRED,
                    within=10,
                    every=0.1,
                )
                impaired = check_of(view, CheckType.ACCELERATED_COMPUTE)
                assert first_failed <= impaired.lastStatusChange.timestamp() <= time.time()
            if down_reason is not None:
                await eventually(
                    lambda: health_of(handles[failing]), partial(dcgm_down_for, down_reason), within=10, every=0.1
                )
        assert impaired is not None

        view = await eventually(
            lambda: health_of(handles[failing]),
            lambda v: (
                len(v.recent_findings) >= 8 and v.repair is not None and dcgm_source_state(v) == (HealthState.OK, "")
            ),
            within=20,
        )
        # Every reason reached the workflow, once: four failures and four warnings.
        assert len(view.recent_findings) == 8
        assert [f.reason for f in view.recent_findings if f.impairs] == [
            "DCGM_PCIE_FAIL",
            "DCGM_NVLINK_FAIL",
            "DCGM_MEMORY_FAIL",
            "DCGM_PCIE_FAIL",
        ]
        assert view.warning_counts == {
            "0000:2a:00/DCGM_PCIE_WARN": 2,
            "0000:2a:00/DCGM_NVLINK_WARN": 1,
            "0000:2a:00/DCGM_THERMAL_WARN": 1,
        }
        # One impairment: the first failure's reason and time, never re-judged by the later ones nor by dcgmi's.
        accelerated = check_of(view, CheckType.ACCELERATED_COMPUTE)
        assert accelerated.model_dump(exclude={"lastUpdated"}) == impaired.model_dump(exclude={"lastUpdated"})
        assert impaired.statusReason == "DCGM_PCIE_FAIL"
        assert view.repair is not None and view.repair.reason == "DCGM_PCIE_FAIL"
        assert view.repair.workflow_id.endswith("/1")
        history = transitions(settings, tmp_path, failing, CheckType.ACCELERATED_COMPUTE)
        assert [(status, why) for status, why, _ in history][-2:] == [("OK", None), ("IMPAIRED", "DCGM_PCIE_FAIL")]
        assert datetime.fromisoformat(history[-1][2]) == impaired.lastStatusChange
        await assert_one_impairment_one_repair(client, settings, tmp_path, failing)

        # Warnings alone: counted, never a change of status, never a repair.
        quiet = await health_of(handles[warned])
        assert quiet.warning_counts == {
            f"0000:2a:00/DCGM_{system}_WARN": count
            for system, count in (("PCIE", 2), ("NVLINK", 1), ("MEMORY", 1), ("THERMAL", 1))
        }
        calm = check_of(quiet, CheckType.ACCELERATED_COMPUTE)
        assert (calm.status, calm.lastStatusChange) == (HealthState.OK, ok_since)
        assert (quiet.repair, quiet.repair_withheld) == (None, None)
        assert (
            datetime.fromisoformat(transitions(settings, tmp_path, warned, CheckType.ACCELERATED_COMPUTE)[-1][2])
            == ok_since
        )
        assert times_impaired(settings, tmp_path, warned) == 0
        assert published(settings, tmp_path, warned, "RepairStarted") == []
        await end_workflows(client, settings, view, quiet)


async def test_dcgmi_failing_for_alternating_reasons_keeps_when_the_status_last_changed(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    """ECS's lastStatusChange is when the status last changed: while dcgmi fails, for one reason after another (as
    the probe's heartbeats say), ACCELERATED_COMPUTE stays INSUFFICIENT_DATA since the first; lastUpdated moves."""
    instance = unique("i-unsure")
    async with (
        repairing_group(client, aws_env, tmp_path) as settings,
        probe_with_dcgm(client, settings, instance, tmp_path) as dcgmi,
    ):
        handle = client.get_workflow_handle(health_workflow_id(instance))
        accelerated = partial(check_now, handle, CheckType.ACCELERATED_COMPUTE)
        await eventually(accelerated, lambda c: c.status is HealthState.OK, every=0.1)
        seen: list[HealthCheckResult] = []
        for answer, why in [*DCGMI_DOWN, DCGMI_DOWN[0]]:  # the first reason again, at the end
            await dcgmi.says(answer)
            seen.append(await eventually(accelerated, saying(why), every=0.1))
        assert {(c.status, c.lastStatusChange) for c in seen} == {("INSUFFICIENT_DATA", seen[0].lastStatusChange)}
        assert all(a.lastUpdated < b.lastUpdated for a, b in pairwise(seen))
        await end_workflows(client, settings, await health_of(handle))


async def test_dcgmi_failing_for_changing_reasons_holds_no_timer_and_never_ends_a_failure() -> None:
    """The probe side: no hold-off before a failure is reported, none before dcgmi counts as down or as back, and a
    failure that lasts through dcgmi's failures (each for another reason) is one episode: never reported again, so
    never a new finding with a new id."""
    runner = FakeRunner({CHECK: HEALTHY})
    source = DcgmHealthSource(runner=runner, poll_interval=0.1)
    assert await source.poll() == [] and source.status.is_ok
    failing = gpus(("NVLINK system", "Failure"))
    for answer, why in DCGMI_DOWN:  # down for one reason after another, then working, with a failure: found at once
        runner.answers[CHECK] = answer
        assert await source.poll() == []
        assert source.status.state is HealthState.INSUFFICIENT_DATA and why in (source.status.reason or "")
    runner.answers[CHECK] = failing
    (found,) = await source.poll()
    assert source.status.is_ok and (found.record.reason, found.record.critical) == ("DCGM_NVLINK_FAIL", True)
    for answer, why in DCGMI_DOWN:  # the failure lasts; dcgmi fails in between, for changing reasons
        runner.answers[CHECK] = answer
        assert await source.poll() == []
        assert source.status.state is HealthState.INSUFFICIENT_DATA and why in (source.status.reason or "")
        runner.answers[CHECK] = failing
        assert await source.poll() == [] and source.status.is_ok  # the same episode: nothing new to say
    # Only once it cleared is it a new episode, whose finding has an id of its own.
    runner.answers[CHECK] = HEALTHY
    assert await source.poll() == []
    runner.answers[CHECK] = failing
    (again,) = await source.poll()
    assert again.record.reason == "DCGM_NVLINK_FAIL" and again.position != found.position
