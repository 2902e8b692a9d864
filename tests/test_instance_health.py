"""An instance's health decisions, read on the plain model: no server, a fake clock (InstanceHealth with a FakeHost).

Each row of the check table (workflows/health_checks.py) and each message the health workflow takes is a case here;
the workflow tests keep what only a server shows (signals on the wire, timers, activities, continue-as-new, replay).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from activities.models import EventType
from contract.aws_status import AwsInstanceStatus, Ec2StatusCheck, ScheduledEvent
from contract.groups import AutoRepair, CapacityGroup
from contract.health import CheckType, HealthState, HeartbeatLossInjection
from contract.instances import Exclusion
from contract.liveness import LivenessChange
from contract.probe import (
    FINDING_KINDS,
    KIND_CONTAINER_RUNTIME,
    KIND_DAEMON,
    KIND_DAEMON_RECOVERED,
    STATE_TRANSITION_KINDS,
    GpuFinding,
    GpuRef,
    Heartbeat,
)
from contract.repair import RepairPhase, RepairProgress
from workflows import health_aws_rules as aws_rules
from workflows import health_checks as checks
from workflows.instance_health import MAX_WARNING_KINDS, REPAIR_RETRIES, SHOWN_AS_CARRIED, InstanceHealth
from workflows.models import RepairStance, RepairView

START = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
INSTANCE, GROUP = "i-0abc", "g"


class FakeLog:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: object) -> None:
        self.lines.append(msg % args)

    def warning(self, msg: str, *args: object) -> None:
        self.lines.append(msg % args)


class FakeHost:
    def __init__(self) -> None:
        self.clock = START
        self.ids = 0
        self.patches: list[str] = []
        self.statuses: list[str] = []
        self.log = FakeLog()

    def now(self) -> datetime:
        return self.clock

    def new_id(self) -> str:
        self.ids += 1
        return f"id-{self.ids}"

    def patched(self, patch_id: str) -> bool:
        self.patches.append(patch_id)
        return True

    def status_changed(self, status: str) -> None:
        self.statuses.append(status)

    def tick(self, seconds: float) -> None:
        self.clock += timedelta(seconds=seconds)


@pytest.fixture
def host() -> FakeHost:
    return FakeHost()


@pytest.fixture
def health(host: FakeHost) -> InstanceHealth:
    return InstanceHealth(INSTANCE, GROUP, None, host)


def signal(health: InstanceHealth, handler: Any, message: object) -> None:
    """As the workflow's signal handler does: the message, then one HealthChanged if the status moved."""
    before = health.status_key()
    handler(message)
    health.void_withheld_when_healthy()
    health.publish_if_changed(before)


def beat(**fields: object) -> Heartbeat:
    return Heartbeat.model_validate({"instance_id": INSTANCE, "group": GROUP, "sent_at": START, **fields})


def finding(finding_id: str = "f1", **fields: object) -> GpuFinding:
    values: dict[str, object] = {
        "finding_id": finding_id,
        "instance_id": INSTANCE,
        "group": GROUP,
        "kind": "xid",
        "code": 79,
        "reason": "XID_79",
        "impairs": True,
        "gpu": GpuRef(pci="0000:53:00"),
        "observed_at": START,
    }
    return GpuFinding.model_validate({**values, **fields})


def status(health: InstanceHealth, check: CheckType) -> tuple[HealthState, str | None]:
    result = health.state.checks[check]
    return result.status, result.statusReason


def events(health: InstanceHealth, type: EventType) -> list[dict[str, Any]]:
    return [e.detail for e in health.outbox if e.type is type]


def healthy(health: InstanceHealth) -> InstanceHealth:
    signal(health, health.on_heartbeat, beat())
    health.outbox.clear()
    return health


# --- the table ------------------------------------------------------------------------------------------------------


def test_every_check_has_exactly_one_row() -> None:
    assert sorted(check.type for check in checks.CHECKS) == sorted(CheckType)
    assert checks.FROM_START == (CheckType.ACCELERATED_COMPUTE, CheckType.AGENT_CONNECTIVITY)
    assert set(checks.CLEARABLE) == set(CheckType)


