"""What benchmarks.temporal_actions measured, attributed and extrapolated: actions per healthy instance-month for
each design and group size, the per-group and per-instance parts, and the actions of one repair; then a markdown
summary."""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from benchmarks.temporal_actions_count import Action, Execution, Growth, between, tally, tally_detail
from benchmarks.temporal_actions_old import old_model
from contract import names
from contract.groups import CapacityGroup
from contract.ids import repair_instance_of
from workflows.holder_watch import next_look
from workflows.options import heartbeat_every
from workflows.repair_replacement import ready_heartbeat_timeout
from workflows.repair_tasks import drain_heartbeat_timeout

MONTH_S = 30 * 24 * 3600
GOAL = 1_000  # actions per healthy instance-month (issue 11)
SIGNALS_PER_RUN = 2_000  # the health workflow's and the tracker's own continue-as-new limit
# What a new run of a healthy instance's workflows costs besides its start: the tracker re-arms its timer; a health
# workflow re-reads its group (an activity), and the old one also re-armed its deadline timer.
RUN_COST = {"tracker": 2, "health": 2, "health (old)": 3}
# Real-time durations for the parts of a repair that scale with time (the compressed run's are seconds).
REAL_BOOT_S = 600  # launch -> replacement ACTIVE in ECS (a p5 boots and registers in about 5-15 min)
REAL_DRAIN_S = 120  # the impaired instance's tasks stopping
REAL_TASK_POLL_S = 15  # task_poll_interval default
REAL_RECLAIM_S = 60  # permit_reclaim_interval default
REAL_READY_TIMEOUT = CapacityGroup.model_fields["replacement_ready_timeout"].default
HEARTBEAT_EVERY_S = heartbeat_every(ready_heartbeat_timeout(REAL_READY_TIMEOUT)).total_seconds()
DRAIN_HEARTBEAT_EVERY_S = heartbeat_every(drain_heartbeat_timeout(timedelta(seconds=REAL_TASK_POLL_S))).total_seconds()

CATEGORIES = (
    "batches to tracker",
    "heartbeats to health wf",
    "tracker -> health wf",
    "timers",
    "activities",
    "upserts",
    "starts",
    "queries",
    "other",
)


@dataclass
class Measured:
    compress: float
    heartbeat_s: float
    threshold_s: float
    t0: datetime
    t1: datetime
    fleets: list[dict[str, Any]]
    repair: dict[str, Any]
    executions: list[Execution]
    queries: list[Action]
    heartbeats: list[Action]
    relays: dict[str, Any]


def category(action: Action) -> str:
    kind, detail = action.kind, action.detail
    if kind.startswith("signal"):
        if detail == names.SIGNAL_LIVENESS_REPORT:
            return "batches to tracker"
        if detail == names.SIGNAL_HEARTBEAT:
            return "heartbeats to health wf"
        if detail == names.SIGNAL_LIVENESS:
            return "tracker -> health wf"
        return "other"
    if kind == "timer":
        return "timers"
    if kind.startswith("activity") and kind != "activity heartbeat":
        return "activities"
    if kind == "search-attribute upsert":
        return "upserts"
    if kind.startswith("start"):
        return "starts"
    if kind.startswith("query"):
        return "queries"
    return "other"


def by_category(actions: list[Action], scale: float = 1.0) -> dict[str, float]:
    counts: Counter[str] = Counter()
    for action in actions:
        counts[category(action)] += action.n
    return {name: counts[name] * scale for name in CATEGORIES}


def _runs(measured: Measured, ids: set[str]) -> list[Execution]:
    return [run for run in measured.executions if run.workflow_id in ids]


def _actions(runs: list[Execution], extra: list[Action], ids: set[str]) -> list[Action]:
    return [a for run in runs for a in run.actions] + [a for a in extra if a.workflow_id in ids]


