"""What the node probe sends: GPU findings and heartbeats, the payloads of `gpu_finding` and `heartbeat`."""

from __future__ import annotations

from typing import Final, Literal, get_args

from pydantic import BaseModel, Field

from contract.health import HealthState
from contract.limits import MAX_COUNT, MAX_PROBE_SOURCES, Id, Name, Text, Timestamp

# Every kind of finding the probe sends, defined once: its sources make them (node_probe/classify/record.py) and the
# health workflow's check table says which check each impairs (workflows/health_checks.py). A new kind goes here.
FindingKind = Literal[
    "xid",
    "sxid",
    "gpu_fallen_off_bus",
    "gpu_init_failed",
    "nvml",
    "dcgm",
    "daemon",
    "daemon_recovered",
    "container_runtime",
    "container_runtime_recovered",
]
FINDING_KINDS: Final[tuple[str, ...]] = get_args(FindingKind)
# Kinds of finding about the host's services rather than its GPUs: each is a state transition (down, back up) that
# the probe never folds into a burst, and the health workflow maps to its own check (DAEMON, CONTAINER_RUNTIME).
KIND_DAEMON: Final = "daemon"
KIND_DAEMON_RECOVERED: Final = "daemon_recovered"
KIND_CONTAINER_RUNTIME: Final = "container_runtime"
KIND_CONTAINER_RUNTIME_RECOVERED: Final = "container_runtime_recovered"
STATE_TRANSITION_KINDS: Final = frozenset(
    {KIND_DAEMON, KIND_DAEMON_RECOVERED, KIND_CONTAINER_RUNTIME, KIND_CONTAINER_RUNTIME_RECOVERED}
)
# NVIDIA's actions a finding names (GpuFinding.immediate_action). The Xid catalog's resolution buckets come as they
# are (RESET_GPU, RESTART_VM, RESTART_BM, CONTACT_SUPPORT, WORKFLOW_XID_48, ...); NVIDIA's standing verdicts on a GPU
# (below) name one of these, which are the remedies the remediation ladder knows (docs/operations.md §13).
ACTION_NONE: Final = "NONE"  # a verdict cleared: NVIDIA asks nothing of that GPU any more
ACTION_RESET_GPU: Final = "RESET_GPU"
ACTION_DRAIN_AND_RESET: Final = "DRAIN_AND_RESET"  # stop the GPU's work, then reset it
ACTION_DRAIN_P2P: Final = "DRAIN_P2P"  # stop the peer-to-peer users of the GPU, then read the verdict again
ACTION_RESTART_VM: Final = "RESTART_VM"
ACTION_RESTART_BM: Final = "RESTART_BM"  # reboot the node
ACTION_REPLACE: Final = "REPLACE"  # the GPU cannot be fixed in place: unrepairable memory, say
# NVIDIA's standing verdicts on one GPU (GpuFinding.verdict). Each holds until a finding of the same verdict on the
# same GPU says otherwise (ACTION_NONE when it cleared): the recovery action (NVML field 230, or Xid 154 in the kernel
# log), and the R575+ drivers' flags (nvmlDeviceGetSramEccErrorStatus, nvmlDeviceGetUnrepairableMemoryFlag_v1,
# nvmlDeviceGetRepairStatus), with a row-remapping failure.
NvidiaVerdictName = Literal[
    "recovery_action",
    "sram_threshold_exceeded",
    "unrepairable_memory",
    "channel_repair_pending",
    "tpc_repair_pending",
    "row_remap_failure",
]
NVIDIA_VERDICTS: Final[tuple[str, ...]] = get_args(NvidiaVerdictName)
# The verdict NVIDIA's catalog says overrides the Xids around it (Xid 154's), and the others by name.
VERDICT_RECOVERY_ACTION: Final = "recovery_action"
VERDICT_SRAM_THRESHOLD_EXCEEDED: Final = "sram_threshold_exceeded"
VERDICT_UNREPAIRABLE_MEMORY: Final = "unrepairable_memory"
VERDICT_CHANNEL_REPAIR_PENDING: Final = "channel_repair_pending"
VERDICT_TPC_REPAIR_PENDING: Final = "tpc_repair_pending"
VERDICT_ROW_REMAP_FAILURE: Final = "row_remap_failure"
# Far above any instance type's GPUs (8 today): a count past it is no count.
MAX_GPUS_PER_HOST: Final = 64
# The most sources one finding names: kernel log, kmsg, journald, NVML, DCGM, with room to spare.
MAX_FINDING_SOURCES: Final = 8
# The kernel-log lines around an impairing fault one finding carries (node_probe/classify/context.py).
MAX_CONTEXT_LINES: Final = 20


