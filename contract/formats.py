"""How times, Web UI links and HOST:PORT binds are written wherever a person or another program reads them."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from typing import Literal
from urllib.parse import quote


def iso(moment: datetime, timespec: Literal["auto", "seconds"] = "auto") -> str:
    """ISO 8601 with a `Z` for UTC; `seconds` where a person reads it. An aware time is written in UTC; a naive one
    as it is (in workflow code converting it would consult the host's time zone)."""
    if moment.tzinfo is not None:
        # A time at the edge of the calendar (year 1 or 9999) cannot move to UTC: it is written as it came.
        with contextlib.suppress(OverflowError):
            moment = moment.astimezone(UTC)
    return moment.isoformat(timespec=timespec).replace("+00:00", "Z")


def workflow_url(ui_url: str, namespace: str, workflow_id: str | None = None, run_id: str | None = None) -> str:
    """The Temporal Web UI's list of workflows, or one workflow (run). Ids are path-escaped: they contain '/'."""
    url = f"{ui_url.rstrip('/')}/namespaces/{quote(namespace, safe='')}/workflows"
    if workflow_id is None:
        return url
    return f"{url}/{quote(workflow_id, safe='')}" + (f"/{quote(run_id, safe='')}" if run_id else "")


def parse_bind(text: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port`; ValueError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)
