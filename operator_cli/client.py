"""The operator's commands as Temporal clients: connecting with a timeout, listing and fanning out calls politely, and
turning every failure the operator can act on into one line on stderr and an exit status, never a traceback."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import re
import socket
import sys
from collections.abc import Awaitable, Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

from temporalio.client import Client, WorkflowExecution, WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.service import RPCError, RPCStatusCode

from contract import formats
from contract.concurrency import gather_at_most
from contract.config import TemporalSettings
from contract.limits import MAX_NAME
from contract.temporal_client import connect
from contract.temporal_options import load_settings
from operator_cli import exit_codes
from worker.settings import Settings

T = TypeVar("T")

CONNECT_TIMEOUT = timedelta(seconds=10)
# A query of a closed workflow is answered by a worker replaying it; with no worker it would wait for one.
QUERY_TIMEOUT = timedelta(seconds=5)
# Visibility, queries and history reads in flight at once: enough to be quick, few enough to be polite.
CONCURRENCY = 8


class OpsError(Exception):
    """One line for the operator. Exit status USAGE: fix the command; UNREACHABLE: Temporal unreachable or refused."""

    def __init__(self, message: str, code: int = exit_codes.USAGE) -> None:
        super().__init__(message)
        self.code = code


def guarded(handler: Callable[[argparse.Namespace], Awaitable[int]]) -> Callable[[argparse.Namespace], Any]:
    """Turn every failure the operator can act on into one line on stderr and an exit status."""

    async def run(args: argparse.Namespace) -> int:
        subcommands = [getattr(args, "group_command", None), getattr(args, "instance_command", None)]
        name = " ".join(filter(None, [args.command, *subcommands]))
        try:
            return await handler(args)
        except OpsError as err:
            print(f"autorepair {name}: {err}", file=sys.stderr)
            return err.code
        except RPCError as err:
            print(f"autorepair {name}: Temporal refused the call: {one_line(err.message)}", file=sys.stderr)
            return exit_codes.UNREACHABLE
        except (TimeoutError, WorkflowUpdateRPCTimeoutOrCancelledError):
            print(f"autorepair {name}: Temporal did not answer in time", file=sys.stderr)
            return exit_codes.UNREACHABLE

    return run


def one_line(text: str) -> str:
    """Server and SDK messages span lines; the operator gets them on one."""
    return " ".join(text.split())


def rpc_reason(err: RPCError, query: str) -> str:
    """Why a workflow could not be described or queried, in the operator's terms."""
    if err.status == RPCStatusCode.NOT_FOUND:
        return "no such workflow (for an instance: its probe has never reported)"
    if err.status in (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED):
        # Queries are answered by a worker; none polling the task queue means none answers.
        return f"no answer to the {query} query within {QUERY_TIMEOUT.seconds}s: is `autorepair worker` running?"
    return one_line(err.message)


def temporal_settings(args: argparse.Namespace) -> TemporalSettings:
    """The shared Temporal settings as the command's Temporal options (contract/temporal_options.py) adjust them."""
    return load_settings(Settings.load, args).temporal


async def connect_client(temporal: TemporalSettings) -> Client:
    """Connect, or fail within CONNECT_TIMEOUT with one line saying why (exit status UNREACHABLE)."""
    try:
        return await asyncio.wait_for(connect(temporal), timeout=CONNECT_TIMEOUT.total_seconds())
    except TimeoutError:
        raise OpsError(
            f"cannot reach Temporal at {temporal.address}: no answer within {CONNECT_TIMEOUT.seconds}s",
            code=exit_codes.UNREACHABLE,
        ) from None
    except RuntimeError as err:
        raise OpsError(
            f"cannot reach Temporal at {temporal.address}: {_connect_reason(err)}", code=exit_codes.UNREACHABLE
        ) from None


def _connect_reason(err: Exception) -> str:
    text = str(err)
    # The core SDK nests the OS error deep in a transport error; the operator needs only its last words.
    found = re.findall(r'message: "([^"]+)"', text)
    if found:
        return str(found[-1]).lower()
    return one_line(text.removeprefix("Failed client connect: "))


def workflow_url(temporal: TemporalSettings, workflow_id: str, run_id: str | None) -> str:
    """The Web UI page of a workflow run."""
    return formats.workflow_url(temporal.ui_url, temporal.namespace, workflow_id, run_id)


async def bounded(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Await all calls, in order, at most CONCURRENCY at a time."""
    return await gather_at_most(CONCURRENCY, calls)


async def list_workflows(client: Client, query: str, limit: int | None = None) -> list[WorkflowExecution]:
    """Every execution a visibility query finds (up to limit)."""
    found: list[WorkflowExecution] = []
    async for execution in client.list_workflows(query, limit=limit):
        found.append(execution)
    return found


def requested_by() -> str:
    """Who asked, for the history and the event: user@host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:MAX_NAME]
