"""The NVML source through the probe (the stand-in for pynvml is tests/fake_nvml.py): its findings and health in
what the probe sends, and the kernel log's findings named and deduplicated alike."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import Any

import pynvml

from contract.health import HealthState
from contract.probe import Heartbeat
from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.policy import Policy
from node_probe.delivery.liveness_relay import LivenessRelay, routes_of
from node_probe.probe import Probe, ProbeConfig
from node_probe.sources.nvml import nvml_available
from tests.fake_nvml import NO_INSTANCE, NOW, XID, FakeNvml, make_source, two_gpus
from tests.test_probe import FakeReporter, eventually

# --- through the probe ------------------------------------------------------------------------------------


async def test_probe_delivers_an_nvml_xid_finding_with_the_gpus_identity(tmp_path: Any) -> None:
    fake = FakeNvml(two_gpus())
    fake.events.append((0, XID, 79, NO_INSTANCE, NO_INSTANCE))
    config = ProbeConfig(instance_id="i-1", group="g", heartbeat_interval=timedelta(seconds=3600))
    reporter = FakeReporter()
    probe = Probe(config, reporter, sources=[make_source(fake)])
    task = asyncio.create_task(probe.run())
    try:
        await eventually(lambda: len(reporter.findings) == 1 and len(reporter.heartbeats) == 1)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    (finding,) = reporter.findings
    assert (finding.kind, finding.reason, finding.impairs, finding.source) == ("xid", "XID_79", True, "nvml")
    assert finding.gpu.pci == "0000:3b:00" and finding.gpu.uuid == "GPU-11111111-2222-3333-4444-555555555555"
    assert reporter.heartbeats[0].gpu_health == HealthState.OK
    assert reporter.heartbeats[0].gpu_count == 2  # what NVML enumerates: the worker compares it with the type's


def test_the_heartbeat_counts_the_gpus_nvml_enumerates_and_none_while_it_cannot_read_them() -> None:
    fake = FakeNvml(two_gpus())
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    nvml = make_source(fake)
    probe = Probe(ProbeConfig(instance_id="i-1", group="g"), FakeReporter(), sources=[nvml])
    nvml.check()
    assert probe.heartbeat().gpu_count is None  # not known is not zero: never a missing GPU
    fake.init_error = None
    nvml.check()
    assert probe.heartbeat().gpu_count == 2
    assert Probe(ProbeConfig(instance_id="i-1", group="g"), FakeReporter(), sources=[]).heartbeat().gpu_count is None


async def test_heartbeat_is_insufficient_data_while_any_gpu_source_is_down_naming_each(tmp_path: Any) -> None:
    from node_probe.sources.log_file import KernelLogFileSource

    kernel_log = KernelLogFileSource(tmp_path / "missing.log")
    nvml_down = FakeNvml(two_gpus())
    nvml_down.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    nvml = make_source(nvml_down)
    config = ProbeConfig(instance_id="i-1", group="g")
    probe = Probe(config, FakeReporter(), sources=[kernel_log, nvml])
    kernel_log.check()
    nvml.check()
    state, reason = probe.gpu_health()
    assert state == HealthState.INSUFFICIENT_DATA
    assert "missing.log" in (reason or "") and "Driver Not Loaded" in (reason or "")
    # The kernel log alone is not enough: NVML's polled ECC and remap state would go unseen.
    (tmp_path / "missing.log").write_text("")
    kernel_log.check()
    state, reason = probe.gpu_health()
    assert state == HealthState.INSUFFICIENT_DATA and reason is not None
    assert "Driver Not Loaded" in reason and "missing.log" not in reason
    # The heartbeat also says it source by source.
    heartbeat = probe.heartbeat()
    assert [(s.name, s.state) for s in heartbeat.sources] == [
        (kernel_log.name, HealthState.OK),
        ("nvml", HealthState.INSUFFICIENT_DATA),
    ]
    assert "Driver Not Loaded" in (heartbeat.sources[1].reason or "")
    # The driver loads: NVML comes back by itself.
    nvml_down.init_error = None
    nvml.check()
    assert probe.gpu_health() == (HealthState.OK, None)
    assert all(s.state is HealthState.OK and s.reason is None for s in probe.heartbeat().sources)


def test_nvml_is_on_by_default_where_the_driver_library_exists_even_before_the_driver_loads() -> None:
    not_loaded = FakeNvml(two_gpus())
    not_loaded.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert nvml_available(not_loaded) is True
    no_library = FakeNvml(two_gpus())
    no_library.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    assert nvml_available(no_library) is False


async def test_a_kernel_log_finding_names_the_gpus_uuid_that_nvml_knows(tmp_path: Any) -> None:
    from node_probe.sources.log_file import KernelLogFileSource

    log_path = tmp_path / "kern.log"
    log_path.write_text("[  100.000000] NVRM: Xid (PCI:0000:c1:00): 79, pid=1, name=x, GPU has fallen off the bus.\n")
    nvml = make_source(FakeNvml(two_gpus()))
    config = ProbeConfig(
        instance_id="i-1", group="g", poll_interval=timedelta(seconds=0.02), heartbeat_interval=timedelta(hours=1)
    )
    reporter = FakeReporter()
    probe = Probe(config, reporter, sources=[nvml, KernelLogFileSource(log_path, 0.02)])
    # NVML is answering before the line is read, as on a host where the probe has been running.
    nvml.check()
    task = asyncio.create_task(probe.run())
    try:
        await eventually(lambda: len(reporter.findings) == 1)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    (finding,) = reporter.findings
    assert finding.source.startswith("kernel_log") and finding.reason == "XID_79"
    assert (finding.gpu.pci, finding.gpu.uuid) == ("0000:c1:00", "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee")


def test_an_nvml_xid_and_the_kernel_logs_line_for_it_are_one_burst() -> None:
    from node_probe.classify.findings import dedupe_key

    (from_log,) = parse_lines(["NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."])
    fake = FakeNvml(two_gpus())
    source = make_source(fake)
    assert source.check().is_ok
    data = pynvml.c_nvmlEventData_t()
    data.device = fake.gpus[0].handle
    data.eventType, data.eventData = XID, 79
    data.gpuInstanceId = data.computeInstanceId = NO_INSTANCE
    session = source._session
    assert session is not None
    ((from_nvml, _),) = source._event_records(session, data)
    policy = Policy()
    key_log = dedupe_key(from_log, policy.classify(from_log, NOW))
    assert key_log == dedupe_key(from_nvml, policy.classify(from_nvml, NOW))


async def test_a_gpu_gone_from_the_host_is_news_the_relay_forwards() -> None:
    reporter = FakeReporter()
    relay = LivenessRelay(reporter, routes_of([]), "q", relay=True)  # type: ignore[arg-type]
    beat = Heartbeat(instance_id="i-1", group="g", sent_at=NOW, gpu_count=8)
    await relay.send_heartbeat(beat, "q")
    await relay.send_heartbeat(beat.model_copy(update={"sent_at": NOW + timedelta(seconds=10)}), "q")
    await relay.send_heartbeat(beat.model_copy(update={"gpu_count": 7}), "q")
    assert [h.gpu_count for h in reporter.heartbeats] == [8, 7]
