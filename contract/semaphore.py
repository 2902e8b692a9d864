"""Asking a group's drain semaphore for a permit, and what starts `drain-semaphore/<group>`."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class PermitRequest(BaseModel):
    """The `request` signal."""

    holder_workflow_id: str = Field(min_length=1)
    holder_run_id: str | None = None
    instance_id: str = ""
    requested_at: datetime | None = None


class SemaphoreInput(BaseModel):
    """What starts the semaphore. The workflow's own carried state is added by the workflow itself
    (workflows.models.SemaphoreRun)."""

    group: str