def test_every_host_service_kind_the_probe_sends_has_its_row() -> None:
    in_table = {kind for check in checks.CHECKS for kind in check.finding_kinds | check.recovered_kinds}
    assert STATE_TRANSITION_KINDS <= in_table <= set(FINDING_KINDS)
    assert set(checks.SERVICE_DOWN) | set(checks.SERVICE_BACK) == STATE_TRANSITION_KINDS


@pytest.mark.parametrize(
    ("kind", "check"),
    [
        ("xid", CheckType.ACCELERATED_COMPUTE),
        ("sxid", CheckType.ACCELERATED_COMPUTE),
        ("gpu_fallen_off_bus", CheckType.ACCELERATED_COMPUTE),
        ("nvml", CheckType.ACCELERATED_COMPUTE),
        (KIND_DAEMON, CheckType.DAEMON),
        (KIND_CONTAINER_RUNTIME, CheckType.CONTAINER_RUNTIME),
    ],
)
def test_a_finding_impairs_the_check_its_kind_belongs_to(kind: str, check: CheckType) -> None:
    assert checks.check_of(finding(kind=kind)) is check


@pytest.mark.parametrize(
    ("check", "critical"),
    [
        (CheckType.ACCELERATED_COMPUTE, True),
        (CheckType.AGENT_CONNECTIVITY, True),
        (CheckType.EC2_STATUS, True),
        (CheckType.DAEMON, False),
        (CheckType.CONTAINER_RUNTIME, False),
    ],
)
def test_only_a_broken_instance_is_repaired_outside_maintenance_windows(
    health: InstanceHealth, check: CheckType, critical: bool
) -> None:
    assert not checks.critical(health.state)
    health.set_check(check, HealthState.IMPAIRED, "why", START)
    assert checks.critical(health.state) is critical


def test_the_repair_reason_names_the_most_specific_impaired_check(health: InstanceHealth) -> None:
    health.set_check(CheckType.AGENT_CONNECTIVITY, HealthState.IMPAIRED, "Agent disconnected since x", START)
    assert health.impairment() == ("Agent disconnected since x", None)
    health.set_check(CheckType.DAEMON, HealthState.IMPAIRED, "DAEMON_nvidia-persistenced", START)
    assert health.impairment()[0] == "DAEMON_nvidia-persistenced"
    signal(health, health.on_finding, finding())
    reason, found = health.impairment()
    assert reason == "XID_79" and found is not None and found.finding_id == "f1"


# --- messages -------------------------------------------------------------------------------------------------------


def test_an_instance_is_initializing_until_its_first_heartbeat(health: InstanceHealth, host: FakeHost) -> None:
    assert health.health_status().overallStatus is HealthState.INITIALIZING
    assert set(health.state.checks) == {CheckType.ACCELERATED_COMPUTE, CheckType.AGENT_CONNECTIVITY}
    signal(health, health.on_heartbeat, beat(boot_id="b1"))
    assert health.health_status().overallStatus is HealthState.OK
    assert host.statuses == [HealthState.OK] and health.state.boot_id == "b1"
    [changed] = events(health, EventType.HEALTH_CHANGED)
    assert changed["overall_status"] == "OK" and changed["finding"] is None
    assert not health.repair_due()


def test_a_critical_gpu_finding_impairs_and_stays_until_replaced(health: InstanceHealth, host: FakeHost) -> None:
    healthy(health)
    signal(health, health.on_finding, finding())
    assert status(health, CheckType.ACCELERATED_COMPUTE) == (HealthState.IMPAIRED, "XID_79")
    assert health.is_impaired() and health.repair_due()
    [changed] = events(health, EventType.HEALTH_CHANGED)
    assert changed["finding"]["finding_id"] == "f1"
    # The first fault is the root cause: a later one, or a heartbeat, only refreshes it.
    host.tick(5)
    signal(health, health.on_finding, finding("f2", reason="GPU_FALLEN_OFF_BUS", code=None))
    signal(health, health.on_heartbeat, beat())
    result = health.state.checks[CheckType.ACCELERATED_COMPUTE]
    assert (result.statusReason, result.lastStatusChange, result.lastUpdated) == (
        "XID_79",
        START,
        START + timedelta(seconds=5),
    )
    assert len(events(health, EventType.HEALTH_CHANGED)) == 1


