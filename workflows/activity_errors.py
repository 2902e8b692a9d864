"""What an activity's failure says, read the same way by every step of a repair."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.errors import CAPACITY_CODES


def capacity_error(err: ActivityError) -> bool:
    return isinstance(err.cause, ApplicationError) and err.cause.type in CAPACITY_CODES


def permanent_error(err: ActivityError) -> bool:
    return isinstance(err.cause, ApplicationError) and err.cause.non_retryable


def describe_error(err: BaseException) -> str:
    cause = err.cause if isinstance(err, ActivityError) else None
    if isinstance(cause, ApplicationError):
        return f"{cause.type}: {cause.message}" if cause.type else cause.message
    return str(cause or err)
