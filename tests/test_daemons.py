"""Critical daemons via `systemctl is-active`, with a fake command runner and a fake clock."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from contract.health import HealthState
from node_probe.classify.policy import Policy
from node_probe.host import CommandResult
from node_probe.probe import Probe, ProbeConfig, build_sources
from node_probe.sources.daemons import DaemonSource, DaemonSpec, default_daemons, has_nvswitches
from tests.test_probe import FakeReporter, eventually

NOW = datetime(2025, 1, 1, tzinfo=UTC)


class FakeSystemctl:
    """`systemctl is-active U...` answers from `states`; `systemctl show ... --value U...` from `load_states`."""

    def __init__(self, states: dict[str, str], load_states: dict[str, str] | None = None) -> None:
        self.states = states
        self.load_states = load_states or {}
        self.calls: list[tuple[str, ...]] = []
        self.error: BaseException | None = None

    async def __call__(self, argv: Sequence[str], timeout: float) -> CommandResult:
        self.calls.append(tuple(argv))
        if self.error is not None:
            raise self.error
        if argv[1] == "is-active":
            lines = [self.states.get(unit, "inactive") for unit in argv[2:]]
            rc = 0 if all(line == "active" for line in lines) else 3
            return CommandResult(rc, "\n".join(lines) + "\n")
        assert argv[1:4] == ["show", "--property=LoadState", "--value"]
        return CommandResult(0, "\n\n".join(self.load_states.get(unit, "not-found") for unit in argv[4:]) + "\n")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(units: list[DaemonSpec], systemctl: FakeSystemctl, clock: Clock, threshold: float = 60) -> DaemonSource:
    return DaemonSource(units, down_threshold=threshold, runner=systemctl, clock=clock)


def test_spec_parsing() -> None:
    assert DaemonSpec.parse("nvidia-fabricmanager:critical") == DaemonSpec(unit="nvidia-fabricmanager", critical=True)
    assert DaemonSpec.parse("nvidia-persistenced") == DaemonSpec(unit="nvidia-persistenced")
    with pytest.raises(ValueError, match="UNIT:critical"):
        DaemonSpec.parse("x:sometimes")


def test_defaults_watch_the_fabric_manager_only_with_nvswitches(tmp_path: Path) -> None:
    first = default_daemons(nvswitches=True)[0]
    assert first.unit == "nvidia-fabricmanager" and first.critical
    assert "nvidia-fabricmanager" not in [s.unit for s in default_daemons(nvswitches=False)]
    assert all(s.only_if_installed for s in default_daemons(nvswitches=False))
    dev = tmp_path / "dev"
    dev.mkdir()
    assert not has_nvswitches(dev, proc_dirs=[tmp_path / "none"])
    (dev / "nvidia-nvswitch0").touch()
    assert has_nvswitches(dev, proc_dirs=[])


async def test_a_unit_down_past_the_threshold_is_one_finding() -> None:
    systemctl = FakeSystemctl({"nvidia-fabricmanager": "failed", "nvidia-persistenced": "active"})
    clock = Clock()
    units = [DaemonSpec(unit="nvidia-fabricmanager", critical=True), DaemonSpec(unit="nvidia-persistenced")]
    source = make(units, systemctl, clock)
    assert await source.poll() == []  # down, but not for long yet
    assert source.status.is_ok
    clock.now += 30
    assert await source.poll() == []
    clock.now += 31
    (observation,) = await source.poll()
    record = observation.record
    assert (record.kind, record.reason, record.critical) == ("daemon", "DAEMON_nvidia-fabricmanager", True)
    assert "failed for 61s" in record.message
    for policy in ("ecs", "nvidia-catalog"):
        verdict = Policy(policy).classify(record, NOW)
        assert verdict.impairs and verdict.reason == "DAEMON_nvidia-fabricmanager"
    clock.now += 600
    assert await source.poll() == []  # still down: already reported
    assert systemctl.calls[0] == ("systemctl", "is-active", "nvidia-fabricmanager", "nvidia-persistenced")


async def test_a_unit_not_marked_critical_is_a_warning() -> None:
    systemctl = FakeSystemctl({"nvidia-persistenced": "inactive"})
    clock = Clock()
    source = make([DaemonSpec(unit="nvidia-persistenced")], systemctl, clock, threshold=0)
    (observation,) = await source.poll()
    verdict = Policy().classify(observation.record, NOW)
    assert not verdict.impairs and verdict.reason == "DAEMON_nvidia-persistenced"


async def test_a_unit_that_comes_back_in_time_is_nothing_and_a_new_outage_is_a_new_finding() -> None:
    systemctl = FakeSystemctl({"dcgm": "activating"})  # a restart loop counts as down
    clock = Clock()
    source = make([DaemonSpec(unit="dcgm")], systemctl, clock)
    await source.poll()
    clock.now += 50
    systemctl.states["dcgm"] = "active"
    assert await source.poll() == []
    systemctl.states["dcgm"] = "failed"
    clock.now += 10
    assert await source.poll() == []  # the clock restarted when it came back
    clock.now += 60
    (first,) = await source.poll()
    systemctl.states["dcgm"] = "active"
    await source.poll()
    systemctl.states["dcgm"] = "failed"
    await source.poll()
    clock.now += 60
    (second,) = await source.poll()
    assert first.position != second.position


async def test_a_reported_unit_back_up_is_a_recovery_finding_that_never_impairs() -> None:
    systemctl = FakeSystemctl({"nvidia-fabricmanager": "failed"})
    clock = Clock()
    source = make([DaemonSpec(unit="nvidia-fabricmanager", critical=True)], systemctl, clock, threshold=0)
    (down,) = await source.poll()
    clock.now += 42
    systemctl.states["nvidia-fabricmanager"] = "active"
    (up,) = await source.poll()
    assert (up.record.kind, up.record.reason) == ("daemon_recovered", "DAEMON_nvidia-fabricmanager")
    assert "active again after 42s" in up.record.message
    for policy in ("ecs", "nvidia-catalog"):
        verdict = Policy(policy).classify(up.record, NOW)
        assert not verdict.impairs and verdict.rule == f"{policy}:daemon-recovered"
        assert verdict.reason == "DAEMON_nvidia-fabricmanager"
    assert await source.poll() == []  # up and staying up: said once
    assert len({down.position, up.position}) == 2


async def test_the_probe_never_folds_daemon_transitions_into_a_burst() -> None:
    """Down, up, down within the dedupe window: three findings, or the last outage would be hidden."""
    systemctl = FakeSystemctl({"nvidia-fabricmanager": "failed"})
    source = DaemonSource(
        [DaemonSpec(unit="nvidia-fabricmanager", critical=True)], down_threshold=0, poll_interval=0.01, runner=systemctl
    )
    reporter = FakeReporter()
    probe = Probe(ProbeConfig(instance_id="i-1", group="g", heartbeat_interval=60), reporter, sources=[source])
    task = asyncio.create_task(probe.run())
    try:
        await eventually(lambda: len(reporter.findings) == 1)
        systemctl.states["nvidia-fabricmanager"] = "active"
        await eventually(lambda: len(reporter.findings) == 2)
        systemctl.states["nvidia-fabricmanager"] = "failed"
        await eventually(lambda: len(reporter.findings) == 3)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert [(f.kind, f.impairs) for f in reporter.findings] == [
        ("daemon", True),
        ("daemon_recovered", False),
        ("daemon", True),
    ]
    assert probe.stats.suppressed == 0


async def test_optional_units_are_watched_only_when_installed() -> None:
    systemctl = FakeSystemctl({"nvidia-dcgm": "failed"}, load_states={"nvidia-dcgm": "loaded"})
    clock = Clock()
    units = [DaemonSpec(unit="nvidia-dcgm", only_if_installed=True), DaemonSpec(unit="dcgm", only_if_installed=True)]
    source = make(units, systemctl, clock, threshold=0)
    (observation,) = await source.poll()
    assert observation.record.reason == "DAEMON_nvidia-dcgm"
    assert ("systemctl", "is-active", "nvidia-dcgm") in systemctl.calls  # "dcgm" is not installed: not asked


async def test_no_systemctl_is_a_down_source_that_does_not_touch_gpu_health(tmp_path: Path) -> None:
    systemctl = FakeSystemctl({})
    systemctl.error = FileNotFoundError("systemctl")
    source = make([DaemonSpec(unit="nvidia-persistenced")], systemctl, Clock())
    assert await source.poll() == []
    assert source.status.state == HealthState.INSUFFICIENT_DATA and "not found" in (source.status.reason or "")
    systemctl.error = TimeoutError()
    await source.poll()
    assert "did not finish" in (source.status.reason or "")
    systemctl.error = None
    await source.poll()
    assert source.status.is_ok

    from node_probe.sources.log_file import KernelLogFileSource

    kernel_log = KernelLogFileSource(tmp_path / "kern.log")
    kernel_log.check()  # missing: down
    systemctl.error = FileNotFoundError("systemctl")  # and the daemon source down again
    await source.poll()
    probe = Probe(ProbeConfig(instance_id="i-1", group="g"), FakeReporter(), sources=[kernel_log, source])
    state, reason = probe.gpu_health()
    assert state == HealthState.INSUFFICIENT_DATA and "kern.log" in (reason or "") and "daemons:" not in (reason or "")
    (tmp_path / "kern.log").write_text("")
    kernel_log.check()
    assert probe.gpu_health() == (HealthState.OK, None)  # the down daemon source does not matter
    # It is still reported, as what it is: not a GPU source, and down.
    daemons = probe.heartbeat().sources[-1]
    assert (daemons.gpu_source, daemons.state) == (False, HealthState.INSUFFICIENT_DATA)
    assert "not found" in (daemons.reason or "")


def test_probe_config_builds_the_sources(tmp_path: Path) -> None:
    config = ProbeConfig(
        instance_id="i-1",
        group="g",
        kernel_log=tmp_path / "kern.log",
        dcgm=True,
        daemons=[DaemonSpec(unit="nvidia-fabricmanager", critical=True)],
    )
    names = [source.name for source in build_sources(config)]
    assert names == [f"kernel_log:{tmp_path / 'kern.log'}", "dcgm", "daemons"]


def test_cli_flags(tmp_path: Path) -> None:
    import argparse

    from node_probe import cli

    parser = argparse.ArgumentParser()
    cli.add_probe_arguments(parser)
    args = parser.parse_args(
        ["--group", "g", "--no-nvml", "--dcgm", "--daemon", "nvidia-fabricmanager:critical", "--daemon", "x"]
    )
    assert args.nvml is False and args.dcgm is True
    assert cli._daemon_specs(args) == [
        DaemonSpec(unit="nvidia-fabricmanager", critical=True),
        DaemonSpec(unit="x"),
    ]
    assert cli._daemon_specs(parser.parse_args(["--group", "g", "--no-daemons"])) == []
    bad = parser.parse_args(["--group", "g", "--daemon", "x:often"])
    with pytest.raises(cli.CliError, match="--daemon"):
        cli._daemon_specs(bad)


def test_without_systemctl_the_default_units_are_not_watched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container (the Kubernetes DaemonSet) has no systemd: default units could never be checked."""
    import argparse

    from node_probe import cli

    parser = argparse.ArgumentParser()
    cli.add_probe_arguments(parser)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no systemctl on the PATH
    assert cli._daemon_specs(parser.parse_args(["--group", "g"])) == []
    # Units named on the command line are still watched, and their source says why it cannot check them.
    assert cli._daemon_specs(parser.parse_args(["--group", "g", "--daemon", "x"])) == [DaemonSpec(unit="x")]


async def test_cli_builds_a_probe_with_the_new_sources(tmp_path: Path) -> None:
    import argparse

    from node_probe import cli

    parser = argparse.ArgumentParser()
    cli.add_probe_arguments(parser)
    # The probe's own sources are under test, not how it reports: the trusted-lab direct mode.
    args: Any = parser.parse_args(
        ["--instance-id", "i-1", "--group", "g", "--spool-dir", str(tmp_path), "--dcgm", "--daemon", "u:critical",
         "--direct-temporal"]
    )  # fmt: skip
    probe = await cli.build_probe(args)
    # NVML defaults off here (no driver on this machine); the flags turn DCGM and the daemon on.
    assert probe.config.nvml is False and probe.config.dcgm is True
    assert probe.config.daemons == [DaemonSpec(unit="u", critical=True)]
