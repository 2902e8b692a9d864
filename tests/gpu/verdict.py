"""What a run of tests/gpu/check_real_gpu.py means: the judgement half, pure functions over what the run recorded.

Each step's record goes through one function here and comes back as lists of lines: `failed` (the check itself did
not do what it must, e.g. the fault never happened), `needs_look` (the GPU or the probe showed something a person
should look at: NVIDIA's own verdicts say the GPU needs something done, NVML reported a condition at rest, a user's
fault was missed or impaired the instance) and `notes` (worth knowing, never a concern: a call this GPU or driver
does not offer, a link trained down at idle). exit_status turns the lists into the run's result. Takes only the
recorded JSON (the readings of tests/gpu/nvml_readings.py, the probe's findings as dicts), so a recorded run can be
judged again in the unit tests; imports nothing of ours.
"""

from __future__ import annotations

from typing import Any

# Application faults (NVIDIA's catalog: RESTART_APP / IGNORE): the probe must report them, and none may impair.
USER_FAULT_REASONS = frozenset({"XID_13", "XID_31", "XID_43"})
# Clock event reasons that mean the hardware is slowing the GPU down (not idle, not an application's clocks).
SLOWDOWN_BITS = {0x8: "HW slowdown", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown", 0x80: "HW power brake"}
# A call that raised one of these tells that the GPU or driver does not offer it: a note, not a concern.
NOT_OFFERED = frozenset(
    {
        "NVMLError_NotSupported",
        "NVMLError_FunctionNotFound",
        "NVMLError_NoPermission",
        "NVMLError_InvalidArgument",
        "NVMLError_ArgumentVersionMismatch",
        "AttributeError",
    }
)
# A poll of the NVML source on a healthy GPU finds nothing: what a poll that found something says, by when it ran.
POLL_FOUND = {
    "before": "the first poll found {} condition(s) on a GPU at rest",
    "after": "the poll after the run found {} condition(s)",
}


def _value(entry: Any) -> Any:
    return entry.get("value") if isinstance(entry, dict) else None


def raw_concerns(raw: dict[str, Any], label: str) -> tuple[list[str], list[str]]:
    """(concerns, notes) from one raw reading: a concern is NVIDIA saying the GPU needs something done."""
    concerns: list[str] = []
    notes: list[str] = []
    for key in ("nvmlInit", "device_count"):
        entry = raw.get(key)
        if isinstance(entry, dict) and "error" in entry:
            concerns.append(f"{label}: {entry['call']} raised {entry['error']['class']}")
    count = _value(raw.get("device_count"))
    smi = raw.get("nvidia_smi_L") or {}
    if isinstance(count, int) and isinstance(smi.get("gpu_lines"), int) and smi["gpu_lines"] != count:
        concerns.append(f"{label}: nvmlDeviceGetCount says {count} GPUs, nvidia-smi -L lists {smi['gpu_lines']}")
    for gpu in raw.get("gpus") or []:
        where = f"{label}: GPU {gpu.get('index')}"
        if "error" in gpu:
            concerns.append(f"{where}: reading failed: {gpu['error']['class']}")
            continue
        for entry in gpu.values():
            if isinstance(entry, dict) and "error" in entry and "call" in entry:
                cls = entry["error"]["class"]
                (notes if cls in NOT_OFFERED else concerns).append(f"{where}: {entry['call']} raised {cls}")
        for field in _value(gpu.get("recovery_action")) or []:
            if field.get("nvmlReturn", 0) != 0:
                notes.append(f"{where}: recovery action field answered nvmlReturn {field.get('nvmlReturn')}")
            elif field.get("decoded") not in (0, None):
                concerns.append(f"{where}: GPU recovery action is {field['decoded']} (0 = none)")
        sram = (_value(gpu.get("sram_ecc_error_status")) or {}).get("struct") or {}
        if sram.get("bThresholdExceeded"):
            concerns.append(f"{where}: SRAM ECC error threshold exceeded")
        uncorrected = {k: v for k, v in sram.items() if "Unc" in k and isinstance(v, int) and v and "Bucket" not in k}
        if uncorrected:
            concerns.append(f"{where}: uncorrectable SRAM ECC errors {uncorrected}")
        if sram.get("volatileCor") or sram.get("aggregateCor"):
            notes.append(f"{where}: corrected SRAM ECC errors (volatile {sram.get('volatileCor')}, "
                         f"aggregate {sram.get('aggregateCor')})")  # fmt: skip
        repair = _value(gpu.get("repair_status"))
        if isinstance(repair, list) and any(repair):
            concerns.append(f"{where}: repair pending (channel, TPC) = {repair}")
        if _value(gpu.get("unrepairable_memory")):
            concerns.append(f"{where}: unrepairable memory flagged")
        rows = _value(gpu.get("remapped_rows"))
        if isinstance(rows, list) and len(rows) == 4:
            corr, unc, pending, failure = rows
            if unc or pending or failure:
                concerns.append(f"{where}: remapped rows uncorrectable {unc}, pending {pending}, failure {failure}")
            elif corr:
                notes.append(f"{where}: {corr} rows remapped for correctable errors")
        if _value(gpu.get("retired_pages_pending")):
            concerns.append(f"{where}: retired pages pending")
        for key in ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate"):
            if _value(gpu.get(key)):
                concerns.append(f"{where}: {key} = {_value(gpu.get(key))}")
        reasons = _value(gpu.get("clocks_event_reasons"))
        if not isinstance(reasons, int):
            reasons = _value(gpu.get("clocks_throttle_reasons"))
        if isinstance(reasons, int):
            slow = [name for bit, name in SLOWDOWN_BITS.items() if reasons & bit]
            if slow:
                concerns.append(f"{where}: clocks slowed down: {', '.join(slow)} ({hex(reasons)})")
        width, max_width = _value(gpu.get("pcie_link_width_current")), _value(gpu.get("pcie_link_width_max"))
        if isinstance(width, int) and isinstance(max_width, int) and width < max_width:
            notes.append(f"{where}: PCIe link x{width} of x{max_width}")
        gen, max_gen = _value(gpu.get("pcie_link_generation_current")), _value(gpu.get("pcie_link_generation_max"))
        if isinstance(gen, int) and isinstance(max_gen, int) and gen < max_gen:
            notes.append(f"{where}: PCIe link gen {gen} of {max_gen} (an idle link trains down to save power)")
    return concerns, notes


def judge_fault(fault: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """(failed, needs_look, notes) for the user-fault window: the fault must be seen and must not impair."""
    failed: list[str] = []
    needs_look: list[str] = []
    notes: list[str] = []
    child = fault.get("subprocess") or {}
    findings = fault.get("findings") or []
    if child.get("timed_out"):
        needs_look.append(f"the faulting subprocess did not end within {child.get('timeout_s')} s (GPU hung?)")
    elif not child.get("launched"):
        failed.append(f"the fault kernel was never launched (exit {child.get('exit_code')}: "
                      f"{child.get('last_stderr_line')!r})")  # fmt: skip
        return failed, needs_look, notes
    elif child.get("exit_code") == 0 or child.get("exit_code") == 3:
        failed.append(f"the fault kernel ran and nothing failed (exit {child.get('exit_code')}): no fault to see")
        return failed, needs_look, notes
    seen = [f for f in findings if f.get("reason") in USER_FAULT_REASONS]
    impairing = [f for f in findings if f.get("impairs")]
    for f in impairing:
        needs_look.append(f"a finding in the user-fault window impairs under ecs: {f.get('reason')} from "
                          f"{f.get('source')} ({f.get('message', '')[:160]})")  # fmt: skip
    if not seen:
        reasons = sorted({str(f.get("reason")) for f in findings}) or ["none"]
        needs_look.append(f"no XID_13/31/43 finding after a user fault (findings: {', '.join(reasons)}; "
                          f"NVRM kernel lines seen: {len(fault.get('kernel_lines_nvrm') or [])})")  # fmt: skip
    if not fault.get("kernel_lines_nvrm"):
        notes.append("no NVRM line was read from /dev/kmsg in the fault window")
    return failed, needs_look, notes


def after_notes(raw_notes: list[str], notes: list[str]) -> list[str]:
    """The second raw reading's notes that the first did not already give (a call not offered stays not offered)."""
    return [n for n in raw_notes if n.replace("after:", "before:", 1) not in notes]


def judge_poll(findings: list[dict[str, Any]] | None, when: str) -> list[str]:
    """needs_look for one poll of the NVML source (`when`: "before" or "after" the run)."""
    return [POLL_FOUND[when].format(len(findings))] if findings else []


def judge_idle(idle: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(needs_look, notes) for the idle run: NVML must report nothing on a GPU at rest. The kernel log's history read
    at start can hold old faults: they are noted, not counted against the GPU."""
    needs_look: list[str] = []
    notes: list[str] = []
    nvml_findings = [f for f in idle["findings"] if f["source"] == "nvml"]
    if nvml_findings:
        needs_look.append(f"the idle run got {len(nvml_findings)} NVML finding(s) on a GPU at rest")
    history = [f for f in idle["findings"] if f["source"] != "nvml"]
    if history:
        notes.append(f"the kernel log's history at start gave {len(history)} finding(s) (listed under idle)")
    if any(f["reason"] in USER_FAULT_REASONS for f in history):
        notes.append("the history holds a user-fault Xid already: a new one within 5 min may be folded")
    return needs_look, notes


def exit_status(failed: list[str], needs_look: list[str]) -> tuple[str, int]:
    if failed:
        return "failed", 1
    if needs_look:
        return "needs_look", 2
    return "passed", 0
