"""The group's ECS daemon tasks on the plain model (workflows/health_daemon_rules.py through the AWS rules), with a
fake clock: missing past daemon_task_grace impairs DAEMON through the same down list as the probe's systemd units,
back clears it, and the AWS runbook's proofs (a clear, a fix in place) apply alike. End to end on the dev server and
moto: tests/test_daemon_tasks.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from contract.groups import CapacityGroup
from contract.health import CheckType, HealthState
from contract.instances import ClearedFinding
from contract.probe import KIND_DAEMON, GpuRef
from contract.repair import InPlaceFix, RepairAction, RepairPhase, RepairProgress
from tests.test_instance_health import (
    GROUP,
    INSTANCE,
    START,
    FakeHost,
    aws,
    finding,
    healthy,
    repairing,
    signal,
    status,
)
from worker.settings import Settings
from workflows import health_aws_rules as aws_rules
from workflows import health_checks as checks
from workflows.instance_health import InstanceHealth
from workflows.models import HealthCarry

GRACE = timedelta(minutes=5)
GROUP_SETTINGS = CapacityGroup(name=GROUP, cluster="c", daemon_services=["gpu-exporter", "log-shipper"])
EXPORTER = "ECS_DAEMON_gpu-exporter"


def new_health() -> InstanceHealth:
    return healthy(InstanceHealth(INSTANCE, GROUP, None, FakeHost()))


def told(state: HealthCarry, at_minutes: float, *missing: str) -> None:
    aws_rules.apply(state.aws, aws(START + timedelta(minutes=at_minutes), daemon_tasks_missing=list(missing)))


def advance(state: HealthCarry, at_minutes: float) -> aws_rules.Decision:
    """As the workflow's run loop step does (the confirming read aside), patched."""
    now = START + timedelta(minutes=at_minutes)
    aws_rules.settle(state, now)
    decision = aws_rules.decide(state, GROUP_SETTINGS, now, daemons=True)
    aws_rules.apply_decision(state, decision, now)
    state.aws.next_at = decision.next_at
    return decision


def test_a_daemon_task_missing_past_its_grace_impairs_daemon_and_back_clears_it() -> None:
    health = new_health()
    state = health.state
    told(state, 0, "gpu-exporter")
    assert aws_rules.due(state, START)
    decision = advance(state, 1)
    assert CheckType.DAEMON not in state.checks  # within the grace: nothing yet
    assert decision.next_at == START + GRACE and "gpu-exporter" in decision.next_what
    assert not aws_rules.due(state, START + timedelta(minutes=4)) and aws_rules.due(state, START + GRACE)
    decision = aws_rules.decide(state, GROUP_SETTINGS, START + GRACE, daemons=True)
    assert decision.impairs_anew(state)  # so the workflow confirms with AWS first
    advance(state, 5)
    assert status(health, CheckType.DAEMON) == (HealthState.IMPAIRED, EXPORTER)
    assert state.daemons_down == [EXPORTER]
    assert health.is_impaired() and not checks.critical(state)  # DAEMON waits for a maintenance window
    assert health.impairment()[0] == EXPORTER
    told(state, 6, "gpu-exporter")  # the same picture told again: nothing new
    assert advance(state, 6).daemons is not None and status(health, CheckType.DAEMON)[0] is HealthState.IMPAIRED

    told(state, 7)  # its task is back
    advance(state, 7)
    assert status(health, CheckType.DAEMON) == (HealthState.OK, None)
    assert state.daemons_down == [] and state.aws.daemons_impaired == []


def test_a_blip_shorter_than_the_grace_is_nothing_and_a_new_outage_starts_its_own_grace() -> None:
    health = new_health()
    state = health.state
    told(state, 0, "gpu-exporter")
    advance(state, 0)
    told(state, 4)  # back within the grace
    assert advance(state, 4).next_at is None
    told(state, 4.5, "gpu-exporter")
    advance(state, 6)
    assert CheckType.DAEMON not in state.checks  # the grace runs from 4.5, not 0
    advance(state, 9.5)
    assert status(health, CheckType.DAEMON) == (HealthState.IMPAIRED, EXPORTER)


