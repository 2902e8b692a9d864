"""The detection benchmark's markdown summary of parts A, B and C (the results dict benchmarks.detection builds)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.detection_decision import PREFIXES


def codes(values: Sequence[int], limit: int = 40) -> str:
    if not values:
        return "-"
    text = ", ".join(str(v) for v in values[:limit])
    return text + (f" (+{len(values) - limit} more)" if len(values) > limit else "")


def markdown(results: dict[str, Any]) -> str:
    out: list[str] = []
    a = results["part_a"]
    p = a["parsing"]
    out.append(f"## A. Repair decision per Xid ({a['catalog_codes']} codes, {a['catalog']})\n")
    out.append(
        f"Parsing: {p['parsed_correctly']} of {p['lines']} lines (every code under {len(PREFIXES)} log prefixes) "
        f"came back as one Xid record with the right code and GPU. Reference labels: {a['labels']} "
        f"(H100 or GB200 only: {a['labels_h100_or_gb200']}). Shipped catalog = reference: "
        f"{a['shipped_catalog_matches_reference']}; policy bucket sets = reference: "
        f"{a['policy_bucket_sets_match_reference']}; real `ecs` policy = ECS column on every code: "
        f"{a['ecs_policy_equals_ecs_column']}. {len(a['hardware_codes_described_unused'])} of the hardware-side "
        "codes are described by NVIDIA as 'Unused' (no current driver emits them), hence the second table.\n"
    )
    for scope, title in (
        ("all_codes", "every catalog code"),
        ("h100_or_gb200", "codes NVIDIA lists for H100 or GB200"),
    ):
        out.append(f"\n### Against NVIDIA's immediate bucket, {title}\n")
        out.append("| decision rule | hardware-side caught | misses | false replacements | agreement |")
        out.append("|---|---|---|---|---|")
        for rule in a["rules"]:
            s = rule[scope]
            out.append(
                f"| {rule['rule']} | {s['caught']}/{s['hardware_side']} | {len(s['misses'])}: {codes(s['misses'])} | "
                f"{len(s['false_replacements'])}/{s['application_side']}: {codes(s['false_replacements'])} | "
                f"{s['agreements']}/{s['scored']} |"
            )
    out.append("\n| decision rule | unassigned codes impaired | other buckets (code bucket: impairs) |")
    out.append("|---|---|---|")
    for rule in a["rules"]:
        other = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in rule["other_bucket"].items())
        out.append(
            f"| {rule['rule']} | {len(rule['unassigned_impaired'])}/{rule['unassigned']} "
            f"{codes(rule['unassigned_impaired'])} | {other} |"
        )
    out.append("\n### Records that need more than the code\n")
    out.append("| record | parsed as | `ecs` | `nvidia-catalog` (rule) | naive 'any Xid' |")
    out.append("|---|---|---|---|---|")
    yes = {True: "**replace**", False: "no"}
    for row in a["special_records"]:
        out.append(
            f"| {row['record']} | {', '.join(row['parsed']) or 'nothing'} | {yes[row['ecs']]} | "
            f"{yes[row['nvidia-catalog']]} ({row['nvidia-catalog_rule']}) | {yes[row['any_xid']]} |"
        )
    b = results["part_b"]
    out.append("\n## B. Faults written while the probe was stopped\n")
    out.append(
        "| input | downtime faults delivered after restart | delivered twice | pre-stop faults re-delivered | "
        "after-restart faults | restart -> all delivered | tail-from-end baseline sees |"
    )
    out.append("|---|---|---|---|---|---|---|")
    for name, row in b.items():
        if not isinstance(row, dict) or "downtime_delivered" not in row:
            continue
        out.append(
            f"| {name} | {row['downtime_delivered']}/{row['during_stop']} | {row['downtime_delivered_twice']} | "
            f"{row['pre_stop_redelivered']}/{row['before_stop']} (same ids: {row['duplicate_ids_all_same_line']}) | "
            f"{row['after_restart_delivered']}/{row['after_restart']} | "
            f"{row['restart_to_all_downtime_delivered_ms']} ms | "
            f"{row['tail_baseline_downtime_seen']}/{row['during_stop']} downtime, "
            f"{row['tail_baseline_after_restart_seen']}/{row['after_restart']} after |"
        )
    mid = b.get("stopped mid-delivery, spool dir")
    if mid:
        out.append(
            f"\nStopped mid-delivery (50 ms per signal): {mid['delivered_before_stop']} of {mid['faults']} delivered "
            f"before the stop, {mid['waiting_in_spool_at_stop']} waiting in the spool; after the restart "
            f"{mid['delivered_after_restart']} more; {mid['delivered']}/{mid['faults']} delivered in all, "
            f"{mid['delivered_twice']} twice."
        )
    for name, row in b.items():
        if isinstance(row, dict) and "rotation" in row:
            out.append(
                f"\n{name}, spool dir (cursor): of the faults written while it was stopped, "
                f"{row['delivered_before_rotation']}/{row['written_before_rotation']} written before the rotation and "
                f"{row['delivered_after_rotation']}/{row['written_after_rotation']} written after it were delivered "
                f"after the restart ({row['pre_stop_redelivered']} pre-stop faults re-delivered)."
            )
    kill = b.get("SIGKILL mid-delivery, spool dir")
    if kill:
        out.append(
            f"\nSIGKILL mid-delivery (probe in a child process, 20 ms per signal): {kill['delivered_at_kill']} of "
            f"{kill['before_kill']} delivered when killed, {kill['during_stop']} more written while dead; after the "
            f"restart {kill['delivered']}/{kill['faults']} delivered in all, {kill['delivered_twice']} twice "
            f"(same finding id each time: {kill['duplicates_have_same_id']})."
        )
    if "kmsg_skipped" in b:
        out.append(f"\nkmsg cases skipped: {b['kmsg_skipped']}.")
    c = results.get("part_c")
    if c:
        t = c["timing"]
        out.append("\n## C. End to end on the real stack (compressed test timings)\n")
        out.append(
            f"{c['instances']} simulated instances; probe poll {t['probe_poll_s']} s, heartbeat every "
            f"{t['heartbeat_interval_s']} s, loss threshold {t['heartbeat_loss_threshold_s']} s, boot delay "
            f"{t['boot_delay_s']} s, drain grace {t['drain_grace_s']} s, task poll {t['task_poll_interval_s']} s. "
            f"Stack ready in {c['stack_ready_s']} s; whole part {c['wall_s']} s.\n"
        )
        out.append("| from the kernel line written to | n | min s | median s | max s |")
        out.append("|---|---|---|---|---|")
        names = {
            "probe_read_s": "the probe classified it (the finding's observed_at)",
            "impaired_s": "HealthChanged IMPAIRED",
            "repair_started_s": "RepairStarted",
            "replacement_launched_s": "ReplacementLaunched",
            "replacement_ready_s": "ReplacementReady (registered ACTIVE in ECS)",
            "tasks_stopped_s": "TasksStopped (drain and stop timeouts)",
            "repair_completed_s": "RepairCompleted",
        }
        for key, label in names.items():
            s = c["fault_summary"][key]
            out.append(f"| {label} | {s['n']} | {s['min']} | {s['median']} | {s['max']} |")
        s = c["fault_summary"]["probe_to_impaired_s"]
        out.append(
            f"| (probe classified -> IMPAIRED: signal + workflow task) | {s['n']} | {s['min']} | {s['median']} |"
            f" {s['max']} |"
        )
        out.append("\n| heartbeat loss | n | min s | median s | max s |")
        out.append("|---|---|---|---|---|")
        for key, label in (
            ("probe_stopped_to_impaired_s", "probe stopped -> AGENT_CONNECTIVITY IMPAIRED"),
            ("last_heartbeat_to_impaired_s", "last heartbeat -> AGENT_CONNECTIVITY IMPAIRED"),
        ):
            s = c["heartbeat_loss_summary"][key]
            out.append(f"| {label} | {s['n']} | {s['min']} | {s['median']} | {s['max']} |")
        blip = c["blip"]
        out.append(
            f"\nA {blip['blip_s']} s blip on another instance: {blip['impaired_events']} IMPAIRED events, "
            f"status afterwards {blip['status_after']}."
        )
    return "\n".join(out)
