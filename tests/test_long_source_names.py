"""A kernel log whose path is longer than a name may be still reaches the workflows (found by CI: a test's tmp path
under pytest-xdist made the demo's probes fail to build a heartbeat, so no instance ever became healthy)."""

from __future__ import annotations

from pathlib import Path

from contract.health import HealthState
from contract.limits import MAX_NAME
from node_probe.probe import Probe
from tests.test_probe import XID_79, FakeReporter, config, eventually, running


async def test_a_kernel_log_with_a_very_long_path_reports_heartbeats_and_findings(tmp_path: Path) -> None:
    deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 6)
    deep.mkdir(parents=True)
    log = deep / "node-i-0123456789abcdef0.kern.log"
    assert len(f"kernel_log:{log}") > MAX_NAME
    log.write_text(XID_79)
    reporter = FakeReporter()
    probe = Probe(config(tmp_path, kernel_log=log), reporter)

    async with running(probe):
        await eventually(lambda: len(reporter.heartbeats) >= 1 and len(reporter.findings) == 1)

    [source] = reporter.heartbeats[0].sources
    assert reporter.heartbeats[0].gpu_health is HealthState.OK
    # The end of the path is what tells one file from another: kept, with the kind.
    assert len(source.name) == MAX_NAME and source.name.startswith("kernel_log:...")
    assert source.name.endswith("node-i-0123456789abcdef0.kern.log")
    [finding] = reporter.findings
    assert finding.code == 79 and finding.source == source.name