def test_ecs_daemons_and_systemd_units_share_the_down_list() -> None:
    """The check stays IMPAIRED, for the first still down, until the last of either kind is back."""
    health = new_health()
    state = health.state
    signal(health, health.on_finding, finding("d1", reason="DAEMON_nvidia-fabricmanager", kind=KIND_DAEMON, code=None,
                                               gpu=GpuRef()))  # fmt: skip
    told(state, 0, "gpu-exporter", "log-shipper")
    advance(state, 5)
    assert status(health, CheckType.DAEMON) == (HealthState.IMPAIRED, "DAEMON_nvidia-fabricmanager")
    assert state.daemons_down == ["DAEMON_nvidia-fabricmanager", EXPORTER, "ECS_DAEMON_log-shipper"]
    told(state, 6, "log-shipper")
    advance(state, 6)
    assert state.daemons_down == ["DAEMON_nvidia-fabricmanager", "ECS_DAEMON_log-shipper"]
    assert status(health, CheckType.DAEMON)[0] is HealthState.IMPAIRED


def test_unpatched_the_daemon_tasks_are_not_decided() -> None:
    """A history from before the reader told daemon tasks: no decision, no timer, so no new command."""
    state = new_health().state
    told(state, 0, "gpu-exporter")
    decision = aws_rules.decide(state, GROUP_SETTINGS, START + GRACE)
    assert decision.daemons is None and decision.next_at is None and not decision.impairs_anew(state)


def test_a_cleared_daemon_impairment_is_proven_afresh() -> None:
    health = new_health()
    state = health.state
    told(state, 0, "gpu-exporter")
    advance(state, 5)
    cleared = checks.clear_impaired(state, "ops", "known exporter bug", START + timedelta(minutes=6))
    assert [c.check for c in cleared] == [CheckType.DAEMON] and isinstance(cleared[0], ClearedFinding)
    assert aws_rules.due(state, START + timedelta(minutes=6))  # someone else's OK: looked at at once
    advance(state, 6)
    assert status(health, CheckType.DAEMON)[0] is HealthState.OK
    assert state.aws.next_at == START + timedelta(minutes=6) + GRACE  # a full grace from the clear
    advance(state, 11)
    assert status(health, CheckType.DAEMON) == (HealthState.IMPAIRED, EXPORTER)


def test_a_task_back_after_its_repair_began_keeps_the_check_until_the_repair_ends() -> None:
    health = new_health()
    state = health.state
    told(state, 0, "gpu-exporter")
    advance(state, 5)
    repairing(health)
    told(state, 6)
    advance(state, 6)
    assert status(health, CheckType.DAEMON)[0] is HealthState.IMPAIRED  # a repair that started finishes
    assert state.daemons_down == [] and state.aws.daemons_impaired == []


def test_a_fix_in_place_takes_the_daemon_impairment_back_and_its_grace_counts_from_the_fix() -> None:
    health = new_health()
    state = health.state
    told(state, 0, "gpu-exporter")
    advance(state, 5)
    repairing(health)
    fixed_at = START + timedelta(minutes=8)
    fix = InPlaceFix(
        workflow_id="repair/i-0abc/1",
        action=RepairAction.REBOOT,
        reason="XID_79",
        started_at=START + timedelta(minutes=6),
        fixed_at=fixed_at,
    )
    health.on_repair_progress(
        RepairProgress(
            workflow_id="repair/i-0abc/1", phase=RepairPhase.COMPLETED, finished=True, token="secret",
            in_place_fix=fix,
        )
    )  # fmt: skip
    assert not health.retired
    assert aws_rules.due(state, fixed_at)
    advance(state, 8)
    assert status(health, CheckType.DAEMON) == (HealthState.OK, None)
    assert state.aws.next_at == fixed_at + GRACE  # still missing: counted from the fix
    advance(state, 13)
    assert status(health, CheckType.DAEMON) == (HealthState.IMPAIRED, EXPORTER)


def test_daemon_services_are_ecs_service_names_each_named_once() -> None:
    group = {"name": "g", "cluster": "c"}
    settings = Settings(groups=[{**group, "daemon_services": ["gpu-exporter"], "daemon_task_grace": "PT2M"}])
    assert settings.groups[0].daemon_services == ["gpu-exporter"]
    assert settings.groups[0].daemon_task_grace == timedelta(minutes=2)
    assert Settings(groups=[group]).groups[0].daemon_services == []  # opt-in
    with pytest.raises(ValidationError, match="more than once"):
        Settings(groups=[{**group, "daemon_services": ["gpu-exporter", "gpu-exporter"]}])
    with pytest.raises(ValidationError, match="daemon_services"):
        Settings(groups=[{**group, "daemon_services": ["not a service"]}])
    with pytest.raises(ValidationError, match="daemon_task_grace"):
        Settings(groups=[{**group, "daemon_task_grace": "PT0S"}])
