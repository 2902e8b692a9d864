"""The probe's Prometheus metrics (GET /metrics on `--metrics-bind`, node_probe/health.py serves it).

Read when Prometheus scrapes, from what the probe counts where things happen anyway (`Probe.stats`), its spool, its
sources' states and NVML's last poll: no timer, no polling, nothing at idle, and no prometheus_client call on a
record's path through the probe. prometheus_client is imported only by a probe that serves metrics (about 1 MiB).

Every series carries the probe's `group`; `autorepair_probe_info` carries its `instance_id` too. Counters start at
zero when the probe starts and end in `_total`, as the worker's and the ingest's do.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from node_probe.probe import Probe

SOURCE_STATES = ("ok", "degraded", "failed")
_PCIE_FIELDS = ("width", "max_width", "generation", "max_generation")


class ProbeCollector(Collector):
    def __init__(self, probe: Probe) -> None:
        self._probe = probe

    def collect(self) -> Iterator[Metric]:
        probe, stats = self._probe, self._probe.stats
        group = probe.config.group
        info = GaugeMetricFamily("autorepair_probe_info", "This probe's instance", labels=["group", "instance_id"])
        info.add_metric([group, probe.config.instance_id], 1)
        yield info
        yield _counter("autorepair_probe_records", "Fault records read from the sources", group, stats.records)
        yield _counter(
            "autorepair_probe_records_folded",
            "Records folded into a burst's finding (the burst's roll-up counts them)",
            group,
            stats.suppressed,
        )
        yield _counter(
            "autorepair_probe_records_copied",
            "Records another source had seen already, one fault (one finding)",
            group,
            stats.copies,
        )
        findings = CounterMetricFamily(
            "autorepair_probe_findings",
            "Findings made, by reason (XID_79, ...) and kind",
            labels=["group", "reason", "kind"],
        )
        for (reason, kind), count in sorted(stats.findings.items()):
            findings.add_metric([group, reason, kind], count)
        yield findings
        yield _counter("autorepair_probe_findings_delivered", "Findings the ingest accepted", group, stats.delivered)
        yield _counter(
            "autorepair_probe_findings_dropped", "Warnings dropped because the spool was full", group, stats.dropped
        )
        failures = CounterMetricFamily(
            "autorepair_probe_delivery_failures",
            "Tries to deliver a finding that failed (each is retried), by why: the ingest's check that refused it, "
            "or the error",
            labels=["group", "why"],
        )
        for why, count in sorted(stats.failures_by.items()):
            failures.add_metric([group, why], count)
        yield failures
        heartbeats = CounterMetricFamily(
            "autorepair_probe_heartbeats", "Heartbeats sent, by result", labels=["group", "result"]
        )
        heartbeats.add_metric([group, "delivered"], stats.heartbeats_sent)
        heartbeats.add_metric([group, "failed"], stats.heartbeat_failures)
        yield heartbeats
        yield _gauge("autorepair_probe_spool_findings", "Findings waiting to be delivered", group, probe.pending)
        yield _gauge(
            "autorepair_probe_spool_degraded",
            "1 while the spool's disk fails it (findings wait in memory)",
            group,
            int(probe.spool_degraded),
        )
        states = GaugeMetricFamily(
            "autorepair_probe_source_state",
            "1 for each source's state now (ok, degraded: runs but cannot read, failed: restarting after an error)",
            labels=["group", "source", "state"],
        )
        for source, now in sorted(probe.source_states().items()):
            for state in SOURCE_STATES:
                states.add_metric([group, source, state], 1 if state == now else 0)
        yield states
        yield from _gpu_families(group, probe.gpu_readings() or {})


def _gpu_families(group: str, gpus: Mapping[str, Any]) -> Iterator[Metric]:
    """NVML's last poll per GPU: the warnings that hold (clocks slowed, a PCIe link below its maximum) and the
    link itself. Never a repair: the findings say when a warning began, these say whether it lasts."""
    warnings = GaugeMetricFamily(
        "autorepair_probe_gpu_warning",
        "1 for each warning that holds on a GPU now (by its reason: clocks slowed, PCIe link degraded)",
        labels=["group", "gpu", "reason"],
    )
    links = {
        name: GaugeMetricFamily(
            f"autorepair_probe_gpu_pcie_link_{name}",
            f"The GPU's PCIe link {name.replace('_', ' ')}",
            labels=["group", "gpu"],
        )
        for name in _PCIE_FIELDS
    }
    for gpu, reading in sorted(gpus.items()):
        for reason in reading.get("warnings", ()):
            warnings.add_metric([group, gpu, reason], 1)
        link = reading.get("pcie")
        if isinstance(link, Mapping):  # else "not read yet", "not supported"
            for name in _PCIE_FIELDS:
                links[name].add_metric([group, gpu], link[name])
    yield warnings
    yield from links.values()


def _counter(name: str, documentation: str, group: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=["group"])
    family.add_metric([group], value)
    return family


def _gauge(name: str, documentation: str, group: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["group"])
    family.add_metric([group], value)
    return family


class ProbeMetrics:
    """The probe's registry: its collector and the process' own (CPU seconds, resident memory, open files)."""

    def __init__(self, probe: Probe) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ProbeCollector(probe))
        ProcessCollector(registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