def healthy_fleet(measured: Measured, fleet: dict[str, Any]) -> dict[str, Any]:
    """One group's hour: per group and per instance, by category, extrapolated to a month; and what happened once."""
    t0, t1 = measured.t0, measured.t1
    n = len(fleet["instances"])
    old = fleet["design"] == "old"
    tracker_id = f"liveness/{fleet['group']}"
    health_ids = {f"health/{i}" for i in fleet["instances"]}
    extra = measured.queries + measured.heartbeats
    tracker_runs, health_runs = _runs(measured, {tracker_id}), _runs(measured, health_ids)
    tracker_all = _actions(tracker_runs, extra, {tracker_id})
    health_all = _actions(health_runs, extra, health_ids)
    window_s = (t1 - t0).total_seconds()
    scale = MONTH_S / (window_s * measured.compress)
    tracker_hour, health_hour = between(tracker_all, t0, t1), between(health_all, t0, t1)
    measured_cans = sum(a.n for a in tracker_hour + health_hour if a.kind == "start (continue-as-new)")
    # Continue-as-new is modelled from how fast the histories grow (no run grows to Temporal's suggestion in an
    # hour), so the rare one seen in the window is left out of the extrapolation.
    tracker_hour = [a for a in tracker_hour if a.kind != "start (continue-as-new)"]
    health_hour = [a for a in health_hour if a.kind != "start (continue-as-new)"]
    tracker_growth, health_growth = Growth(), Growth()
    for run in tracker_runs:
        tracker_growth.add(run, t0, t1)
    for run in health_runs:
        health_growth.add(run, t0, t1)
    tracker_runs_month = tracker_growth.runs_per(scale, SIGNALS_PER_RUN) if tracker_runs else 0.0
    health_runs_month = health_growth.runs_per(scale, SIGNALS_PER_RUN) / n  # per instance
    group_month = by_category(tracker_hour, scale)
    group_month["starts"] += RUN_COST["tracker"] * tracker_runs_month  # start + timer, booked under starts
    instance_month = by_category(health_hour, scale / n)
    instance_month["starts"] += RUN_COST["health (old)" if old else "health"] * health_runs_month
    if fleet["design"] == "probe direct":
        # Each probe is its own reporter: its batches grow with the group, they are the instance's part.
        instance_month["batches to tracker"] += group_month["batches to tracker"] / n
        group_month["batches to tracker"] = 0.0
    per_instance = {k: group_month[k] / n + instance_month[k] for k in CATEGORIES}
    # Once: what happened before the hour, less what the steady rate accounts for in that time (the old design's
    # heartbeats and deadlines went on during the warm-up).
    first = min((run.events[0][0] for run in health_runs + tracker_runs if run.events), default=t0)
    before_s = (t0 - first).total_seconds()
    once_health = net_once([a for a in health_all if a.at < t0], health_hour, before_s / window_s, n)
    once_tracker = net_once([a for a in tracker_all if a.at < t0], tracker_hour, before_s / window_s, 1)
    lost = sum(1 for a in tracker_hour + health_hour if category(a) == "tracker -> health wf")
    lost += sum(1 for a in tracker_hour if a.kind == "signal to a closed workflow")
    return {
        "label": fleet["label"],
        "design": fleet["design"],
        "batch_gaps_s": gaps([a for a in tracker_hour if category(a) == "batches to tracker"], measured.compress),
        "timer_gaps_s": gaps([a for a in tracker_hour if a.kind == "timer"], measured.compress),
        "instances": n,
        "window_s": window_s,
        "scale_to_month": scale,
        "hour": {
            "tracker": dict(tally_detail(tracker_hour)),
            "health_workflows": dict(tally_detail(health_hour)),
        },
        "group_month": group_month,
        "group_month_total": sum(group_month.values()),
        "instance_part_month": instance_month,
        "instance_part_month_total": sum(instance_month.values()),
        "per_instance_month": per_instance,
        "per_instance_month_total": sum(per_instance.values()),
        "continue_as_new": {
            "tracker_runs_per_month": tracker_runs_month,
            "health_runs_per_instance_month": health_runs_month,
            "tracker_growth_per_hour": vars(tracker_growth),
            "health_growth_per_instance_hour": {k: v / n for k, v in vars(health_growth).items()},
            "seen_in_window": measured_cans,
        },
        "warmup_s": before_s,
        "once_per_instance": once_health["categories"],
        "once_per_instance_detail": once_health["detail"],
        "once_per_group": once_tracker["detail"],
        "losses_signalled": lost,
    }


def gaps(actions: list[Action], compress: float) -> dict[str, float] | None:
    """min / median / max seconds between consecutive actions, in simulated (production) seconds."""
    times = sorted(a.at for a in actions)
    between_s = [(b - a).total_seconds() * compress for a, b in itertools.pairwise(times)]
    if not between_s:
        return None
    return {"min": min(between_s), "median": statistics.median(between_s), "max": max(between_s)}


