"""The record every probe source produces and the policy classifies: one GPU fault (or daemon state) seen on
this host."""

from __future__ import annotations

from typing import Any, NamedTuple

from contract.probe import FindingKind

# The kinds are the contract's: what a source records is what the probe sends.
RecordKind = FindingKind


class FaultRecord(NamedTuple):
    """One GPU fault record, from any source: the kernel-log parser, NVML, DCGM or the daemon check, before the
    policy classifies it. `line` is the 1-based number of its first input line (a source's own count elsewhere).

    A NamedTuple rather than a frozen dataclass: as immutable, and several times cheaper to build, which
    counts when a storm logs hundreds of thousands of records."""

    line: int
    raw: str
    kind: RecordKind
    code: int | None
    pci: str | None
    message: str
    kmsg_seq: int | None = None
    # Seconds since boot, when the line carries it (kmsg, dmesg): lets repeat rules measure real spacing even
    # when a restarted probe re-reads old history in one go.
    uptime_s: float | None = None
    # POSIX time of the line, when its prefix carries a wall-clock time (dmesg -T, syslog, ISO stamps); a time
    # without a UTC offset is the host's local time, a syslog time without a year the latest not a day ahead.
    wall_s: float | None = None
    mig_gpu_instance: int | None = None
    mig_compute_instance: int | None = None
    pid: int | None = None
    process_name: str | None = None
    caused_by_xid: int | None = None
    recovery_action_from: str | None = None
    recovery_action_to: str | None = None
    recovery_action_from_code: int | None = None
    recovery_action_to_code: int | None = None
    # Which of NVIDIA's standing verdicts on the GPU the record states (contract.probe.NVIDIA_VERDICTS), and the action
    # it asks for (ACTION_NONE: withdrawn; "": none we take): Xid 154 and NVML's recovery action and flags
    # (classify/verdicts.py). Named apart from the policy's Verdict, which says whether a record impairs.
    nvidia_verdict: str | None = None
    nvidia_action: str | None = None
    rst: bool | None = None
    d_rst: bool | None = None
    nvlink_unit: str | None = None
    nvlink_fatal: bool | None = None
    nvlink_link: int | None = None
    nvswitch: int | None = None
    # The GPU's UUID: set by the NVML, DCGM and daemon sources, and by the kernel-log parser when the log named
    # the GPU at that PCI address before (`NVRM: GPU at PCI:...: GPU-...`, printed before its first Xid).
    uuid: str | None = None
    # Set by the NVML, DCGM and daemon sources (never by the kernel-log parser): the condition's name (the
    # finding's reason, e.g. NVML_REMAP_FAILURE), and the source's own "hard failure" verdict (a DCGM "fail", a
    # daemon marked critical) that the policy turns into impairs.
    reason: str | None = None
    critical: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()