def test_a_warning_is_counted_not_impairing_and_the_counts_are_bounded(health: InstanceHealth) -> None:
    healthy(health)
    signal(health, health.on_finding, finding(impairs=False, count=3))
    assert health.state.warning_counts == {"0000:53:00/XID_79": 3}
    assert not health.is_impaired() and health.outbox == []
    for n in range(MAX_WARNING_KINDS + 2):
        health.on_finding(finding(f"w{n}", impairs=False, reason=f"XID_{n}"))
    assert len(health.state.warning_counts) == MAX_WARNING_KINDS
    # XID_0 .. XID_257 are 258 reasons, XID_79 among them: the first 256 kept, the last two dropped.
    assert health.state.dropped_entries == 2 and "0000:53:00/XID_257" not in health.state.warning_counts


@pytest.mark.parametrize(
    ("message", "why"),
    [
        (finding(instance_id="i-other"), "finding for i-other sent to i-0abc"),
        (finding("f1"), "duplicate finding f1"),
    ],
    ids=["other-instance", "duplicate"],
)
def test_a_host_cannot_speak_for_another_nor_repeat_itself(
    health: InstanceHealth, host: FakeHost, message: GpuFinding, why: str
) -> None:
    health.on_finding(finding("f1", impairs=False))
    health.on_finding(message)
    assert health.state.rejected_signals == 1
    assert host.log.lines == [f"dropped signal for {INSTANCE}: {why}"]


def test_a_heartbeat_for_another_instance_is_rejected(health: InstanceHealth) -> None:
    health.on_heartbeat(beat(instance_id="i-other"))
    assert health.state.rejected_signals == 1 and health.state.last_heartbeat is None


def test_gpu_monitoring_down_is_insufficient_data_never_impaired(health: InstanceHealth) -> None:
    signal(health, health.on_heartbeat, beat(gpu_health="INSUFFICIENT_DATA", gpu_health_reason="nvml: no driver"))
    assert status(health, CheckType.ACCELERATED_COMPUTE) == (HealthState.INSUFFICIENT_DATA, "nvml: no driver")
    assert not health.is_impaired() and not health.repair_due()


def test_a_critical_daemon_down_impairs_daemon_until_the_last_is_back(health: InstanceHealth) -> None:
    healthy(health)
    down = {"kind": KIND_DAEMON, "code": None, "gpu": GpuRef()}
    signal(health, health.on_finding, finding("d1", reason="DAEMON_a", **down))
    signal(health, health.on_finding, finding("d2", reason="DAEMON_b", **down))
    assert status(health, CheckType.DAEMON) == (HealthState.IMPAIRED, "DAEMON_a")
    assert not checks.critical(health.state)  # waits for a maintenance window
    back = {"kind": KIND_DAEMON_RECOVERED, "code": None, "gpu": GpuRef(), "impairs": False}
    signal(health, health.on_finding, finding("d3", reason="DAEMON_a", **back))
    assert status(health, CheckType.DAEMON) == (HealthState.IMPAIRED, "DAEMON_b")
    signal(health, health.on_finding, finding("d4", reason="DAEMON_b", **back))
    assert status(health, CheckType.DAEMON) == (HealthState.OK, None)


def test_the_tracker_says_lost_and_heard_again(health: InstanceHealth) -> None:
    healthy(health)
    lost = LivenessChange(instance_id=INSTANCE, lost=True, last_heard=START)
    signal(health, health.on_liveness, lost)
    assert status(health, CheckType.AGENT_CONNECTIVITY) == (
        HealthState.IMPAIRED,
        "Agent disconnected since 2026-12-05T12:00:00Z",
    )
    assert health.repair_due()
    signal(health, health.on_liveness, LivenessChange(instance_id=INSTANCE, lost=False, last_heard=START))
    assert status(health, CheckType.AGENT_CONNECTIVITY) == (HealthState.OK, None)
    health.on_liveness(LivenessChange(instance_id="i-other", lost=True))
    assert health.state.rejected_signals == 1