def net_once(before: list[Action], steady: list[Action], ratio: float, per: int) -> dict[str, dict[str, float]]:
    """Actions before the hour less `ratio` times the hour's (the warm-up lasted `ratio` hours), per `per`."""

    def net(pre: dict[str, float], rate: dict[str, float]) -> dict[str, float]:
        keys = [k for k in pre if pre[k] - ratio * rate.get(k, 0) > 0.5]
        return {k: round((pre[k] - ratio * rate.get(k, 0)) / per, 2) for k in keys}

    return {
        "categories": {c: net(by_category(before), by_category(steady)).get(c, 0.0) for c in CATEGORIES},
        "detail": net(dict(tally_detail(before)), dict(tally_detail(steady))),
    }


def repair_cost(measured: Measured) -> dict[str, Any]:
    """Everything one repair caused, by the workflow it is in; the replacement's own start apart."""
    info = measured.repair
    group, faulty = info["group"], info["faulty"]
    start, end = datetime.fromisoformat(info["fault_at"]), datetime.fromisoformat(info["end"])
    extra = measured.queries + measured.heartbeats
    # Every attempt at repairing it (repair/<instance>/<n>, or a legacy repair/<instance>): contract/ids.py.
    repair_ids = {run.workflow_id for run in measured.executions if repair_instance_of(run.workflow_id) == faulty}
    semaphore_ids = {f"drain-semaphore/{group}"}
    health_ids = {f"health/{faulty}"}
    tracker_ids = {f"liveness/{group}"}
    # The replacement is the one instance nobody started with: only the repair launches instances.
    known = {i for fleet in measured.fleets for i in fleet["instances"]} | set(info["instances"])
    replacements = {
        run.workflow_id
        for run in measured.executions
        if run.workflow_type == names.HEALTH_WORKFLOW and run.workflow_id.removeprefix("health/") not in known
    }
    parts: dict[str, list[Action]] = {
        "repair workflow": _actions(_runs(measured, repair_ids), extra, repair_ids),
        "drain semaphore": between(_actions(_runs(measured, semaphore_ids), extra, semaphore_ids), start, end),
        "impaired instance's health workflow": between(
            _actions(_runs(measured, health_ids), extra, health_ids), start, end
        ),
        "tracker: loss of the terminated instance": [
            a
            for a in between(_actions(_runs(measured, tracker_ids), extra, tracker_ids), start, end)
            if a.kind == "signal to a closed workflow" or category(a) == "tracker -> health wf"
        ],
    }
    replacement = _actions(_runs(measured, replacements), extra, replacements)
    tracker_window = between(_actions(_runs(measured, tracker_ids), extra, tracker_ids), start, end)
    rows = {name: dict(tally_detail(actions)) for name, actions in parts.items()}
    totals = {name: sum(a.n for a in actions) for name, actions in parts.items()}
    total = sum(totals.values())
    # The parts that grow with time: at production timings instead of the compressed run's seconds.
    repair_actions = parts["repair workflow"]
    sem_actions = parts["drain semaphore"]
    timed = {
        "semaphore reclaim checks (timer + activity)": sum(
            a.n for a in sem_actions if a.kind == "timer" or a.detail == "find_closed_workflows"
        ),
        "drain waits (wait_for_tasks_to_stop and its heartbeats)": sum(
            a.n for a in repair_actions if (a.detail or "").startswith("wait_for_tasks_to_stop")
        ),
        "replacement wait heartbeats": sum(
            a.n
            for a in repair_actions
            if a.kind == "activity heartbeat" and (a.detail or "").startswith("await_container_instance_active")
        ),
    }
    hold_s = REAL_BOOT_S + REAL_DRAIN_S + 60
    reclaim = timedelta(seconds=REAL_RECLAIM_S)
    idle_look = next_look(holders=1, waiters=0, out_of_service=0, reclaim_interval=reclaim)
    idle_look_s = (idle_look or reclaim).total_seconds()
    real_timed = {
        # One repair alone: nobody waits behind its permit.
        "semaphore reclaim checks (timer + activity)": 2 * math.ceil(hold_s / idle_look_s),
        # One wait per stop timeout passed (one here: every task gets the same), and its throttled heartbeats.
        "drain waits (wait_for_tasks_to_stop and its heartbeats)": 1
        + math.ceil(REAL_DRAIN_S / DRAIN_HEARTBEAT_EVERY_S),
        "replacement wait heartbeats": 1 + math.ceil(REAL_BOOT_S / HEARTBEAT_EVERY_S),
    }
    return {
        "faulty": faulty,
        "repaired": info["repaired"],
        "window_s": (end - start).total_seconds(),
        "parts": rows,
        "part_totals": totals,
        "total": total,
        "replacement_start": dict(tally_detail(replacement)),
        "replacement_start_total": sum(a.n for a in replacement),
        "tracker_window_baseline": dict(tally(tracker_window)),
        "time_dependent_measured": timed,
        "time_dependent_real": real_timed,
        "real_estimate": total - sum(timed.values()) + sum(real_timed.values()),
        "real_assumptions": {
            "boot_and_register_s": REAL_BOOT_S,
            "drain_s": REAL_DRAIN_S,
            "task_poll_interval_s": REAL_TASK_POLL_S,
            "permit_reclaim_interval_s": REAL_RECLAIM_S,
            "heartbeat_every_s": HEARTBEAT_EVERY_S,
            "drain_heartbeat_every_s": DRAIN_HEARTBEAT_EVERY_S,
        },
    }


