"""Which fault records impair an instance (and so start a repair), and which are only warnings.

Two base policies:
  * `ecs` (default): exactly what Amazon ECS Managed Instances replaces an instance on, its 18 Xids, plus a
    GPU that fell off the bus. Conservative: a false impair costs a whole instance. A GPU that failed to
    initialise (RmInitAdapter) is only a warning here, as ECS does not act on it either.
  * `nvidia-catalog`: NVIDIA's resolution buckets; anything NVIDIA sends to the hardware side impairs, except an
    NVLink5 error (Xid 144-150) the driver itself calls Nonfatal. RESTART_APP and IGNORE never impair, whatever
    the line adds: a contained Xid 94 that asks for a reset impairs through the Xid 154 (recovery action) that
    announces the reset, not by itself. A GPU that failed to initialise impairs.
Operator overrides (`PolicyConfig`) go on top: extra impairing codes, codes never to impair, and repeat rules.

A record stamped (wall clock) before this boot is history of another boot, read from a log file that spans
reboots: a stopped and started instance runs on other hardware, so it never impairs (`history:previous-boot`).

Records from the other sources: NVML Xid events arrive as `xid` records and "GPU is lost" as `gpu_fallen_off_bus`,
so the rules above apply unchanged. NVML's polled state (`nvml`), DCGM health (`dcgm`) and daemons (`daemon`) carry
their own reason; DCGM "fail", a critical daemon and a critical container runtime (`container_runtime`) impair under
both policies (ECS's DCGM, DAEMON and CONTAINER_RUNTIME checks), the NVML conditions only under `nvidia-catalog`
(ECS does not act on them).

NVIDIA's standing verdicts on a GPU (classify/verdicts.py: the recovery action, from NVML or Xid 154; the R575+
flags; a row-remapping failure) never impair under `ecs`: they only choose the remedy once something else impaired
the instance. Under `nvidia-catalog` what NVIDIA sends to the hardware side impairs: a row-remapping failure, the
SRAM error threshold exceeded, unrepairable memory, and a recovery action that asks for a reset, a reboot or a drain.
A channel or TPC repair pending is a warning there, as a row remapping pending is: the GPU reset that applies it is
what its verdict asks for, not a sign that the GPU is failing. A verdict withdrawn (its action NONE: the flag cleared,
the recovery action back to None) never impairs under either policy, whatever the overrides say.

NVML's warnings (clocks slowed by hardware or heat, a PCIe link below its maximum) never impair under either policy:
they are counted in the instance's health details for an operator to look at.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from datetime import datetime, timedelta
from typing import Literal, NamedTuple

from pydantic import BaseModel, Field

from contract.probe import (
    ACTION_NONE,
    KIND_CONTAINER_RUNTIME,
    KIND_CONTAINER_RUNTIME_RECOVERED,
    STATE_TRANSITION_KINDS,
)
from node_probe.classify.catalog import XidCatalog, default_catalog
from node_probe.classify.record import FaultRecord

POLICY_ECS = "ecs"
POLICY_NVIDIA_CATALOG = "nvidia-catalog"
POLICY_NAMES = (POLICY_ECS, POLICY_NVIDIA_CATALOG)

# NVIDIA buckets whose resolution is on the hardware/node side (see the reference's section 4).
HARDWARE_BUCKETS = frozenset(
    {
        "RESET_GPU",
        "RESTART_BM",
        "RESTART_VM",
        "CONTACT_SUPPORT",
        "CHECK_MECHANICALS",
        "WORKFLOW_XID_48",
        "WORKFLOW_NVLINK_ERR",
        "WORKFLOW_NVLINK5_ERR",
    }
)
# Buckets that mean "the application" or "nothing": never a reason to replace an instance.
APPLICATION_BUCKETS = frozenset({"RESTART_APP", "IGNORE"})
# Recovery actions Xid 154 can announce that need the node taken out of service.
_NODE_ACTION_WORDS = ("reset", "reboot", "drain", "flr")
# NVML conditions that NVIDIA's guidance sends to the hardware side (a GPU reset or more); see sources/nvml_poll.py.
NVML_REMAP_FAILURE = "NVML_REMAP_FAILURE"  # like Xid 64, bucket RESET_GPU
NVML_GPU_UNAVAILABLE = "NVML_GPU_UNAVAILABLE"
NVML_RECOVERY_ACTION_PREFIX = "NVML_RECOVERY_ACTION_"
# The R575+ drivers' flags. The SRAM threshold and unrepairable memory say the GPU itself must go; a repair pending
# is applied by the GPU reset its verdict asks for.
NVML_SRAM_THRESHOLD_EXCEEDED = "NVML_SRAM_THRESHOLD_EXCEEDED"
NVML_UNREPAIRABLE_MEMORY = "NVML_UNREPAIRABLE_MEMORY"
NVML_CHANNEL_REPAIR_PENDING = "NVML_CHANNEL_REPAIR_PENDING"
NVML_TPC_REPAIR_PENDING = "NVML_TPC_REPAIR_PENDING"
# A flag's reason with this after it: the flag cleared (its verdict withdrawn), a finding of its own.
CLEARED_SUFFIX = "_CLEARED"
# Warnings worth seeing, never repairs (sources/nvml_warnings.py): clocks slowed by hardware or heat, a PCIe link
# below its maximum. A hot rack, a chassis power brake or a riser seated badly shows them on a GPU that is not
# failing, and no NVIDIA verdict asks for a remedy for them, so no policy replaces an instance on one.
NVML_CLOCKS_HW_SLOWDOWN = "NVML_CLOCKS_HW_SLOWDOWN"
NVML_CLOCKS_SW_THERMAL_SLOWDOWN = "NVML_CLOCKS_SW_THERMAL_SLOWDOWN"
NVML_PCIE_LINK_DEGRADED = "NVML_PCIE_LINK_DEGRADED"
NVML_WARNINGS_ONLY = frozenset({NVML_CLOCKS_HW_SLOWDOWN, NVML_CLOCKS_SW_THERMAL_SLOWDOWN, NVML_PCIE_LINK_DEGRADED})
_NVML_HARDWARE_REASONS = {
    NVML_REMAP_FAILURE: "row-remap-failure",
    NVML_GPU_UNAVAILABLE: "gpu-unavailable",
    NVML_SRAM_THRESHOLD_EXCEEDED: "sram-threshold-exceeded",
    NVML_UNREPAIRABLE_MEMORY: "unrepairable-memory",
}
_NVLINK5_XIDS = range(144, 151)
_SOURCE_KINDS = frozenset({"nvml", "dcgm"}) | STATE_TRANSITION_KINDS
# Bounds the repeat-rule memory when a log names many GPUs (or garbage addresses).
_MAX_REPEAT_KEYS = 1024
# Bounds the verdicts remembered for records no repeat rule counts (a log naming many distinct codes).
_MAX_VERDICTS = 1024
# How far before this boot's start a wall-clock stamp may lie and still count as this boot's: early boot lines
# can be stamped before the clock is stepped by NTP.
PREVIOUS_BOOT_SLACK_S = 300.0


class Verdict(NamedTuple):
    impairs: bool
    reason: str  # ECS-style status reason: XID_79, SXID_20034, GPU_FALLEN_OFF_BUS, GPU_INIT_FAILED
    rule: str  # which rule decided, e.g. "ecs:xid-list", "override:repeat xid13 3/600s"


class RepeatRule(BaseModel):
    """`count` records of this code on the same GPU within `within` impair, even if one alone does not."""

    kind: Literal["xid", "sxid"] = "xid"
    code: int = Field(ge=0)
    count: int = Field(ge=2)
    within: timedelta

    @property
    def name(self) -> str:
        return f"override:repeat {self.kind}{self.code} {self.count}/{int(self.within.total_seconds())}s"


class PolicyConfig(BaseModel):
    add_xids: set[int] = Field(default_factory=set, description="Xids that impair whatever the base policy says")
    remove_xids: set[int] = Field(default_factory=set, description="Xids that never impair")
    add_sxids: set[int] = Field(default_factory=set, description="NVSwitch SXids that impair")
    repeat: list[RepeatRule] = Field(default_factory=list)


def reason_for(record: FaultRecord) -> str:
    if record.reason is not None:
        return record.reason
    if record.kind == "xid":
        return f"XID_{record.code}"
    if record.kind == "sxid":
        return f"SXID_{record.code:05d}" if record.code is not None else "SXID"
    if record.kind == "gpu_fallen_off_bus":
        return "GPU_FALLEN_OFF_BUS"
    return "GPU_INIT_FAILED"


def _ecs(record: FaultRecord, catalog: XidCatalog) -> tuple[bool, str]:
    assert record.code is not None  # only Xid records come here
    if record.code in catalog.ecs_codes:
        return True, "ecs:xid-list"
    if record.code not in catalog:
        return False, "ecs:unknown-xid"
    return False, "ecs:not-in-xid-list"


def _recovery_action_impairs(action: str | None) -> tuple[bool, str]:
    if action is None:
        return False, "nvidia-catalog:xid154-unparsed"
    lowered = action.lower()
    if lowered == "none":
        return False, "nvidia-catalog:xid154-action-none"
    if any(word in lowered for word in _NODE_ACTION_WORDS):
        return True, "nvidia-catalog:xid154-action-node"
    # "Recover IMEX Domain", "Unknown", names of future drivers: not a proven node fault, so only a warning.
    return False, "nvidia-catalog:xid154-action-other"


def _nvidia(record: FaultRecord, catalog: XidCatalog) -> tuple[bool, str]:
    code = record.code
    assert code is not None
    if code == 154:
        return _recovery_action_impairs(record.recovery_action_to)
    if code == 45:
        # Xid 45 is cleanup after another fault; bursts of it at job teardown are normal (NVSentinel#1629).
        cause = record.caused_by_xid
        if cause is None or cause in (45, 154):
            return False, "nvidia-catalog:xid45-no-cause"
        impairs, _ = _nvidia(record._replace(code=cause, caused_by_xid=None), catalog)
        return impairs, f"nvidia-catalog:xid45-follows-xid{cause}"
    if code in _NVLINK5_XIDS and record.nvlink_fatal is False:
        # The driver's own severity: a Nonfatal NVLink5 error was corrected and the link stays up. Replacing a
        # node on one is the mistake operators complain of most; a repeat rule catches a link that keeps at it.
        return False, "nvidia-catalog:nvlink5-nonfatal"
    info = catalog.get(code)
    if info is None:
        return False, "nvidia-catalog:unknown-xid"
    bucket = info.immediate_bucket
    if not bucket:
        return False, "nvidia-catalog:bucket-unassigned"
    return bucket in HARDWARE_BUCKETS, f"nvidia-catalog:bucket-{bucket}"


def _source_record(policy: str, record: FaultRecord) -> tuple[bool, str]:
    if record.kind == "dcgm":
        return (True, f"{policy}:dcgm-fail") if record.critical else (False, f"{policy}:dcgm-warn")
    if record.kind == "daemon":
        return (True, f"{policy}:daemon-critical") if record.critical else (False, f"{policy}:daemon-not-critical")
    if record.kind == "daemon_recovered":
        return False, f"{policy}:daemon-recovered"
    if record.kind == KIND_CONTAINER_RUNTIME:
        # ECS's CONTAINER_RUNTIME check: a runtime that is down or hung cannot start the tasks the host is for.
        return (True, f"{policy}:runtime-critical") if record.critical else (False, f"{policy}:runtime-not-critical")
    if record.kind == KIND_CONTAINER_RUNTIME_RECOVERED:
        return False, f"{policy}:runtime-recovered"
    reason = record.reason or ""
    if reason in NVML_WARNINGS_ONLY:
        # Decided here, before either policy's NVML rules, so that no later rule for NVML conditions makes one impair.
        return False, f"{policy}:nvml-warning-only"
    if policy == POLICY_ECS:
        return False, "ecs:nvml-not-an-ecs-check"
    hardware = _NVML_HARDWARE_REASONS.get(reason)
    if hardware is not None:
        return True, f"nvidia-catalog:{hardware}"
    if reason.startswith(NVML_RECOVERY_ACTION_PREFIX):
        # The same actions Xid 154 announces, so the same decision.
        impairs, rule = _recovery_action_impairs(record.recovery_action_to)
        return impairs, rule.replace(":xid154-", ":recovery-")
    return False, "nvidia-catalog:nvml-warning"


class RepeatSeen(BaseModel):
    """One (rule, GPU)'s recent matches: their times and the positions of the records they came from."""

    rule: int
    source: str = ""
    pci: str | None
    mig_gpu_instance: int | None
    mig_compute_instance: int | None
    times: list[float]
    positions: list[str | None]