def test_an_instance_terminated_by_someone_else_retires_without_a_repair(health: InstanceHealth) -> None:
    healthy(health)
    signal(health, health.on_liveness, LivenessChange(instance_id=INSTANCE, lost=True, gone="terminated by an ASG"))
    assert health.retired and health.state.retired_reason == "terminated by an ASG"
    assert events(health, EventType.INSTANCE_RETIRED) == [{"reason": "terminated by an ASG", "may_return": False}]
    assert health.view().retired


def test_an_instance_stopped_on_purpose_sleeps_and_wakes_when_heard(health: InstanceHealth) -> None:
    healthy(health)
    gone = LivenessChange(instance_id=INSTANCE, lost=True, gone="stopped", for_good=False)
    signal(health, health.on_liveness, gone)
    assert health.state.dormant and not health.retired and not health.repair_due()
    assert status(health, CheckType.AGENT_CONNECTIVITY) == (HealthState.INSUFFICIENT_DATA, "left on purpose: stopped")
    signal(health, health.on_heartbeat, beat())
    assert not health.state.dormant and health.state.retired_reason is None
    assert events(health, EventType.INSTANCE_RETURNED) == [{"left_because": "stopped"}]
    assert status(health, CheckType.AGENT_CONNECTIVITY) == (HealthState.OK, None)


def test_a_game_day_ignores_heartbeats_until_it_ends(health: InstanceHealth, host: FakeHost) -> None:
    healthy(health)
    health.on_heartbeat_loss_injection(HeartbeatLossInjection(duration=timedelta(minutes=5), requested_by="ops"))
    assert health.tell_tracker_now and health.state.game_day_to_tell is not None
    host.tick(60)
    health.on_heartbeat(beat())
    assert health.state.last_heartbeat == START
    assert "Game day: heartbeats ignored until" in health.details_markdown()
    host.tick(300)
    health.on_heartbeat(beat())
    assert health.state.last_heartbeat == host.clock


# --- a repair's progress ----------------------------------------------------------------------------------------


def repairing(health: InstanceHealth) -> InstanceHealth:
    health.state.repair = RepairView(
        workflow_id="repair/i-0abc/1", phase=RepairPhase.WAITING_FOR_PERMIT, reason="r", started_at=START
    )
    health.state.repair_token = "secret"
    health.take_for_repair()
    return health


def progress(phase: RepairPhase, finished: bool = False, token: str = "secret", **fields: object) -> RepairProgress:
    return RepairProgress.model_validate(
        {"workflow_id": "repair/i-0abc/1", "phase": phase, "finished": finished, "token": token, **fields}
    )


@pytest.mark.parametrize(
    "message",
    [
        progress(RepairPhase.DRAINING, token="guess"),
        progress(RepairPhase.DRAINING).model_copy(update={"workflow_id": "x"}),
    ],
    ids=["no-token", "not-ours"],
)
def test_progress_without_the_repairs_token_is_forged(health: InstanceHealth, message: RepairProgress) -> None:
    repairing(health).on_repair_progress(message)
    assert health.state.forged_signals == 1
    assert health.state.repair is not None and health.state.repair.phase is RepairPhase.WAITING_FOR_PERMIT


def test_a_replaced_instance_retires(health: InstanceHealth) -> None:
    signal(health, health.on_finding, finding())
    repairing(health).on_repair_progress(
        progress(RepairPhase.COMPLETED, finished=True, replacement_instance_id="i-new")
    )
    assert health.retired and health.view().repair is not None
    assert health.view().repair.replacement_instance_id == "i-new"  # type: ignore[union-attr]