class GpuRef(BaseModel):
    """Which GPU a finding is about. NVML and the kernel log both name it by PCI address; NVML adds the UUID."""

    pci: Name | None = None  # dddd:bb:dd, lower case, no function
    uuid: Name | None = None
    mig_gpu_instance: int | None = Field(default=None, ge=0, le=1024)
    mig_compute_instance: int | None = Field(default=None, ge=0, le=1024)


class GpuFinding(BaseModel):
    """One classified GPU fault on one instance (a burst of identical lines arrives as one finding with a count)."""

    finding_id: Id = Field(description="Stable id: a redelivered finding is recognised and dropped")
    instance_id: Id
    group: Id
    kind: Name = Field(
        min_length=1,
        description=", ".join(FINDING_KINDS),
    )
    code: int | None = Field(default=None, ge=0, le=2**31 - 1)
    reason: Name = Field(min_length=1, description="ECS-style status reason, e.g. XID_79")
    impairs: bool
    rule: Name = ""
    source: Name = ""
    # Every source that saw this one fault within the probe's correlation window (the kernel log, NVML and DCGM
    # each report a double-bit ECC error): one finding, counted once. Empty from probes before it: `source` alone.
    sources: list[Name] = Field(default_factory=list, max_length=MAX_FINDING_SOURCES)
    gpu: GpuRef = Field(default_factory=GpuRef)
    # NVIDIA's immediate action for it (the Xid catalog's resolution bucket: RESET_GPU, RESTART_BM, CONTACT_SUPPORT,
    # ...), which decides whether a reboot-first group reboots or replaces; "" when the catalog names none.
    immediate_action: Name = ""
    # Which of NVIDIA's standing verdicts on the GPU this finding states (NVIDIA_VERDICTS), its action being
    # `immediate_action`; "" for a fault. A reboot-first repair lets the GPU's verdicts choose its remedy.
    verdict: Name = ""
    message: Text = ""
    raw: Text = ""
    # An impairing kernel-log fault's surrounding lines, its own among them: for the incident's evidence. Empty for
    # other findings, and from probes before it.
    context: list[Text] = Field(default_factory=list, max_length=MAX_CONTEXT_LINES)
    count: int = Field(default=1, ge=1, le=MAX_COUNT)
    observed_at: Timestamp


class ProbeSourceHealth(BaseModel):
    """One source of the node probe (kmsg, nvml, dcgm, daemons, ...) as it last reported itself."""

    name: Name
    state: HealthState  # OK, or INSUFFICIENT_DATA while it cannot see what it watches
    reason: Text | None = None
    gpu_source: bool = True  # False for the daemons check: its being down says nothing about the GPUs


class Heartbeat(BaseModel):
    instance_id: Id
    group: Id
    sent_at: Timestamp
    # INSUFFICIENT_DATA while any GPU source of the probe is down: a fault only it would see could be missed, and
    # not knowing is never a reason to impair.
    gpu_health: HealthState = HealthState.OK
    gpu_health_reason: Text | None = None
    sources: list[ProbeSourceHealth] = Field(default_factory=list, max_length=MAX_PROBE_SOURCES)
    # The host's boot (/proc/sys/kernel/random/boot_id): a reboot-first repair waits for a heartbeat from a new one.
    # None from probes before it.
    boot_id: Name | None = None
    # The GPUs NVML enumerates on this host; fewer than its instance type has impairs ACCELERATED_COMPUTE. None: not
    # known (no NVML, or it cannot be read), or a probe before it.
    gpu_count: int | None = Field(default=None, ge=0, le=MAX_GPUS_PER_HOST)
