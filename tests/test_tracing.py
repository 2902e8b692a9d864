"""OpenTelemetry: with the tracing interceptor on the client, each repair is one trace of its own."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from temporalio.client import Client
from temporalio.contrib.opentelemetry import TracingInterceptor

from tests.fleet import simulated_fleet


async def test_each_repair_is_one_trace_apart_from_the_health_workflow(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config: dict[str, Any] = {**client.config(), "interceptors": [TracingInterceptor(provider.get_tracer("test"))]}
    traced = Client(**config)

    async with simulated_fleet(traced, aws_env, tmp_path, instances=3) as fleet:
        await fleet.all_healthy(3)
        faulty = fleet.sim.live_instances()[0]
        fleet.sim.inject_fault(faulty, xid=79)
        assert await fleet.repairs_finished(1) == [faulty]

    spans = exporter.get_finished_spans()
    traces_by_name: dict[str, set[int]] = defaultdict(set)
    for span in spans:
        assert span.context is not None
        traces_by_name[span.name].add(span.context.trace_id)

    [repair_trace] = traces_by_name["StartWorkflow:InstanceRepairWorkflow"]
    start = next(s for s in spans if s.name == "StartWorkflow:InstanceRepairWorkflow")
    assert start.parent is None  # a root: not a child of the health workflow's activity
    for step in ("set_draining", "launch_replacement", "await_container_instance_active", "terminate_instance"):
        assert traces_by_name[f"RunActivity:{step}"] == {repair_trace}, step
    assert repair_trace in traces_by_name["RunWorkflow:InstanceRepairWorkflow"]
    assert repair_trace not in traces_by_name["RunWorkflow:InstanceHealthWorkflow"]