def test_a_failed_repair_is_counted_once_and_its_retry_waits_for_its_time(
    health: InstanceHealth, host: FakeHost
) -> None:
    signal(health, health.on_finding, finding())
    repairing(health)
    failed = progress(RepairPhase.FAILED, finished=True, error="no capacity")
    health.on_repair_progress(failed)
    health.on_repair_progress(failed)  # told twice: counted once
    assert health.state.repair_retry.to_count == "repair/i-0abc/1" and host.patches == [REPAIR_RETRIES]
    # The run loop counted it (health_repairs.count_failure): a retry at next_at.
    retry = health.state.repair_retry
    retry.to_count, retry.last_counted, retry.failed = None, "repair/i-0abc/1", 1
    retry.next_at = START + timedelta(minutes=2)
    health.release_claim()
    assert not health.repair_due() and health.wake_in(host.now()) == timedelta(minutes=2)
    host.tick(120)
    assert health.repair_due()
    health.on_repair_progress(failed)
    assert health.state.repair_retry.to_count is None  # already counted


def test_a_discarded_repair_goes_back_to_proving_its_fault(health: InstanceHealth) -> None:
    signal(health, health.on_finding, finding())
    repairing(health).on_repair_progress(progress(RepairPhase.DISCARDED, finished=True, error="discarded by ops"))
    assert status(health, CheckType.ACCELERATED_COMPUTE) == (HealthState.OK, None)
    [cleared] = health.state.cleared_findings
    assert (cleared.finding_id, cleared.cleared_by, cleared.reason) == ("f1", "the breaker", "discarded by ops")
    assert health.state.repair_claim is None and not health.retired


def test_a_backoff_after_a_failed_activity_holds_the_repair(health: InstanceHealth, host: FakeHost) -> None:
    signal(health, health.on_finding, finding())
    health.state.retry_at = START + timedelta(seconds=30)
    assert not health.repair_due() and health.wake_in(host.now()) == timedelta(seconds=30)
    host.tick(30)
    assert health.repair_due()


def test_an_operator_repair_is_due_on_a_healthy_instance_and_names_who_asked(health: InstanceHealth) -> None:
    healthy(health)
    health.state.operator_repair = "operator ana: flaky NVLink"
    assert health.repair_due() and health.repair_reason() == ("operator ana: flaky NVLink", None)


def test_a_withheld_repair_is_void_once_healthy_again(health: InstanceHealth) -> None:
    signal(health, health.on_finding, finding(kind=KIND_DAEMON, reason="DAEMON_a", code=None))
    health.take_for_repair()
    assert not health.withhold_unless_allowed(AutoRepair.DISABLED) and health.withheld_for_group
    back = finding("f2", kind=KIND_DAEMON_RECOVERED, reason="DAEMON_a", code=None, impairs=False)
    signal(health, health.on_finding, back)
    assert health.state.repair_claim is None and health.withheld_why is None


# --- what it shows --------------------------------------------------------------------------------------------------


def test_the_view_is_the_carried_state(health: InstanceHealth) -> None:
    signal(health, health.on_heartbeat, beat(boot_id="b7"))
    health.on_finding(finding(impairs=False))
    health.tracker_id = "liveness/g"
    view = health.view()
    assert view.instance_id == INSTANCE and view.group == GROUP and view.liveness_workflow_id == "liveness/g"
    assert view.boot_id == "b7" and view.last_heartbeat == START and view.warning_counts == {"0000:53:00/XID_79": 1}
    assert view.healthStatus == health.health_status() and not view.retired
    # What the view shares with the carried state by name, it shows as carried; never the repair's secret token.
    shown = set(SHOWN_AS_CARRIED)
    assert view.model_dump(include=shown) == health.state.model_dump(include=shown)
    assert "repair_claim" in SHOWN_AS_CARRIED and "repair_token" not in SHOWN_AS_CARRIED


# --- what AWS says ----------------------------------------------------------------------------------------------


def aws(observed: datetime, **fields: object) -> AwsInstanceStatus:
    return AwsInstanceStatus.model_validate(
        {"instance_id": INSTANCE, "group": GROUP, "observed_at": observed, **fields}
    )


