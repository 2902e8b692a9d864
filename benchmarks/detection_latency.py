"""Part C of the detection benchmark: end-to-end latency on the real stack.

A Temporal dev server, moto, the simulated fleet running the real probe and an in-process worker
(benchmarks.support.local_fleet): kernel line -> IMPAIRED -> RepairStarted -> ReplacementReady -> RepairCompleted,
and heartbeat silence -> AGENT_CONNECTIVITY IMPAIRED, under compressed timings (SimTiming.compressed()).
Run through benchmarks.detection.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.support import check_critical_xids, eventually, local_fleet
from contract.health import HealthState
from simulator.fleet import COMMON_CRITICAL_XIDS

# Faults and silences start at a random moment: the harness's own 0.5 s polling would otherwise lock them to a
# fixed phase of the probe's 0.2 s file poll and 1 s heartbeat, and every sample would see the same wait.
JITTER_S = 1.0


def at(event: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(event["time"])


def seconds(a: datetime, b: datetime) -> float:
    return round((b - a).total_seconds(), 3)


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """min/median/max of seconds (the sample is small: a mean would hide the spread)."""
    if not values:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {"n": len(values), "min": min(values), "median": round(statistics.median(values), 3), "max": max(values)}


async def part_c(faults: int, losses: int) -> dict[str, Any]:
    # The servers' logs and databases, the fleet's kernel logs and spools, the events file: gone afterwards.
    with tempfile.TemporaryDirectory(prefix="detection-bench-") as tmp:
        return await fleet_latency(Path(tmp), faults, losses)


async def fleet_latency(state: Path, faults: int, losses: int) -> dict[str, Any]:
    """Faults one at a time, then heartbeat losses and a blip, on a fleet of faults + losses + 1 instances."""
    check_critical_xids()
    rng = random.Random(17)
    started = time.perf_counter()
    instances = faults + losses + 1  # +1: the blip, which must not impair
    async with local_fleet(state, instances=instances, seed=5) as fleet:
        timing = fleet.timing
        await fleet.all_healthy(instances)
        ready_s = time.perf_counter() - started
        targets = fleet.sim.live_instances()
        rows: list[dict[str, Any]] = []
        # One at a time: with fewer than 9 instances the drain cap is 1, so concurrent faults would measure the
        # queue for the permit, not the repair.
        for n, instance in enumerate(targets[:faults]):
            xid = COMMON_CRITICAL_XIDS[n % len(COMMON_CRITICAL_XIDS)]
            await asyncio.sleep(rng.uniform(0, JITTER_S))
            written = datetime.now(UTC)
            fleet.sim.inject_fault(instance, xid=xid)
            await fleet.repairs_finished(n + 1, within=120)

            def first(kind: str, instance: str = instance) -> dict[str, Any]:
                return min(fleet.events(kind, instance), key=at)

            impaired = min(
                (e for e in fleet.events("HealthChanged", instance) if e["detail"].get("overall_status") == "IMPAIRED"),
                key=at,
            )
            # The finding the event carries was stamped by the probe when it classified the line: it splits
            # the detection into the probe's part (its file poll) and the signal's (RPC + workflow task).
            observed = datetime.fromisoformat(impaired["finding"]["observed_at"])
            rows.append(
                {
                    "instance": instance,
                    "xid": xid,
                    "probe_read_s": seconds(written, observed),
                    "probe_to_impaired_s": seconds(observed, at(impaired)),
                    "impaired_s": seconds(written, at(impaired)),
                    "repair_started_s": seconds(written, at(first("RepairStarted"))),
                    "replacement_launched_s": seconds(written, at(first("ReplacementLaunched"))),
                    "replacement_ready_s": seconds(written, at(first("ReplacementReady"))),
                    "tasks_stopped_s": seconds(written, at(first("TasksStopped"))),
                    "repair_completed_s": seconds(written, at(first("RepairCompleted"))),
                }
            )
        # Heartbeat loss: the probe stops for good; a blip on another instance heals before the threshold.
        lost = targets[faults : faults + losses]
        spare = targets[faults + losses]
        silenced: dict[str, datetime] = {}
        for instance in lost:
            await asyncio.sleep(rng.uniform(0, JITTER_S))
            await fleet.sim.heartbeat_loss(instance)
            silenced[instance] = datetime.now(UTC)
        await fleet.sim.blip(spare)
        threshold = timing.heartbeat_loss_threshold.total_seconds()

        def agent_impaired(instance: str) -> dict[str, Any] | None:
            changes = [
                e
                for e in fleet.events("HealthChanged", instance)
                if any(
                    d.get("type") == "AGENT_CONNECTIVITY" and d.get("status") == "IMPAIRED"
                    for d in e["detail"].get("details", [])
                )
            ]
            return min(changes, key=at) if changes else None

        await eventually(
            lambda: asyncio.sleep(0, [agent_impaired(i) for i in lost]),
            lambda found: all(found),
            within=threshold * 4,
        )
        await asyncio.sleep(max(0.0, threshold + 2 - timing.blip.total_seconds()))
        loss_rows: list[dict[str, Any]] = []
        for instance in lost:
            event = agent_impaired(instance)
            assert event is not None
            detail = next(d for d in event["detail"]["details"] if d["type"] == "AGENT_CONNECTIVITY")
            # "Agent disconnected since <the last heartbeat's time>"
            last_beat = datetime.fromisoformat(detail["statusReason"].rsplit(" ", 1)[-1])
            loss_rows.append(
                {
                    "instance": instance,
                    "probe_stopped_to_impaired_s": seconds(silenced[instance], at(event)),
                    "last_heartbeat_to_impaired_s": seconds(last_beat, at(event)),
                }
            )
        spare_view = await fleet.sim.health(spare)
        blip_ok = {
            "blip_s": timing.blip.total_seconds(),
            "impaired_events": sum(
                e["detail"].get("overall_status") == "IMPAIRED" for e in fleet.events("HealthChanged", spare)
            ),
            "status_after": spare_view.healthStatus.overallStatus.value if spare_view else None,
        }
        healthy_again = spare_view is not None and spare_view.healthStatus.overallStatus is HealthState.OK
    return {
        "timing": {
            "probe_poll_s": timing.probe_poll_interval.total_seconds(),
            "heartbeat_interval_s": timing.heartbeat_interval.total_seconds(),
            "heartbeat_loss_threshold_s": threshold,
            "boot_delay_s": timing.boot_delay.total_seconds(),
            "drain_grace_s": timing.drain_grace.total_seconds(),
            "sim_watch_interval_s": timing.watch_interval.total_seconds(),
            "task_poll_interval_s": fleet.settings.groups[0].task_poll_interval.total_seconds(),
        },
        "instances": instances,
        "stack_ready_s": round(ready_s, 1),
        "faults": rows,
        "fault_summary": {
            key: summary([float(r[key]) for r in rows])
            for key in (
                "probe_read_s",
                "probe_to_impaired_s",
                "impaired_s",
                "repair_started_s",
                "replacement_launched_s",
                "replacement_ready_s",
                "tasks_stopped_s",
                "repair_completed_s",
            )
        },
        "heartbeat_loss": loss_rows,
        "heartbeat_loss_summary": {
            key: summary([float(r[key]) for r in loss_rows])
            for key in ("probe_stopped_to_impaired_s", "last_heartbeat_to_impaired_s")
        },
        "blip": {**blip_ok, "healthy_after": healthy_again},
        "wall_s": round(time.perf_counter() - started, 1),
    }