def analyse(measured: Measured) -> dict[str, Any]:
    fleets = [healthy_fleet(measured, fleet) for fleet in measured.fleets]
    results: dict[str, Any] = {
        "compress": measured.compress,
        "heartbeat_interval_s": measured.heartbeat_s * measured.compress,
        "heartbeat_loss_threshold_s": measured.threshold_s * measured.compress,
        "simulated_hour_wall_s": (measured.t1 - measured.t0).total_seconds(),
        "fleets": fleets,
        "repair": repair_cost(measured),
        "relays": measured.relays,
        "harness_queries": sum(1 for a in measured.queries if a.kind == "query (harness)"),
    }
    ingest = [f for f in fleets if f["design"] == "ingest"]
    if ingest:
        # The group's part does not depend on its size: the mean over the sizes run; the instance's part likewise.
        fixed = sum(f["group_month_total"] for f in ingest) / len(ingest)
        per = sum(f["instance_part_month_total"] for f in ingest) / len(ingest)
        results["formula"] = {
            "group_fixed_month": fixed,
            "per_instance_month": per,
            "goal": GOAL,
            "group_size_for_goal": math.ceil(fixed / (GOAL - per)) if per < GOAL else None,
        }
        # The same from the median spacing of batches and timers: a count in a window of a few hours is off by up
        # to one batch and one timer (±6 % at 2 h); the spacing is not.
        spaced = [f for f in ingest if f["batch_gaps_s"] and f["timer_gaps_s"]]
        if spaced:
            batch_s = statistics.median(f["batch_gaps_s"]["median"] for f in spaced)
            timer_s = statistics.median(f["timer_gaps_s"]["median"] for f in spaced)
            cans = statistics.mean(f["continue_as_new"]["tracker_runs_per_month"] for f in spaced)
            by_gaps = MONTH_S / batch_s + MONTH_S / timer_s + RUN_COST["tracker"] * cans
            results["formula"]["from_spacing"] = {
                "batch_every_s": batch_s,
                "timer_every_s": timer_s,
                "group_fixed_month": by_gaps,
                "group_size_for_goal": math.ceil(by_gaps / (GOAL - per)) if per < GOAL else None,
            }
    old = next((f for f in fleets if f["design"] == "old"), None)
    hour_events = old["continue_as_new"]["health_growth_per_instance_hour"]["events"] if old else None
    scale_h = measured.compress * (measured.t1 - measured.t0).total_seconds() / 3600
    model = old_model(
        results["heartbeat_loss_threshold_s"],
        results["heartbeat_interval_s"],
        None if hour_events is None else hour_events / scale_h,
    )
    results["old_model"] = {**vars(model), "total": model.total, "total_with_queries": model.total_with_queries}
    return results


# --- markdown ---------------------------------------------------------------------------------------------------