def test_an_ec2_status_check_impairs_only_after_its_grace(health: InstanceHealth) -> None:
    group = CapacityGroup(name=GROUP, cluster="c")
    state = healthy(health).state
    bad = Ec2StatusCheck(status="impaired", failed=["reachability"])
    aws_rules.apply(state.aws, aws(START, system=bad))
    assert aws_rules.due(state, START)
    decision = aws_rules.decide(state, group, START + timedelta(minutes=1))
    assert decision.ec2 is None and decision.next_at == START + group.status_check_grace
    decision = aws_rules.decide(state, group, START + group.status_check_grace)
    assert decision.ec2 is HealthState.IMPAIRED and decision.impairs_anew(state)
    aws_rules.apply_decision(state, decision, START + group.status_check_grace)
    assert status(health, CheckType.EC2_STATUS) == (
        HealthState.IMPAIRED,
        "EC2 system status check impaired since 2026-12-05T12:00:00Z (reachability failed)",
    )
    assert not aws_rules.planned_only(state) and checks.critical(state)


def test_a_scheduled_event_impairs_its_lead_before_and_is_told_once(health: InstanceHealth) -> None:
    group = CapacityGroup(name=GROUP, cluster="c")
    state = healthy(health).state
    event = ScheduledEvent(code="instance-retirement", event_id="e1", not_before=START + timedelta(hours=30))
    aws_rules.apply(state.aws, aws(START, events=[event]))
    assert len(aws_rules.events_to_tell(state, group)) == 1 and aws_rules.events_to_tell(state, group) == []
    assert aws_rules.decide(state, group, START).next_at == START + timedelta(hours=6)
    at = START + timedelta(hours=6)
    aws_rules.apply_decision(state, aws_rules.decide(state, group, at), at)
    assert status(health, CheckType.EC2_STATUS)[0] is HealthState.IMPAIRED
    assert aws_rules.planned_only(state)  # AWS planned it: not the breaker's to count


# --- why it is, or is not, repaired -----------------------------------------------------------------------------------


def decision(health: InstanceHealth) -> tuple[RepairStance, str]:
    made = health.repair_decision()
    return made.stance, made.why


def test_one_answer_says_why_an_instance_is_or_is_not_repaired(health: InstanceHealth, host: FakeHost) -> None:
    healthy(health)
    assert decision(health) == (RepairStance.NOT_NEEDED, "")
    signal(health, health.on_finding, finding())
    assert decision(health) == (RepairStance.DUE, "XID_79")
    health.state.retry_at = START + timedelta(seconds=30)
    health.state.last_activity_error = "starting the repair failed, trying again in 0:00:30: throttled"
    made = health.repair_decision()
    assert (made.stance, made.until) == (RepairStance.BACKING_OFF, START + timedelta(seconds=30))
    host.tick(30)
    health.take_for_repair()
    assert decision(health) == (RepairStance.STARTING, "XID_79")
    repairing(health)
    assert decision(health) == (RepairStance.REPAIRING, "repair/i-0abc/1 is WaitingForPermit")
    assert health.view().repair_decision == health.repair_decision()


def withheld(health: InstanceHealth) -> None:
    health.take_for_repair()
    health.withhold_unless_allowed(AutoRepair.DISABLED)


def excluded(health: InstanceHealth) -> None:
    health.state.excluded = Exclusion(by="ana", reason="RMA", since=START)


def exhausted(health: InstanceHealth) -> None:
    health.state.repair_retry.exhausted = True


def retry_waiting(health: InstanceHealth) -> None:
    health.state.repair_retry.next_at = START + timedelta(minutes=5)


def dormant(health: InstanceHealth) -> None:
    health.state.dormant, health.state.retired_reason = True, "stopped"


@pytest.mark.parametrize(
    ("setup", "stance"),
    [
        (withheld, RepairStance.WITHHELD),
        (excluded, RepairStance.EXCLUDED),
        (exhausted, RepairStance.EXHAUSTED),
        (retry_waiting, RepairStance.RETRY_WAITING),
        (dormant, RepairStance.DORMANT),
    ],
    ids=["withheld", "excluded", "exhausted", "retry-waiting", "dormant"],
)
def test_an_impaired_instance_not_being_repaired_says_why(
    health: InstanceHealth, setup: Callable[[InstanceHealth], None], stance: RepairStance
) -> None:
    signal(health, health.on_finding, finding())
    setup(health)
    assert health.repair_decision().stance is stance