class RepeatMemory(BaseModel):
    """The repeat rules' recent matches, kept beside the spool so that a restarted probe, which no longer re-reads
    the history it handled, does not forget them. Times are uptimes or this host's clock: only this boot's count."""

    boot_id: str
    rules: list[RepeatRule]  # the indexes in `seen` refer to these; other rules start afresh
    seen: list[RepeatSeen]


_RepeatKey = tuple[int, str, str | None, int | None, int | None]


class _RepeatTracker:
    """Times of recent matching records per (rule, GPU): `count` each, _MAX_REPEAT_KEYS keys, at most."""

    def __init__(self) -> None:
        self._seen: OrderedDict[_RepeatKey, deque[tuple[float, str | None]]] = OrderedDict()
        self.changes = 0

    def fires(
        self, index: int, rule: RepeatRule, record: FaultRecord, at: float, source: str, position: str | None
    ) -> bool:
        # Counted per source: NVML's Xid event and the kernel's line about one fault are one fault, not two.
        key = (index, source, record.pci, record.mig_gpu_instance, record.mig_compute_instance)
        times = self._seen.get(key)
        if times is None:
            times = deque(maxlen=rule.count)
            self._seen[key] = times
            if len(self._seen) > _MAX_REPEAT_KEYS:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(key)
        # A record read again after a restart (the cursor lags by up to a second) is the same match, not another.
        if position is None or all(seen != position for _, seen in times):
            if times and at < times[-1][0]:
                # The clock went back (uptime restarts with each boot a log file spans): earlier matches are
                # another boot's.
                times.clear()
            times.append((at, position))
            self.changes += 1
        return len(times) == rule.count and 0 <= times[-1][0] - times[0][0] <= rule.within.total_seconds()

    def export(self) -> list[RepeatSeen]:
        return [
            RepeatSeen(
                rule=rule,
                source=source,
                pci=pci,
                mig_gpu_instance=gi,
                mig_compute_instance=ci,
                times=[at for at, _ in times],
                positions=[position for _, position in times],
            )
            for (rule, source, pci, gi, ci), times in self._seen.items()
        ]

    def restore(self, seen: list[RepeatSeen], rules: list[RepeatRule]) -> None:
        for entry in seen[-_MAX_REPEAT_KEYS:]:
            if 0 <= entry.rule < len(rules):
                times = deque(zip(entry.times, entry.positions, strict=False), maxlen=rules[entry.rule].count)
                key = (entry.rule, entry.source, entry.pci, entry.mig_gpu_instance, entry.mig_compute_instance)
                self._seen[key] = times


