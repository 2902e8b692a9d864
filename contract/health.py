"""The ECS-shaped health vocabulary, and what starts or steers an instance's health workflow."""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum
from typing import Final

from pydantic import BaseModel, Field

from contract.limits import MAX_HEARTBEAT_LOSS_INJECTION, Id, Name


class HealthState(StrEnum):
    OK = "OK"
    IMPAIRED = "IMPAIRED"
    INSUFFICIENT_DATA = "INSUFFICIENT_DATA"
    INITIALIZING = "INITIALIZING"


# The HealthStatus search attribute's value for an instance whose probe has not reported since it registered
# (first_report_timeout): its overall status is INSUFFICIENT_DATA, but it is watched by AWS alone, and counted apart.
UNMONITORED: Final = "UNMONITORED"
# Every value the HealthStatus search attribute takes: the fleet's health is one count query per value.
SEARCH_STATUSES: Final[tuple[str, ...]] = (*(s.value for s in HealthState), UNMONITORED)

# Most severe first: the overall status is the most severe detail.
SEVERITY = [HealthState.IMPAIRED, HealthState.INSUFFICIENT_DATA, HealthState.INITIALIZING, HealthState.OK]


class CheckType(StrEnum):
    ACCELERATED_COMPUTE = "ACCELERATED_COMPUTE"
    AGENT_CONNECTIVITY = "AGENT_CONNECTIVITY"
    CONTAINER_RUNTIME = "CONTAINER_RUNTIME"
    DAEMON = "DAEMON"
    # Ours, not ECS's: EC2's own status checks and scheduled events (workflows/health_aws_checks.py).
    EC2_STATUS = "EC2_STATUS"


class HealthInput(BaseModel):
    """What starts `health/<instance>` (the probe's signal-with-start). The workflow's own carried state is
    added by the workflow itself (workflows.models.HealthRun)."""

    instance_id: Id
    group: Id


class HeartbeatLossInjection(BaseModel):
    """Game day: the health workflow ignores heartbeats for `duration`, exactly as if the probe were silent."""

    duration: timedelta = Field(gt=timedelta(0), le=MAX_HEARTBEAT_LOSS_INJECTION)
    requested_by: Name = ""