def test_a_retired_instance_says_so(health: InstanceHealth) -> None:
    health.on_liveness(LivenessChange(instance_id=INSTANCE, lost=True, gone="terminated"))
    assert decision(health) == (RepairStance.RETIRED, "terminated")


# --- a GPU missing from the host ----------------------------------------------------------------------------------


def test_fewer_gpus_than_the_type_has_impairs_and_is_replaced(health: InstanceHealth) -> None:
    signal(health, health.on_heartbeat, beat(gpu_count=7))
    assert health.gpus_to_read and not health.is_impaired()
    before = health.status_key()
    health.expected_gpus_read("p5.48xlarge", 8)
    health.publish_if_changed(before)
    assert not health.gpus_to_read
    reason = "GPU_COUNT_MISMATCH: 7 of the 8 GPUs of a p5.48xlarge visible"
    assert status(health, CheckType.ACCELERATED_COMPUTE) == (HealthState.IMPAIRED, reason)
    assert health.repair_due() and health.impairment() == (reason, None)  # no finding: the ladder replaces
    assert events(health, EventType.HEALTH_CHANGED)[-1]["overall_status"] == "IMPAIRED"
    assert (health.view().gpu_count, health.view().expected_gpus) == (7, 8)


@pytest.mark.parametrize(
    ("seen", "expected"),
    [(8, 8), (None, 8), (7, None)],
    ids=["all-there", "probe-cannot-count", "type-without-gpu-info"],
)
def test_not_knowing_is_never_a_missing_gpu(health: InstanceHealth, seen: int | None, expected: int | None) -> None:
    signal(health, health.on_heartbeat, beat(gpu_count=seen))
    health.expected_gpus_read("p5.48xlarge", expected)
    assert not health.is_impaired()


def test_a_heartbeat_that_cannot_count_keeps_the_last_count_and_a_later_loss_impairs(health: InstanceHealth) -> None:
    signal(health, health.on_heartbeat, beat(gpu_count=8))
    health.expected_gpus_read("p5.48xlarge", 8)
    signal(health, health.on_heartbeat, beat(gpu_health="INSUFFICIENT_DATA", gpu_health_reason="nvml: hung"))
    assert health.state.gpu_count == 8 and not health.is_impaired()
    signal(health, health.on_heartbeat, beat(gpu_count=7))
    assert status(health, CheckType.ACCELERATED_COMPUTE)[0] is HealthState.IMPAIRED


# --- a member whose probe never reports -----------------------------------------------------------------------------


def test_a_member_whose_probe_never_reports_is_unmonitored_until_its_first_heartbeat(
    health: InstanceHealth, host: FakeHost
) -> None:
    timeout = timedelta(minutes=10)
    assert health.first_report_due(timeout) == START + timeout
    host.tick(600)
    before = health.status_key()
    health.mark_unmonitored(timeout)
    health.publish_if_changed(before)
    reason = "UNMONITORED: no report from its probe within first_report_timeout 600s"
    assert status(health, CheckType.ACCELERATED_COMPUTE) == (HealthState.INSUFFICIENT_DATA, reason)
    assert status(health, CheckType.AGENT_CONNECTIVITY) == (HealthState.INSUFFICIENT_DATA, reason)
    assert events(health, EventType.INSTANCE_UNMONITORED) == [{"first_report_timeout": "600s"}]
    assert health.first_report_due(timeout) is None and not health.repair_due()
    # Counted apart from other INSUFFICIENT_DATA: its HealthStatus search attribute says UNMONITORED.
    assert host.statuses == ["UNMONITORED"] and "unmonitored-status" in host.patches
    signal(health, health.on_heartbeat, beat())
    assert health.health_status().overallStatus is HealthState.OK and not health.state.unmonitored
    assert host.statuses == ["UNMONITORED", "OK"]


def test_a_probe_that_reported_first_is_never_unmonitored(health: InstanceHealth) -> None:
    health.on_finding(finding(impairs=False))
    assert health.first_report_due(timedelta(minutes=10)) is None