class Policy:
    """Classifies records. Holds the repeat-rule state, so use one instance per stream of records."""

    def __init__(
        self,
        name: str = POLICY_ECS,
        config: PolicyConfig | None = None,
        catalog: XidCatalog | None = None,
        *,
        booted_at: float | None = None,
    ) -> None:
        """`booted_at` (POSIX seconds) is when the host that wrote the records booted, when the records are this
        host's own; `autorepair classify` reads logs of any host and leaves it unset."""
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICY_NAMES)})")
        self.name = name
        self.config = config or PolicyConfig()
        self._catalog = catalog or default_catalog()
        self._booted_at = booted_at
        self._repeats = _RepeatTracker()
        # (kind, code) of the records a repeat rule counts: only those need the rules' memory.
        self._counted = frozenset((rule.kind, rule.code) for rule in self.config.repeat)
        # Any other record's verdict follows from these fields alone (see _decide), so a storm's records, which
        # share them, are decided once: the rest is a lookup.
        self._verdicts: dict[tuple[object, ...], Verdict] = {}

    def classify(self, record: FaultRecord, now: datetime, *, source: str = "", position: str | None = None) -> Verdict:
        """`source` and `position` (where the record sits in it) let a repeat rule count each source's records
        apart and tell a record read again after a restart from a new one."""
        if (record.kind, record.code) in self._counted or self._before_boot(record):
            impairs, rule = self._decide(record, now, source, position)
            return Verdict(impairs=impairs, reason=reason_for(record), rule=rule)
        key = (
            record.kind,
            record.code,
            record.reason,
            record.critical,
            record.caused_by_xid,
            record.recovery_action_to,
            record.nvidia_action,
            record.nvlink_fatal,
        )
        verdict = self._verdicts.get(key)
        if verdict is None:
            impairs, rule = self._decide(record, now, source, position)
            verdict = Verdict(impairs=impairs, reason=reason_for(record), rule=rule)
            if len(self._verdicts) >= _MAX_VERDICTS:
                self._verdicts.clear()
            self._verdicts[key] = verdict
        return verdict

    def same_verdict_for_repeats(self, record: FaultRecord) -> bool:
        """Whether records that differ from `record` only in where they are (line, raw text, stamps) all get its
        verdict, so that a run of them needs classifying once: no repeat rule counts them one by one, and no boot
        time is there to tell their stamps apart."""
        return self._booted_at is None and (record.kind, record.code) not in self._counted

    @property
    def repeat_changes(self) -> int:
        """Grows whenever the repeat rules' memory changes: the probe saves it then."""
        return self._repeats.changes

    def repeat_memory(self, boot_id: str) -> RepeatMemory:
        return RepeatMemory(boot_id=boot_id, rules=self.config.repeat, seen=self._repeats.export())

    def restore_repeats(self, memory: RepeatMemory, boot_id: str) -> bool:
        """Take over a restarted probe's memory; not another boot's, nor one for other rules."""
        if memory.boot_id != boot_id or memory.rules != self.config.repeat:
            return False
        self._repeats.restore(memory.seen, self.config.repeat)
        return True

    def _before_boot(self, record: FaultRecord) -> bool:
        booted_at = self._booted_at
        return booted_at is not None and record.wall_s is not None and record.wall_s < booted_at - PREVIOUS_BOOT_SLACK_S

    def _decide(self, record: FaultRecord, now: datetime, source: str, position: str | None) -> tuple[bool, str]:
        if self._before_boot(record):
            return False, "history:previous-boot"
        if record.nvidia_action == ACTION_NONE:
            # NVIDIA withdrew its verdict: the GPU is well by its own account, which no override makes a fault.
            return False, f"{self.name}:verdict-withdrawn"
        if record.kind == "gpu_fallen_off_bus":
            return True, f"{self.name}:gpu-fallen-off-bus"
        if record.kind == "gpu_init_failed":
            if self.name == POLICY_ECS:
                return False, "ecs:gpu-init-failed-not-an-ecs-check"
            return True, f"{self.name}:gpu-init-failed"
        if record.kind in _SOURCE_KINDS:
            return _source_record(self.name, record)
        fired = self._repeat_rule_fired(record, now, source, position)
        if fired is not None:
            return True, fired
        code = record.code
        if record.kind == "sxid":
            if code in self.config.add_sxids:
                return True, f"override:add sxid{code}"
            return False, f"{self.name}:sxid-warning"
        if code in self.config.remove_xids:
            return False, f"override:remove xid{code}"
        if code in self.config.add_xids:
            return True, f"override:add xid{code}"
        if self.name == POLICY_ECS:
            return _ecs(record, self._catalog)
        return _nvidia(record, self._catalog)

    def _repeat_rule_fired(self, record: FaultRecord, now: datetime, source: str, position: str | None) -> str | None:
        # The record's own stamp, when the log has one, keeps old history read at start-up in one go from counting
        # as a burst. Wall clock first: unlike uptime it does not restart at each boot of a log spanning reboots.
        at = record.wall_s if record.wall_s is not None else record.uptime_s
        if at is None:
            at = now.timestamp()
        fired: str | None = None
        for index, rule in enumerate(self.config.repeat):
            # Every matching rule records the time, even after one fired, so each keeps its own count.
            matches = rule.kind == record.kind and rule.code == record.code
            if matches and self._repeats.fires(index, rule, record, at, source, position) and fired is None:
                fired = rule.name
        return fired
