"""What the node probe sends: GPU findings and heartbeats, the payloads of `gpu_finding` and `heartbeat`."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from contract.health import HealthState


class GpuRef(BaseModel):
    """Which GPU a finding is about. NVML and the kernel log both name it by PCI address; NVML adds the UUID."""

    pci: str | None = None  # dddd:bb:dd, lower case, no function
    uuid: str | None = None
    mig_gpu_instance: int | None = None
    mig_compute_instance: int | None = None


class GpuFinding(BaseModel):
    """One classified GPU fault on one instance (a burst of identical lines arrives as one finding with a count)."""

    finding_id: str = Field(min_length=1, description="Stable id: a redelivered finding is recognised and dropped")
    instance_id: str = Field(min_length=1)
    group: str = Field(min_length=1)
    kind: str = Field(
        min_length=1, description="xid, sxid, gpu_fallen_off_bus, gpu_init_failed, nvml, dcgm, daemon, daemon_recovered"
    )
    code: int | None = None
    reason: str = Field(min_length=1, description="ECS-style status reason, e.g. XID_79")
    impairs: bool
    rule: str = ""
    source: str = ""
    gpu: GpuRef = Field(default_factory=GpuRef)
    message: str = ""
    raw: str = ""
    count: int = Field(default=1, ge=1)
    observed_at: datetime


class ProbeSourceHealth(BaseModel):
    """One source of the node probe (kmsg, nvml, dcgm, daemons, ...) as it last reported itself."""

    name: str
    state: HealthState  # OK, or INSUFFICIENT_DATA while it cannot see what it watches
    reason: str | None = None
    gpu_source: bool = True  # False for the daemons check: its being down says nothing about the GPUs


class Heartbeat(BaseModel):
    instance_id: str = Field(min_length=1)
    group: str = Field(min_length=1)
    sent_at: datetime
    # INSUFFICIENT_DATA while any GPU source of the probe is down: a fault only it would see could be missed, and
    # not knowing is never a reason to impair.
    gpu_health: HealthState = HealthState.OK
    gpu_health_reason: str | None = None
    sources: list[ProbeSourceHealth] = Field(default_factory=list)