def _n(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 10 or value == 0 else f"{value:,.1f}"


def markdown(results: dict[str, Any]) -> str:
    hb, th = results["heartbeat_interval_s"], results["heartbeat_loss_threshold_s"]
    lines = [
        f"Settings: heartbeat_interval {hb:g} s, heartbeat_loss_threshold {th:g} s, compressed {results['compress']:g}x"
        f" (simulated hour = {results['simulated_hour_wall_s']:.1f} s of wall time); month = 720 h.",
        "",
        "### Actions per healthy instance-month",
        "",
        "| design, group | "
        + " | ".join(CATEGORIES)
        + " | **total** | per group-month | 1,000 met from N (this per-group cost) |",
        "|---|" + "---:|" * (len(CATEGORIES) + 3),
    ]
    for fleet in results["fleets"]:
        row = fleet["per_instance_month"]
        cells = " | ".join(_n(row[c]) for c in CATEGORIES)
        part = fleet["instance_part_month_total"]
        goal = f"{math.ceil(fleet['group_month_total'] / (GOAL - part))}" if part < GOAL else "never"
        lines.append(
            f"| {fleet['label']} | {cells} | **{_n(fleet['per_instance_month_total'])}** "
            f"| {_n(fleet['group_month_total'])} | {goal} |"
        )
    lines += ["", "### Once per instance lifetime (start, first heartbeat, first reads)", ""]
    lines += ["| design, group | " + " | ".join(CATEGORIES) + " | total |", "|---|" + "---:|" * (len(CATEGORIES) + 1)]
    for fleet in results["fleets"]:
        once = fleet["once_per_instance"]
        cells = " | ".join(_n(once[c]) for c in CATEGORIES)
        lines.append(f"| {fleet['label']} | {cells} | {_n(sum(once.values()))} |")
    formula = results.get("formula")
    if formula:
        lines += [
            "",
            "### Formula (ingest, one replica)",
            "",
            f"actions per healthy instance-month = {_n(formula['group_fixed_month'])} / N + "
            f"{formula['per_instance_month']:.1f}; the goal of {formula['goal']:,} is met from N = "
            f"{formula['group_size_for_goal']} instances per group.",
        ]
        spacing = formula.get("from_spacing")
        if spacing:
            lines.append(
                f"From the median spacing instead (a batch every {spacing['batch_every_s']:.0f} s, a tracker timer "
                f"every {spacing['timer_every_s']:.0f} s): {_n(spacing['group_fixed_month'])} / N; met from N = "
                f"{spacing['group_size_for_goal']}."
            )
    old = results["old_model"]
    lines += [
        "",
        "### Old design modelled from its rules (per instance-month)",
        "",
        f"signals {_n(old['signals'])} + timers {_n(old['timers'])} + activities {_n(old['activities'])} + "
        f"continue-as-new {_n(old['continue_as_new'])} = **{_n(old['total'])}**"
        f" (+ {_n(old['queries_if_semaphore_runs'])} queries once the group's drain semaphore runs)",
    ]
    lines += ["", "### Continue-as-new (modelled from history growth in the hour)", ""]
    for fleet in results["fleets"]:
        can = fleet["continue_as_new"]
        lines.append(
            f"- {fleet['label']}: tracker {can['tracker_runs_per_month']:.1f} runs/month "
            f"(growth per hour {can['tracker_growth_per_hour']}), health workflow "
            f"{can['health_runs_per_instance_month']:.2f} runs per instance-month; seen in the window: "
            f"{can['seen_in_window']}; loss/recovery signals in the hour: {fleet['losses_signalled']}"
        )
    lines += ["", "### Seconds between batches, and between tracker timers (simulated; min / median / max)", ""]
    for fleet in results["fleets"]:
        spans = [fleet["batch_gaps_s"], fleet["timer_gaps_s"]]
        text = ["-" if g is None else f"{g['min']:.0f} / {g['median']:.0f} / {g['max']:.0f}" for g in spans]
        lines.append(f"- {fleet['label']}: batches {text[0]}; timers {text[1]}")
    repair = results["repair"]
    lines += ["", "### One repair", "", "| part | actions | by kind |", "|---|---:|---|"]
    for name, detail in repair["parts"].items():
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(detail.items()))
        lines.append(f"| {name} | {repair['part_totals'][name]} | {kinds} |")
    lines.append(f"| **total** | **{repair['total']}** | |")
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(repair["replacement_start"].items()))
    lines += [
        "",
        f"The replacement's own start (as any new instance's): {repair['replacement_start_total']} ({kinds}).",
        f"Time-dependent parts measured (compressed): {repair['time_dependent_measured']}; at production timings "
        f"({repair['real_assumptions']}): {repair['time_dependent_real']}, so about **{repair['real_estimate']}** "
        "actions per repair in real time.",
        "",
        "### Raw hour (window actions by kind and detail)",
        "",
    ]
    for fleet in results["fleets"]:
        hour = fleet["hour"]
        lines.append(f"- {fleet['label']}: tracker {hour['tracker']}; health workflows {hour['health_workflows']}")
    lines += ["", f"Relay counters (batches, heartbeats forwarded) at t0 / t1: {results['relays']}"]
    lines.append(f"Queries the harness made: {results['harness_queries']}; wall time {results.get('wall_s')} s")
    load = results.get("load_average", {})
    lines.append(f"Load average (1, 5, 15 min) at the start and the end of the hour: {load}")
    return "\n".join(lines)
