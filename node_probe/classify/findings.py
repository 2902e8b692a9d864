"""Turn a parsed record and its verdict into the `GpuFinding` the health workflow receives.

A finding id is a hash of where the record sits in its source and of its raw text, so a probe that restarts
and re-reads the same log sends the same ids and the workflow drops them as redeliveries.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime

from contract.probe import GpuFinding, GpuRef
from node_probe.classify.catalog import default_catalog
from node_probe.classify.policy import Verdict
from node_probe.classify.record import FaultRecord

# Signals are stored in workflow history: cap what a pathological line can put there.
MAX_RAW_CHARS = 4096
MAX_MESSAGE_CHARS = 1024

# "GPU has fallen off the bus" is what Xid 79 reports: the same condition, and the same action.
FALLEN_OFF_THE_BUS_XID = 79
# Its catalog bucket (XID_154) names the Xid, not an action: the action is the one its line announces.
RECOVERY_ACTION_XID = 154

DedupeKey = tuple[str, str | None, int | None, int | None, bool, str | None]


def record_position(record: FaultRecord) -> str:
    """Where the record sits in its source: kmsg's sequence number when there is one, else its line number."""
    return f"seq:{record.kmsg_seq}" if record.kmsg_seq is not None else f"line:{record.line}"


def finding_id(source: str, position: str, raw: str) -> str:
    digest = hashlib.sha256(f"{source}\n{position}\n{raw}".encode("utf-8", "replace"))
    return digest.hexdigest()[:32]


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def make_finding(
    record: FaultRecord,
    verdict: Verdict,
    *,
    instance_id: str,
    group: str,
    source: str,
    observed_at: datetime,
    position: str | None = None,
    context: Sequence[str] = (),
) -> GpuFinding:
    """`position` overrides `record_position(record)` where the source knows more (the file generation)."""
    return GpuFinding(
        finding_id=finding_id(source, position or record_position(record), record.raw),
        instance_id=instance_id,
        group=group,
        kind=record.kind,
        code=record.code,
        reason=verdict.reason,
        impairs=verdict.impairs,
        rule=verdict.rule,
        source=source,
        immediate_action=immediate_action(record),
        verdict=record.nvidia_verdict or "",
        gpu=GpuRef(
            pci=record.pci,
            uuid=record.uuid,
            mig_gpu_instance=record.mig_gpu_instance,
            mig_compute_instance=record.mig_compute_instance,
        ),
        message=_clip(record.message, MAX_MESSAGE_CHARS),
        raw=_clip(record.raw, MAX_RAW_CHARS),
        context=list(context),
        observed_at=observed_at,
    )


def immediate_action(record: FaultRecord) -> str:
    """NVIDIA's immediate action for the record: the action of the verdict it states (Xid 154's recovery action,
    NVML's; see classify/verdicts.py), else its Xid's resolution bucket in the catalog; a GPU fallen off the bus
    without an Xid line is Xid 79's (RESTART_BM). Anything else names none: no reboot is known to clear it, and
    neither does an Xid 154 whose action is not known (NVML's Xid event carries the code alone)."""
    if record.nvidia_verdict is not None:
        return record.nvidia_action or ""
    if record.kind == "gpu_fallen_off_bus":
        code: int | None = FALLEN_OFF_THE_BUS_XID
    elif record.kind == "xid" and record.code != RECOVERY_ACTION_XID:
        code = record.code
    else:
        return ""
    info = default_catalog().get(code) if code is not None else None
    return info.immediate_bucket if info is not None else ""


def stating(finding: GpuFinding, record: FaultRecord) -> GpuFinding:
    """`finding`, stating the verdict `record` states: one fault's finding that another copy of it stated NVIDIA's
    verdict on (classify/correlate.py), so that what the copy said reaches the health workflow."""
    return finding.model_copy(
        update={"verdict": record.nvidia_verdict or "", "immediate_action": immediate_action(record)}
    )


def dedupe_key(record: FaultRecord, verdict: Verdict) -> DedupeKey:
    """Same reason on the same GPU is one burst. `impairs` is part of the key so that a repeat rule firing on
    the third Xid 13 is not swallowed by the burst the first two (warnings) opened, and the action NVIDIA's verdict
    asks for so that an Xid 154 back to None (ACTION_NONE) is not swallowed by the one that set the action, which
    the health workflow would then hold on to. The GPU is its PCI address when known (so NVML and kernel-log
    records of one fault collapse together), else its UUID."""
    gpu = record.pci or record.uuid
    return (
        verdict.reason,
        gpu,
        record.mig_gpu_instance,
        record.mig_compute_instance,
        verdict.impairs,
        record.nvidia_action,
    )


def burst_rollup(first: GpuFinding, last: GpuFinding, suppressed: int, observed_at: datetime) -> GpuFinding:
    """One finding for the records a burst suppressed; its count is only those (the first went out alone)."""
    return last.model_copy(
        update={
            "finding_id": hashlib.sha256(f"{first.finding_id}\nburst\n{last.finding_id}".encode()).hexdigest()[:32],
            "count": suppressed,
            "observed_at": observed_at,
        }
    )
