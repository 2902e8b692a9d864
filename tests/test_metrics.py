"""Our metrics and Temporal's on one Prometheus endpoint: a worker on a runtime with a Prometheus exporter repairs
one instance of the simulated fleet, and a scrape of /metrics shows the repair, its phases and Temporal's own series.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from activities.metrics import _finding_to_impaired, reason_label
from activities.models import EventType, FleetEvent
from contract.health import HealthInput, HealthState
from contract.repair import RepairPhase
from simulator.servers import free_port
from tests.fleet import simulated_fleet
from tests.harness import eventually, unique
from tests.prometheus_text import has_series, scrape, total
from tests.test_health_signals import finding, health_of, heartbeat, monitor_only, start_health
from worker.health_gauges import INSTANCES, health_gauges
from worker.settings import Settings
from worker.telemetry import runtime

REPAIR_PHASES = [
    RepairPhase.WAITING_FOR_PERMIT,
    RepairPhase.DRAINING,
    RepairPhase.LAUNCHING_REPLACEMENT,
    RepairPhase.WAITING_FOR_REPLACEMENT,
    RepairPhase.STOPPING_TASKS,
    RepairPhase.TERMINATING,
]


def metrics_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/metrics"


async def test_a_repair_shows_on_the_prometheus_endpoint_with_temporals_metrics(
    client: Client, aws_env: str, tmp_path
) -> None:
    port = free_port()
    metrics_runtime = runtime(Settings(metrics_bind_address=f"127.0.0.1:{port}"))
    assert metrics_runtime is not None
    # A client on that runtime: the worker built on it reports Temporal's metrics and ours to the one exporter.
    metrics_client = await Client.connect(
        client.service_client.config.target_host,
        namespace=client.namespace,
        runtime=metrics_runtime,
        data_converter=pydantic_data_converter,
    )
    async with simulated_fleet(metrics_client, aws_env, tmp_path, instances=3) as fleet:
        await fleet.all_healthy(3)
        [faulty] = fleet.sim.live_instances()[:1]
        fleet.sim.inject_fault(faulty, xid=79)
        assert await fleet.repairs_finished(1) == [faulty]
        group = fleet.group
        [completed] = fleet.events("RepairCompleted")

        text = await eventually(
            lambda: scrape(metrics_url(port)),
            lambda t: total(t, "autorepair_drain_permits_released_total", group=group) >= 1,
        )
        samples = text

        assert total(samples, "autorepair_repairs_started_total", group=group, reason="XID_79") == 1
        assert total(samples, "autorepair_repairs_completed_total", group=group, reason="XID_79") == 1
        assert total(samples, "autorepair_repairs_failed_total", group=group) == 0
        assert total(samples, "autorepair_drain_permits_granted_total", group=group) == 1
        assert total(samples, "autorepair_drain_permits_released_total", group=group) == 1
        # The semaphore's gauges: the permit was held, and is free again.
        assert has_series(samples, "autorepair_drain_permits_in_use", group=group)
        assert total(samples, "autorepair_drain_permits_in_use", group=group) == 0
        assert total(samples, "autorepair_drain_permits_waiting", group=group) == 0
        # Not held: the series is there at 0, so an alert on it has something to read.
        assert has_series(samples, "autorepair_repairs_held", group=group)
        # Nothing DRAINING without a permit once the repair is done.
        assert has_series(samples, "autorepair_instances_out_of_service", group=group)
        assert total(samples, "autorepair_instances_out_of_service", group=group) == 0
        assert total(samples, "autorepair_repairs_held", group=group) == 0
        assert total(samples, "autorepair_health_changes_total", group=group, status="IMPAIRED") == 1
        # INITIALIZING -> OK for the three instances and for the replacement.
        assert total(samples, "autorepair_health_changes_total", group=group, status="OK") >= 4
        assert total(samples, "autorepair_finding_to_impaired_seconds_count", group=group) == 1
        assert total(samples, "autorepair_repair_duration_seconds_count", group=group, outcome="Completed") == 1
        for phase in REPAIR_PHASES:
            count = total(samples, "autorepair_repair_phase_duration_seconds_count", group=group, phase=phase.value)
            assert count == 1, phase
        # The phases add up to the whole repair, which is the timeline the event carried.
        phases = total(samples, "autorepair_repair_phase_duration_seconds_sum", group=group)
        whole = total(samples, "autorepair_repair_duration_seconds_sum", group=group)
        timeline = [datetime.fromisoformat(s["started_at"]) for s in completed["detail"]["timeline"]]
        assert abs(phases - whole) < 0.01
        assert abs(whole - (timeline[-1] - timeline[0]).total_seconds()) < 0.01
        # The seconds buckets of activities/metrics.py, not Temporal's millisecond defaults.
        assert has_series(samples, "autorepair_repair_duration_seconds_bucket", le="86400")

        # Temporal's own runtime metrics, on the same endpoint.
        names = {sample.name for sample in samples}
        assert "temporal_activity_execution_latency_count" in names, sorted(names)
        assert "temporal_workflow_completed_total" in names, sorted(names)
        # One naming scheme: every counter, ours and Temporal's, ends in _total (worker/telemetry.py).
        assert "autorepair_repairs_started" not in names and "temporal_workflow_completed" not in names


async def test_instances_by_health_status_is_a_gauge_counted_from_visibility(
    client: Client, aws_env: str, tmp_path
) -> None:
    """Two OK, one IMPAIRED (monitor only, so it stays), one INITIALIZING: the gauge says so per group, and a
    change of status moves an instance from one series to another."""
    port = free_port()
    metrics_runtime = runtime(Settings(metrics_bind_address=f"127.0.0.1:{port}"))
    assert metrics_runtime is not None
    meter = metrics_runtime.metric_meter
    async with monitor_only(client, aws_env, tmp_path) as (settings, group):
        ok = [await start_health(client, settings, unique("i")) for _ in range(3)]
        silent = await client.start_workflow(
            "InstanceHealthWorkflow",
            HealthInput(instance_id=unique("i"), group=group),
            id=unique("health-silent"),
            task_queue=settings.temporal.task_queue,
        )
        impaired = ok.pop()
        impaired_id = (await health_of(impaired)).instance_id
        await impaired.signal("gpu_finding", finding(impaired_id, group, "f-1"))

        async with health_gauges(client, [group], meter, interval=timedelta(milliseconds=200)):
            expected = {"OK": 2, "IMPAIRED": 1, "INITIALIZING": 1, "INSUFFICIENT_DATA": 0, "UNMONITORED": 0}
            text = await eventually(
                lambda: scrape(metrics_url(port)),
                lambda t: {s: total(t, INSTANCES, group=group, health_status=s) for s in expected} == expected,
            )
            # Every status has a series, zero included, so an alert on IMPAIRED > 0 has something to read.
            statuses = {x.labels["health_status"] for x in text if x.name == INSTANCES and x.labels["group"] == group}
            assert statuses == set(expected)

            blind = heartbeat((await health_of(ok[0])).instance_id, group).model_copy(
                update={"gpu_health": HealthState.INSUFFICIENT_DATA, "gpu_health_reason": "NVML: driver not loaded"}
            )
            await ok[0].signal("heartbeat", blind)
            expected = {"OK": 1, "IMPAIRED": 1, "INITIALIZING": 1, "INSUFFICIENT_DATA": 1, "UNMONITORED": 0}
            await eventually(
                lambda: scrape(metrics_url(port)),
                lambda t: {s: total(t, INSTANCES, group=group, health_status=s) for s in expected} == expected,
            )
        for handle in [*ok, impaired, silent]:
            await handle.terminate("test over")


def test_reason_labels_stay_few() -> None:
    assert reason_label("XID_79") == "XID_79"
    assert reason_label("SXID_20034") == "SXID_20034"
    assert reason_label("Agent disconnected since 2026-03-01T12:00:00Z") == "AGENT_CONNECTIVITY"
    assert reason_label("something free-form") == "OTHER"
    assert reason_label(None) == "UNKNOWN"


def test_finding_to_impaired_counts_only_the_change_to_impaired() -> None:
    now = datetime(2026, 3, 1, 12, 0, 10, tzinfo=UTC)
    finding = {
        "finding_id": "f-1",
        "instance_id": "i-1",
        "group": "g",
        "kind": "xid",
        "code": 79,
        "reason": "XID_79",
        "impairs": True,
        "observed_at": "2026-03-01T12:00:07.500000Z",
    }

    def event(changed: datetime) -> FleetEvent:
        details = [
            {
                "type": "ACCELERATED_COMPUTE",
                "status": "IMPAIRED",
                "statusReason": "XID_79",
                "lastUpdated": now.isoformat(),
                "lastStatusChange": changed.isoformat().replace("+00:00", "Z"),
            }
        ]
        fields = {"overall_status": "IMPAIRED", "details": details, "finding": finding}
        return FleetEvent(
            event_id="e", time=now, type=EventType.HEALTH_CHANGED, group="g", instance_id="i-1", detail=fields
        )

    assert _finding_to_impaired(event(now)) == 2.5
    # A later change (the agent reconnecting) carries the same finding but is not the change to IMPAIRED.
    assert _finding_to_impaired(event(now - timedelta(minutes=1))) is None
