"""Decode signal payloads ourselves, so that bad input is counted and dropped instead of wedging a workflow.

A signal handler that takes a model parameter fails the workflow task (forever) on an empty signal, and the SDK
drops a payload that fails validation without telling the workflow. Taking the raw payloads and validating here
lets the workflow count every rejected signal and expose the count in its query.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RawValue

M = TypeVar("M", bound=BaseModel)


class Rejected(str):
    """Why a signal was dropped."""


def decode(signal: str, payloads: Sequence[RawValue], model: type[M]) -> M | Rejected:
    if len(payloads) != 1:
        return Rejected(f"signal {signal!r} carried {len(payloads)} payloads, expected 1")
    try:
        value = workflow.payload_converter().from_payload(payloads[0].payload, model)
    except Exception as err:  # any decode or validation failure is bad input, never a workflow failure
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        return Rejected(f"signal {signal!r} is not a valid {model.__name__}: {first_line}")
    if not isinstance(value, model):
        return Rejected(f"signal {signal!r} decoded to {type(value).__name__}, expected {model.__name__}")
    return value


def worth_logging(dropped: int) -> bool:
    """Log the first drops and then one in a hundred: a flood of bad signals must not flood the worker's log (nor
    keep the logging lock busy across workflow threads), and the count in the query says the rest."""
    return dropped <= 10 or dropped % 100 == 0


class Route(Generic[M]):
    """One signal a workflow takes: the model its payload must be, and the handler that gets it."""

    def __init__(self, model: type[M], handler: Callable[[M], None]) -> None:
        self.model = model
        self.handler = handler

    def take(self, name: str, payloads: Sequence[RawValue], reject: Callable[[Rejected], None]) -> None:
        value = decode(name, payloads, self.model)
        if isinstance(value, Rejected):
            reject(value)
        else:
            self.handler(value)


def dispatch(
    name: str, payloads: Sequence[RawValue], routes: dict[str, Route[Any]], reject: Callable[[Rejected], None]
) -> None:
    """Hand a signal to its route's handler; a bad payload, an unknown name or a handler's own failure is counted
    by `reject` and dropped, never a failed workflow task."""
    route = routes.get(name)
    if route is None:
        reject(Rejected(f"unknown signal {name!r}"))
        return
    try:
        route.take(name, payloads, reject)
    except Exception as err:  # a handler's own failure is bad input too
        reject(Rejected(f"signal {name!r} failed in its handler: {type(err).__name__}: {err}"[:500]))
