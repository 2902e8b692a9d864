"""Asking a group's drain semaphore for a permit, and what starts `drain-semaphore/<group>`."""

from __future__ import annotations

from pydantic import BaseModel, Field

from contract.limits import Id, OptionalId, Text, Timestamp, Token


class PermitRequest(BaseModel):
    """The `request` signal."""

    holder_workflow_id: Id
    holder_run_id: OptionalId | None = None
    instance_id: OptionalId = ""
    requested_at: Timestamp | None = None
    # The repair's own secret for this request: the grant must carry it back, and a release must show it.
    token: Token = ""
    # Outside the group's maintenance windows only critical repairs are granted.
    critical: bool = True


class PermitDenial(BaseModel):
    """The `permit_denied` signal: the semaphore lets a waiting repair go (`--resume --discard-held`) instead of
    granting it; the repair ends without touching its instance."""

    holder_workflow_id: Id
    token: Token = ""
    reason: Text = ""


class LaunchOutcome(BaseModel):
    """The `launch_outcome` signal: a permit holder tells its group's semaphore how a launch in an AZ went, so that
    the group's repairs avoid an AZ out of capacity (allow_other_azs)."""

    holder_workflow_id: Id
    token: Token = ""
    availability_zone: Id
    capacity_error: bool  # False: it launched


# An Auto Scaling group launches a handful at a time; a longer list is a caller's bug, refused.
MAX_CLAIM_CANDIDATES = 100


class ReplacementClaim(BaseModel):
    """The `claim_replacement` update: a repair holding a permit asks which of the Auto Scaling group's new
    instances is its replacement. EC2 tags have no compare-and-set, so the group's semaphore decides: two repairs
    never get the same one."""

    holder_workflow_id: Id
    impaired_instance_id: Id
    # Unclaimed-looking new instances, the likeliest first (launched first after the detach).
    candidates: list[Id] = Field(max_length=MAX_CLAIM_CANDIDATES)


class ReplacementClaimed(BaseModel):
    # None: every candidate belongs to another repair; the group has not launched this one's yet.
    instance_id: str | None = None


class SemaphoreInput(BaseModel):
    """What starts the semaphore. The workflow's own carried state is added by the workflow itself
    (workflows.models.SemaphoreRun)."""

    group: Id
