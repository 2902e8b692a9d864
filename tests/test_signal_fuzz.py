"""Signal fuzzing: nothing a signal says may wedge a workflow.

Each of the four workflow types (an instance's health workflow, a group's drain semaphore, an instance's repair and a
group's liveness tracker) gets 1,000 random signals against the real Temporal dev server, with an in-process worker:
mostly the real signal names (`contract/names.py`), some random names; no payload, several payloads, null, numbers,
strings, lists, nested dicts, dicts shaped like the real models with wrong types, missing or extra fields and
out-of-range values (durations such as "P9000Y" or "-PT1S", timestamps in year 1 or 9999 or malformed, huge counts,
unicode, empty strings; liveness batches timed in year 1 or in the last second of 9999, for a shard out of range, of
20,001 instances); mostly small, a few just under the server's 2 MB payload limit. They go out 20 at a time, in batches
of 40 per workflow that it handles before the next (the near-limit ones one by one): the test is about what signals say,
not about the server's buffer of signals that arrive while a workflow task runs. Afterwards, for every workflow:

1. no run of it (continue-as-new is followed run by run) has a WorkflowTaskFailed event, other than those the server
   itself fails because of when signals arrived (SERVER_RETRIED; counted in the summary);
2. it is still running: none of these signals is legitimate enough to close it (see `check_workflow`); the tracker
   may declare the instances it was told of lost, and telling their (non-existent) health workflows must not fail it;
3. it still answers its query within a few seconds.

The signals are drawn from a seeded `random.Random`; the seed is printed, and `AUTOREPAIR_FUZZ_SEED=<seed>` replays
the same signals (sent concurrently, so their order on the server can still differ). A failure lists, per
workflow, each failed workflow task's message with the signals that workflow task handled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import string
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
from pydantic import BaseModel
from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError

from contract import names
from contract.groups import AutoRepair
from contract.health import HealthState
from contract.ids import health_workflow_id, liveness_workflow_id, repair_workflow_id, semaphore_workflow_id
from contract.liveness import MAX_BATCH, MAX_LIVENESS_SHARDS
from contract.probe import Heartbeat
from contract.repair import RepairInput, RepairPhase
from contract.semaphore import SemaphoreInput
from node_probe.delivery.reporter import Reporter
from tests.harness import eventually, make_settings, running_worker, unique
from workflows.models import (
    InstanceHealthView,
    LivenessRun,
    LivenessView,
    Permit,
    RepairStatus,
    SemaphoreRun,
    SemaphoreView,
)

SIGNALS_PER_WORKFLOW = 1_000
LARGE_PER_WORKFLOW = 4  # each 1.5-1.9 MB of JSON: under the server's 2 MB blob limit
LARGE_BYTES = (1_500_000, 1_900_000)
IN_FLIGHT = 20
# Signals sent to one workflow before it must catch up: the server fails a running workflow task (FORCE_CLOSE) once
# over 100 signals or 2 MB arrived while it ran, which says nothing about the workflow.
BATCH = 40
QUERY_WITHIN = 5.0  # seconds
SETTLE_WITHIN = 60.0  # seconds, for the workflows to work through what they were sent
SEND_WITHIN = 120.0  # seconds, for all the signals to be sent
# The liveness tracker also acts on its own timer: once the signals are sent, the test waits one window and grace of
# its group (6 s and 2 s) and a little more, so that what it was told is also acted on before the checks.
TRACKER_TIMERS = 10.0  # seconds

REAL_SIGNALS = [
    names.SIGNAL_GPU_FINDING,
    names.SIGNAL_HEARTBEAT,
    names.SIGNAL_REPAIR_PROGRESS,
    names.SIGNAL_INJECT_HEARTBEAT_LOSS,
    names.SIGNAL_LIVENESS,
    names.SIGNAL_LIVENESS_REPORT,
    names.SIGNAL_IGNORE_HEARTBEATS,
    names.SIGNAL_GROUP_CHANGED,
    names.SIGNAL_REQUEST,
    names.SIGNAL_RELEASE,
    names.SIGNAL_PERMIT_GRANTED,
]
LIVENESS_SIGNALS = {
    names.SIGNAL_LIVENESS,
    names.SIGNAL_LIVENESS_REPORT,
    names.SIGNAL_IGNORE_HEARTBEATS,
    names.SIGNAL_GROUP_CHANGED,
}

CLOSED_EVENTS = {
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED: "completed",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED: "failed",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED: "terminated",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT: "timed out",
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED: "cancelled",
}

# Workflow tasks the server fails by itself because of when signals arrived, never because of what they said or what
# the workflow did with them: it flushes signals buffered while a task ran (over 100 of them or 2 MB: FORCE_CLOSE),
# refuses a close or continue-as-new that raced a new signal (UNHANDLED_COMMAND), or drops a stale sticky task. The
# next workflow task handles the same signals; one that kept failing would still show in `settle` and the query.
SERVER_RETRIED = {
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_STICKY_TASK_QUEUE,
}

UNICODE = "éßøÆ中文字한국어русскийالعربية🔥🚀💥\u200b\u202e\u00a0\ufeff\x00\x07\n\r\t'\"\\%{}<>$`"


@dataclass(frozen=True)
class Ids:
    """What the forged payloads may name: the workflows under test, their groups, and a few strangers."""

    health_instance: str
    health_group: str
    semaphore_group: str
    repair_instance: str
    repair_group: str
    liveness_group: str

    @property
    def repair_id(self) -> str:
        return repair_workflow_id(self.repair_instance)


@dataclass(frozen=True)
class Signal:
    index: int
    name: str
    args: list[Any]
    large: bool = False

    def describe(self) -> str:
        return f"#{self.index} {self.name!r} {_short(self.args)}"


def _short(value: Any, limit: int = 240) -> str:
    text = json.dumps(value, ensure_ascii=True, default=str)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} bytes)"


class SignalFuzzer:
    """Random signal names and payloads, all from one seeded generator."""

    def __init__(self, rng: random.Random, ids: Ids) -> None:
        self.rng = rng
        self.ids = ids

    def pick(self, options: list[Any]) -> Any:
        return self.rng.choice(options)

    # --- plain values ------------------------------------------------------------------------------------------

    def text(self) -> str:
        rng = self.rng
        roll = rng.random()
        if roll < 0.12:
            return ""
        if roll < 0.45:
            return "".join(
                rng.choice(string.ascii_letters + string.digits + "-_/.:") for _ in range(rng.randint(1, 24))
            )
        if roll < 0.75:
            return "".join(rng.choice(UNICODE + string.ascii_letters) for _ in range(rng.randint(1, 40)))
        if roll < 0.85:
            return self.pick([" ", "\x00", "null", "None", "true", "0", "-1", "NaN", "%s%n{0}", "../../etc/passwd"])
        if roll < 0.95:
            return rng.choice(string.ascii_letters) * rng.randint(200, 5_000)
        return "".join(rng.choice(UNICODE) for _ in range(rng.randint(200, 3_000)))

    def number(self) -> int | float:
        return self.pick(
            [
                0,
                1,
                -1,
                self.rng.randint(-1_000, 1_000),
                2**31,
                2**63 - 1,
                2**63,
                -(2**63) - 1,
                10**30,
                -(10**30),
                0.5,
                -0.0,
                1e308,
                -1e308,
                5e-324,
                self.rng.uniform(-1e6, 1e6),
            ]
        )

    def scalar(self) -> Any:
        roll = self.rng.random()
        if roll < 0.15:
            return None
        if roll < 0.25:
            return self.rng.random() < 0.5
        if roll < 0.55:
            return self.number()
        return self.text()

    def value(self, depth: int = 0) -> Any:
        roll = self.rng.random()
        if depth >= 4 or roll < 0.45:
            return self.scalar()
        if roll < 0.6:
            return [self.value(depth + 1) for _ in range(self.rng.randint(0, 6))]
        if roll < 0.8:
            return {self.text()[:40]: self.value(depth + 1) for _ in range(self.rng.randint(0, 6))}
        if roll < 0.9:
            return self.mutated(self.template(self.pick(REAL_SIGNALS)))
        # Deep nesting, either way.
        nested: Any = self.scalar()
        for _ in range(self.rng.randint(20, 90)):
            nested = [nested] if self.rng.random() < 0.5 else {"a": nested}
        return nested

    def timestamp(self) -> Any:
        return self.pick(
            [
                datetime.now(UTC).isoformat(),
                datetime.now(UTC).isoformat(),
                "1970-01-01T00:00:00Z",
                "0001-01-01T00:00:00Z",
                "0001-01-01T00:00:00+14:00",
                "9999-12-31T23:59:59.999999Z",
                "9999-12-31T23:59:59-14:00",
                "2024-02-30T00:00:00Z",
                "2024-13-01T25:61:61Z",
                "2024-01-01T00:00:00",
                "2024-01-01",
                "yesterday",
                "",
                0,
                -1,
                -62_135_596_800,
                253_402_300_800,
                10**20,
                1.5e9,
                None,
                [],
                {},
            ]
        )

    def duration(self) -> Any:
        return self.pick(
            [
                "PT30S",
                "PT5M",
                "PT1H",
                "P1D",
                "PT24H",
                "PT24H0.000001S",
                "P1Y2M3DT4H5M6.7S",
                "P9000Y",
                "P999999999D",
                "P99999999999D",
                "-PT1S",
                "-P1D",
                "PT0S",
                "P0D",
                "PT",
                "forever",
                "",
                0,
                -1,
                3.5,
                86_400,
                86_401,
                10**12,
                10**30,
                1e300,
                -1e300,
                None,
            ]
        )

    def holder(self) -> Any:
        """Workflow ids a forger might claim; never the repair under test (a grant to it would be a real one)."""
        return self.pick(
            [
                f"repair/i-ghost-{self.rng.randrange(1_000)}",
                f"repair/i-ghost-{self.rng.randrange(1_000)}",
                health_workflow_id(self.ids.health_instance),
                "x" * self.rng.choice([255, 256, 257, 1_001, 5_000]),
                "repair/i-ünïcødé-🔥",
                " ",
                "",
                self.text(),
            ]
        )

    def count(self) -> Any:
        return self.pick([1, 1, 2, 17, 0, -3, 1_000_000_000, 1_000_000_001, 2**63, 10**30, "many", 1.5, None])

    # --- liveness ----------------------------------------------------------------------------------------------

    def either(self, valid: list[Any], invalid: list[Any], wild: bool) -> Any:
        """A valid value; in a wild payload, one time in three anything. A liveness batch is refused whole for one
        bad field or entry, so most payloads must be valid throughout for the tracker's state to be fuzzed at all."""
        if wild and self.rng.random() < 0.35:
            return self.pick(valid + invalid)
        return self.pick(valid)

    def ghost(self) -> str:
        """One of a few hundred instances without a health workflow: telling it of a loss fails."""
        return f"i-ghost-{self.rng.randrange(300)}"

    def instance(self, wild: bool) -> Any:
        """An instance a liveness batch or a game day may name: mostly a ghost, sometimes the health workflow under
        test (the tracker may tell it of a loss, a real signal), sometimes not an id at all."""
        return self.either(
            [self.ghost(), self.ghost(), self.ghost(), self.ids.health_instance, "i-ünïcødé-🔥", "x" * 256],
            ["", "x" * 257, self.text()[:300]],
            wild,
        )

    def heard(self, wild: bool) -> Any:
        """Who a batch heard, by whole seconds before its `at` (the contract allows 0 to 86,400): mostly a few, now
        and then one more instance than a batch may hold (about 0.4 MB)."""
        if self.rng.random() < 0.02:
            return {f"i-flood-{n:05d}": self.rng.randrange(8) for n in range(MAX_BATCH + 1)}
        ago_valid = [0, 0, 0, 1, 3, 5, 7, 30, 59, 600, 86_399, 86_400]
        ago_invalid = [86_401, -1, -86_400, 2**31, 2**63, -(2**63), 10**30, 1.5, "5", "", None, [], {}]
        size = self.pick([0, 1, 1, 2, 3, 5, 8, 20, 60])
        entries_wild = wild and self.rng.random() < 0.3  # one bad entry of many refuses the batch
        heard = {self.instance(entries_wild): self.either(ago_valid, ago_invalid, entries_wild) for _ in range(size)}
        return self.either([heard], [[], None, "", self.value()], wild)

    def liveness_time(self, wild: bool) -> Any:
        """A time by a reporter's or a tracker's clock: mostly about now, sometimes year 1 or 9999, then anything."""
        now = datetime.now(UTC)
        valid = [
            *[now.isoformat()] * 8,
            (now - timedelta(seconds=self.pick([1, 5, 30, 600]))).isoformat(),
            (now + timedelta(seconds=self.pick([1, 5, 30, 600]))).isoformat(),
            (now + timedelta(days=self.pick([-365, -2, 1, 3650]))).isoformat(),
            self.pick(["0001-01-01T00:00:00Z", "0001-01-01T00:00:05Z", "0001-01-01T00:00:00+00:30"]),
            self.pick(["9999-12-31T23:59:59Z", "9999-12-31T23:59:50Z", "9999-12-31T23:00:00Z"]),
        ]
        return self.either(valid, [self.timestamp()], wild)

    def capacity_group(self, wild: bool) -> dict[str, Any]:
        """A group's configuration as the semaphore sends it to its tracker. On the wire a CapacityGroup stays
        lenient (no settings rules): a zero, negative or huge duration gets through to the tracker."""
        ids, either = self.ids, self.either
        return {
            "name": either([ids.liveness_group], [ids.health_group, "", " ", self.text()], wild),
            "cluster": either([ids.liveness_group], ["", self.text()], wild),
            "launch_template": either([None, "lt-0fuzz"], ["", self.text()], wild),
            "launch_template_version": either(["$Latest", "$Default", "7"], ["", None], wild),
            "auto_scaling_group": either([None, "asg-fuzz"], [self.text()], wild),
            "auto_repair": either(["ENABLED", "DISABLED"], ["enabled", "", None], wild),
            "max_draining_percent": either([20, 1, 100], [0, 101, -1, 2**63, "20", None], wild),
            # The one duration the tracker uses: zero, negative and far too long ones are all valid timedeltas.
            "heartbeat_loss_threshold": either(
                ["PT6S", "PT6S", "PT6S", "PT3S", "PT1M", "P1D"],
                ["PT0S", "-PT1S", "P999999999D", 10**12, 86_401, "P9000Y", self.duration()],
                wild,
            ),
            "heartbeat_interval": either(["PT2S", "PT1M"], [self.duration()], wild),
            "replacement_ready_timeout": either(["PT1M"], [self.duration()], wild),
            "task_poll_interval": either(["PT1S"], [self.duration()], wild),
            "permit_reclaim_interval": either(["PT2S"], [self.duration()], wild),
            "liveness_shards": either([1, 1, 2, MAX_LIVENESS_SHARDS], [MAX_LIVENESS_SHARDS + 1, 0, -1, None], wild),
        }

    def liveness_template(self, name: str) -> dict[str, Any]:
        """The tracker's three signals and the tracker's one to a health workflow; some of them wild."""
        ids, either, wild = self.ids, self.either, self.rng.random() < 0.4
        if name == names.SIGNAL_LIVENESS:
            return {
                "instance_id": either([ids.health_instance], ["i-someone-else", "", self.text()], wild),
                "lost": either([True, False], ["yes", 1, None, "lost"], wild),
                "last_heard": either([None, self.liveness_time(wild)], [self.timestamp()], wild),
                "threshold": either([None, "PT6S", "P1D"], [self.duration()], wild),
            }
        if name == names.SIGNAL_LIVENESS_REPORT:
            return {
                "group": either([ids.liveness_group], [ids.health_group, "", "x" * 257, self.text()], wild),
                # The tracker of shard 0 of 1, told of other shards: a shard out of range is still a valid batch.
                "shard": either([0, 0, 0, 1, MAX_LIVENESS_SHARDS - 1], [MAX_LIVENESS_SHARDS, -1, 2**63, None], wild),
                "shards": either([1, 1, 1, 2, MAX_LIVENESS_SHARDS], [MAX_LIVENESS_SHARDS + 1, 0, -1, None], wild),
                "reporter": either(
                    ["ingest-a", "ingest-a", "ingest-b", f"probe-{self.rng.randrange(100)}", "x" * 128],
                    ["", "x" * 129, self.text()[:200]],
                    wild,
                ),
                "at": self.liveness_time(wild),
                # A day is the most a reporter may promise; a reporter that does holds every loss for a day, until it
                # promises less again.
                "report_every": either(
                    ["PT2S", "PT2S", "PT2S", "PT4S", "PT6S", "PT30S", 3, 0.001, self.pick(["P1D", "PT2S"])],
                    ["PT24H0.000001S", "PT0S", 0, -5, "-PT1S", 10**12, "P9000Y", self.duration()],
                    wild,
                ),
                # Relays that go quiet hold every loss (a silent pipeline); probes signalling directly do not.
                "relay": either([True, False], [None, "maybe", 2], wild),
                "heard": self.heard(wild),
            }
        if name == names.SIGNAL_IGNORE_HEARTBEATS:
            return {"instance_id": self.instance(wild), "until": self.liveness_time(wild)}
        return self.capacity_group(wild)

    # --- model-shaped payloads -----------------------------------------------------------------------------

    def template(self, name: str) -> dict[str, Any]:
        """A payload shaped like the real model of a real signal, with values from valid to out of range."""
        ids, pick = self.ids, self.pick
        if name == names.SIGNAL_GPU_FINDING:
            code = pick([79, 13, 31, 48, 94, 95, 119, None, -1, 0, 2**70])
            return {
                "finding_id": pick([f"fz-{self.rng.randrange(10**9)}", "fz-dup", self.text()]),
                "instance_id": pick([ids.health_instance] * 4 + ["i-someone-else", ""]),
                "group": pick([ids.health_group] * 4 + [ids.semaphore_group, ""]),
                "kind": pick(
                    ["xid", "xid", "sxid", "gpu_fallen_off_bus", "nvml", "dcgm", "daemon", "daemon_recovered"]
                ),
                "code": code,
                "reason": pick([f"XID_{code}", "XID_79", "DAEMON_nvidia-fabricmanager", "DAEMON_nvidia-dcgm", ""]),
                "impairs": self.rng.random() < 0.3,
                "rule": pick(["", "ecs", self.text()]),
                "source": pick(["kmsg", "nvml", "dcgm", "daemons", ""]),
                "gpu": {
                    "pci": pick(["0000:9b:00", "0000:00:00", None, "", self.text()]),
                    "uuid": pick([None, "GPU-0d9c0b3a-0000-0000-0000-000000000000", self.text()]),
                    "mig_gpu_instance": pick([None, 0, 7, -1, 2**40]),
                    "mig_compute_instance": pick([None, 0, 3, -1]),
                },
                "message": pick(["", "GPU has fallen off the bus", self.text()]),
                "raw": pick(["NVRM: Xid (PCI:0000:9b:00): 79, pid=1, name=python3", self.text()]),
                "count": self.count(),
                "observed_at": self.timestamp(),
            }
        if name == names.SIGNAL_HEARTBEAT:
            sources = [
                {
                    "name": pick(["kmsg", "nvml", "dcgm", "daemons", self.text()]),
                    "state": pick(["OK", "INSUFFICIENT_DATA", "IMPAIRED", "INITIALIZING", "ok", "BROKEN", None]),
                    "reason": pick([None, "NVML: driver not loaded", self.text()]),
                    "gpu_source": pick([True, False, "no", None]),
                }
                for _ in range(self.rng.choice([0, 1, 3, 4, 32, 33, 100]))
            ]
            return {
                "instance_id": pick([ids.health_instance] * 5 + ["i-someone-else", ""]),
                "group": pick([ids.health_group] * 4 + [ids.semaphore_group, ""]),
                "sent_at": self.timestamp(),
                "gpu_health": pick(["OK", "OK", "INSUFFICIENT_DATA", "IMPAIRED", "INITIALIZING", "ok", "BROKEN"]),
                "gpu_health_reason": pick([None, "NVML: driver not loaded", self.text()]),
                "sources": sources,
            }
        if name == names.SIGNAL_REPAIR_PROGRESS:
            return {
                "workflow_id": pick([repair_workflow_id(ids.health_instance), "repair/i-ghost", self.text()]),
                "phase": pick([*(p.value for p in RepairPhase), "completed", "Done", 3, None]),
                "replacement_instance_id": pick([None, "i-0replacement", self.text()]),
                "error": pick([None, "boom", self.text()]),
                "finished": pick([True, False, "yes", 1, None]),
            }
        if name == names.SIGNAL_INJECT_HEARTBEAT_LOSS:
            return {"duration": self.duration(), "requested_by": pick(["", "fuzz", self.text()])}
        if name == names.SIGNAL_REQUEST:
            return {
                "holder_workflow_id": self.holder(),
                "holder_run_id": pick([None, "0195c0de-0000-7000-8000-000000000000", self.text()]),
                "instance_id": pick(["", "i-ghost", self.text()]),
                "requested_at": self.timestamp(),
            }
        if name == names.SIGNAL_RELEASE:
            return {"holder_workflow_id": self.holder()}
        if name == names.SIGNAL_PERMIT_GRANTED:
            grant = {
                "group": pick([ids.repair_group, ids.semaphore_group, ids.health_group, "", self.text()]),
                "holder_workflow_id": pick([ids.repair_id, self.holder(), self.holder()]),
                "granted_at": self.timestamp(),
            }
            if grant["group"] == ids.repair_group and grant["holder_workflow_id"] == ids.repair_id:
                # The one grant that names both the right group and the right holder is what the semaphore itself
                # sends: not a forgery, so never sent here.
                grant["holder_workflow_id"] = "repair/i-forged"
            return grant
        if name in LIVENESS_SIGNALS:
            return self.liveness_template(name)
        return {self.text()[:30]: self.value(1) for _ in range(self.rng.randint(1, 4))}

    def mutated(self, model: dict[str, Any]) -> dict[str, Any]:
        """Wrong types, missing and extra fields (including would-be authentication tokens)."""
        out: dict[str, Any] = {}
        for key, val in model.items():
            roll = self.rng.random()
            if roll < 0.12:
                continue
            if roll < 0.3:
                out[key] = self.value(2)
            elif isinstance(val, dict) and roll < 0.4:
                out[key] = self.mutated(val)
            else:
                out[key] = val
        for _ in range(self.rng.choice([0, 0, 0, 1, 2])):
            out[self.pick(["token", "auth_token", "signal_token", "__class__", "carry", self.text()[:20]])] = (
                self.value(2)
            )
        return out

    def payload(self, name: str) -> dict[str, Any]:
        model = self.template(name if name in REAL_SIGNALS else self.pick(REAL_SIGNALS))
        return self.mutated(model) if self.rng.random() < 0.6 else model

    # --- whole signals -----------------------------------------------------------------------------------------

    def name(self, own: list[str]) -> str:
        roll = self.rng.random()
        if roll < 0.55:
            return self.pick(own)
        if roll < 0.8:
            return self.pick(REAL_SIGNALS)
        return self.pick(
            [
                self.text()[:200] or "x",
                self.pick(own).upper(),
                self.pick(own) + " ",
                "__stack_trace",
                "__temporal_workflow_metadata",
                "health",
                "state",
                "status",
                "update_group",
                "group_config",
                names.UPDATE_EXCLUDE_INSTANCE,
                names.UPDATE_REPAIR_INSTANCE,
                names.UPDATE_WITHDRAW_REPAIR,
            ]
        )

    def args(self, name: str) -> list[Any]:
        roll = self.rng.random()
        if roll < 0.08:
            return []
        if roll < 0.16:
            return [
                self.payload(name) if self.rng.random() < 0.5 else self.value() for _ in range(self.rng.randint(2, 4))
            ]
        if roll < 0.22:
            return [None]
        if roll < 0.5:
            return [self.value()]
        return [self.payload(name)]

    def large(self, name: str, kind: str) -> list[Any]:
        """One payload of 1.5-1.9 MB of JSON: a string, a list, or a real model with one huge string field."""
        target = self.rng.randint(*LARGE_BYTES)
        if kind == "string":
            return [self.rng.choice(string.ascii_letters) * (target - 2)]
        if kind == "list":
            return [[self.rng.randrange(10) for _ in range(target // 2)]]
        model = self.template(name)
        fields = [key for key, val in model.items() if isinstance(val, str) or val is None] or list(model)
        key = self.pick(fields)
        model[key] = ""
        rest = len(json.dumps(model))
        model[key] = self.rng.choice(string.ascii_letters) * (target - rest)
        return [model]

    def signals(self, own: list[str]) -> list[Signal]:
        large_at = dict(
            zip(
                self.rng.sample(range(SIGNALS_PER_WORKFLOW), LARGE_PER_WORKFLOW),
                ["string", "list", "model", "model"],
                strict=True,
            )
        )
        out = []
        for index in range(SIGNALS_PER_WORKFLOW):
            if index in large_at:
                name = self.pick(own)
                out.append(Signal(index, name, self.large(name, large_at[index]), large=True))
            else:
                name = self.name(own)
                out.append(Signal(index, name, self.args(name)))
        return out


# --- the workflows under test ------------------------------------------------------------------------------------


@dataclass
class Target:
    label: str
    workflow_id: str
    first_run_id: str
    query: str
    view: type[BaseModel]
    # Beyond running and answering: what the view must show (None: fine).
    check_view: Callable[[Any], str | None] = lambda _: None
    # What the summary says of the view.
    describe: Callable[[Any], str] = lambda view: f"rejected_signals={getattr(view, 'rejected_signals', '?')}"
    send_errors: Counter[str] = field(default_factory=Counter)
    send_error_examples: dict[str, str] = field(default_factory=dict)


async def send_all(client: Client, target: Target, signals: list[Signal], gate: asyncio.Semaphore) -> None:
    handle = client.get_workflow_handle(target.workflow_id)  # no run id: the latest run, across continue-as-new

    async def send(signal: Signal) -> None:
        async with gate:
            try:
                await handle.signal(signal.name, args=signal.args, rpc_timeout=timedelta(seconds=30))
            except Exception as err:  # refused by the client or the server: counted, not a workflow failure
                status = err.status.name if isinstance(err, RPCError) else type(err).__name__
                key = f"{status}: {str(err).splitlines()[0][:160] if str(err) else ''}"
                target.send_errors[key] += 1
                target.send_error_examples.setdefault(key, signal.describe())

    small = [signal for signal in signals if not signal.large]
    pace = True
    for start in range(0, len(small), BATCH):
        await asyncio.gather(*(send(signal) for signal in small[start : start + BATCH]))
        if pace:
            # Once it is closed or its workflow task keeps failing there is nothing to wait for: send the rest.
            state = await settle(client, target.workflow_id, quiet_polls=1, every=0.1, within=15, stuck_attempt=2)
            pace = state == "settled"
    # The near-limit ones one at a time, each once the workflow is idle: the server buffers the signals that arrive
    # while a workflow task runs, at most 2 MB of them, and force-closes the running task when that overflows.
    for signal in signals:
        if signal.large:
            if pace:
                pace = await settle(client, target.workflow_id, stuck_attempt=2) == "settled"
            await send(signal)


async def settle(
    client: Client,
    workflow_id: str,
    *,
    quiet_polls: int = 3,
    every: float = 0.5,
    within: float = SETTLE_WITHIN,
    stuck_attempt: int = 3,
) -> str:
    """Wait until the latest run has no workflow task left to do (or one that keeps failing), or has closed."""
    handle = client.get_workflow_handle(workflow_id)
    deadline = time.monotonic() + within
    quiet = 0
    while time.monotonic() < deadline:
        description = await handle.describe()
        if description.status != WorkflowExecutionStatus.RUNNING:
            return f"closed ({description.status.name if description.status else '?'})"
        raw = description.raw_description
        if raw.HasField("pending_workflow_task"):
            if raw.pending_workflow_task.attempt >= stuck_attempt:
                return f"stuck: workflow task attempt {raw.pending_workflow_task.attempt}"
            quiet = 0
        else:
            quiet += 1
            if quiet >= quiet_polls:
                return "settled"
        await asyncio.sleep(every)
    return f"still busy after {within:.0f}s"


def _signal_text(event: HistoryEvent) -> str:
    attrs = event.workflow_execution_signaled_event_attributes
    payloads = []
    for payload in attrs.input.payloads:
        data = payload.data.decode("utf-8", "replace")
        payloads.append(data if len(data) <= 240 else f"{data[:240]}... ({len(data):,} bytes)")
    return f"{attrs.signal_name!r} [{', '.join(payloads)}]"


def _close_details(event: HistoryEvent) -> str:
    """What the run closed with: its result, failure or termination reason, cut short."""
    if event.HasField("workflow_execution_completed_event_attributes"):
        payloads = event.workflow_execution_completed_event_attributes.result.payloads
        text = " ".join(p.data.decode("utf-8", "replace") for p in payloads)
    elif event.HasField("workflow_execution_failed_event_attributes"):
        text = event.workflow_execution_failed_event_attributes.failure.message
    elif event.HasField("workflow_execution_terminated_event_attributes"):
        text = event.workflow_execution_terminated_event_attributes.reason
    else:
        text = ""
    return text if len(text) <= 600 else f"{text[:600]}..."


async def check_history(client: Client, target: Target) -> tuple[list[str], int, Counter[str]]:
    """Every run from the first, following continue-as-new: each WorkflowTaskFailed and each close other than
    continue-as-new, with the signals the workflow task before it handled."""
    problems: list[str] = []
    retried: Counter[str] = Counter()
    run_id: str | None = target.first_run_id
    runs = 0
    while run_id is not None and runs < 500:
        runs += 1
        history = await client.get_workflow_handle(target.workflow_id, run_id=run_id).fetch_history()
        pending: list[str] = []  # signals since the last completed workflow task
        recent: deque[str] = deque(maxlen=12)  # the last signals, whichever task handled them
        reported = 0
        for event in history.events:
            kind = event.event_type
            if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                pending.append(_signal_text(event))
                recent.append(pending[-1])
            elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                pending = []
            elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                attrs = event.workflow_task_failed_event_attributes
                cause = WorkflowTaskFailedCause.Name(attrs.cause).removeprefix("WORKFLOW_TASK_FAILED_CAUSE_")
                if attrs.cause in SERVER_RETRIED:
                    retried[cause] += 1
                    continue
                stack = attrs.failure.stack_trace.strip().splitlines()[-4:]
                reported += 1
                if reported <= 5:
                    problems.append(
                        f"WorkflowTaskFailed (run {run_id}, event {event.event_id}, {cause}): "
                        f"{attrs.failure.message}\n      at: {' | '.join(s.strip() for s in stack)}"
                        + "".join(f"\n      signal: {s}" for s in pending[-8:])
                    )
            elif kind in CLOSED_EVENTS:
                problems.append(
                    f"closed: {CLOSED_EVENTS[kind]} (run {run_id}, event {event.event_id}): {_close_details(event)}"
                    + "".join(f"\n      after signal: {s}" for s in recent)
                )
        if reported > 5:
            problems.append(f"... and {reported - 5} more WorkflowTaskFailed in run {run_id}")
        last = history.events[-1] if history.events else None
        if last is not None and last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
            run_id = last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
        else:
            run_id = None
    return problems, runs, retried


async def check_workflow(client: Client, target: Target, settled: str) -> tuple[list[str], str]:
    problems, runs, retried = await check_history(client, target)
    handle = client.get_workflow_handle(target.workflow_id)
    description = await handle.describe()
    # All four must still be running. None of the signals sent could legitimately close one: the health workflow's
    # group has auto repair DISABLED, so no repair of its instance exists and every repair_progress it got was
    # forged (a forged "Completed" must not retire it); the semaphore never closes; the repair waits behind a
    # permit that is never given up, and no permit_granted it got names both its group and itself; the liveness
    # tracker only ever continues as new.
    if description.status != WorkflowExecutionStatus.RUNNING:
        problems.append(f"not running: {description.status.name if description.status else '?'}")
    summary = f"{runs} runs, {settled}, {sum(target.send_errors.values())} signals refused at send"
    if retried:
        summary += f", workflow tasks failed by the server and retried: {dict(retried)}"
    try:
        async with asyncio.timeout(QUERY_WITHIN + 1):
            view = await handle.query(
                target.query, result_type=target.view, rpc_timeout=timedelta(seconds=QUERY_WITHIN)
            )
    except Exception as err:
        problems.append(f"query {target.query!r} not answered within {QUERY_WITHIN:.0f}s: {type(err).__name__}: {err}")
    else:
        if not isinstance(view, target.view):
            problems.append(f"query {target.query!r} answered {type(view).__name__}, not {target.view.__name__}")
        elif (wrong := target.check_view(view)) is not None:
            problems.append(wrong)
        else:
            summary += f", {target.describe(view)}"
    return problems, summary


def _tracker_of(group: str) -> Callable[[LivenessView], str | None]:
    def check(view: LivenessView) -> str | None:
        if view.group != group or view.window_s is None:
            return f"liveness tracker answers for group {view.group!r} (window {view.window_s}), not {group!r}"
        return None

    return check


def _describe_tracker(view: LivenessView) -> str:
    return (
        f"rejected_signals={view.rejected_signals}, instances={view.instances}, lost={len(view.lost)}, "
        f"declared_lost={view.declared_lost}, recovered={view.recovered}, forgotten={view.forgotten}, "
        f"dropped_instances={view.dropped_instances}, reporters={len(view.reporters)}, window_s={view.window_s}"
    )


def _repair_still_waiting(view: RepairStatus) -> str | None:
    if view.phase is not RepairPhase.WAITING_FOR_PERMIT:
        return f"repair left {RepairPhase.WAITING_FOR_PERMIT.value} for {view.phase.value} without a real permit"
    return None


# --- the test --------------------------------------------------------------------------------------------------


async def test_random_signals_never_wedge_a_workflow(client: Client, aws_env: str, tmp_path: Path) -> None:
    """1,000 random signals to each workflow type: no workflow task fails, each keeps running and answering."""
    seed = int(os.environ.get("AUTOREPAIR_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
    print(f"\nsignal fuzz seed: {seed} (AUTOREPAIR_FUZZ_SEED={seed} replays these signals)")
    rng = random.Random(seed)

    health_group, semaphore_group, repair_group = unique("g-health"), unique("g-sem"), unique("g-repair")
    liveness_group = unique("g-live")
    ids = Ids(
        health_instance=unique("i-fuzz-health"),
        health_group=health_group,
        semaphore_group=semaphore_group,
        repair_instance=unique("i-fuzz-repair"),  # not in ECS: a repair that got past its permit would fail
        repair_group=repair_group,
        liveness_group=liveness_group,
    )
    base = make_settings(
        client,
        aws_env,
        tmp_path / "events.jsonl",
        group=health_group,
        cluster=health_group,
        # Monitor only: whatever the fuzz does to its health, the instance is never repaired, so there is no
        # real repair whose progress could legitimately retire the health workflow.
        auto_repair=AutoRepair.DISABLED,
    )
    health_settings = base.groups[0]
    settings = base.model_copy(
        update={
            "groups": [
                health_settings,
                health_settings.model_copy(
                    update={"name": semaphore_group, "cluster": semaphore_group, "auto_repair": AutoRepair.ENABLED}
                ),
                health_settings.model_copy(
                    update={"name": repair_group, "cluster": repair_group, "auto_repair": AutoRepair.ENABLED}
                ),
                # The tracker reads its group's threshold (6 s: a window of 6 s and 2 s of grace) when it starts.
                health_settings.model_copy(update={"name": liveness_group, "cluster": liveness_group}),
            ]
        }
    )
    # The semaphores count their group's instances in ECS before a grant; a missing cluster is a permanent error.
    ecs = boto3.client("ecs", endpoint_url=aws_env, region_name="us-east-1")
    for group in (semaphore_group, repair_group):
        ecs.create_cluster(clusterName=group)

    fuzzer = SignalFuzzer(rng, ids)
    health_signals = fuzzer.signals(
        [
            names.SIGNAL_GPU_FINDING,
            names.SIGNAL_HEARTBEAT,
            names.SIGNAL_REPAIR_PROGRESS,
            names.SIGNAL_INJECT_HEARTBEAT_LOSS,
            names.SIGNAL_LIVENESS,
        ]
    )
    semaphore_signals = fuzzer.signals([names.SIGNAL_REQUEST, names.SIGNAL_RELEASE])
    repair_signals = fuzzer.signals([names.SIGNAL_PERMIT_GRANTED])
    # Batches twice as often: they are what the tracker's state is made of.
    liveness_signals = fuzzer.signals(
        [
            names.SIGNAL_LIVENESS_REPORT,
            names.SIGNAL_LIVENESS_REPORT,
            names.SIGNAL_IGNORE_HEARTBEATS,
            names.SIGNAL_GROUP_CHANGED,
        ]
    )

    task_queue = settings.temporal.task_queue
    started: list[str] = []
    async with running_worker(settings, client):
        try:
            # The health workflow, started as the probe starts it: signal-with-start with a first heartbeat.
            health_id = health_workflow_id(ids.health_instance)
            await Reporter(client).send_heartbeat(
                Heartbeat(instance_id=ids.health_instance, group=health_group, sent_at=datetime.now(UTC)), task_queue
            )
            started.append(health_id)
            health = client.get_workflow_handle(health_id)
            health_first_run = (await health.describe()).run_id
            await eventually(
                lambda: health.query(names.QUERY_HEALTH, result_type=InstanceHealthView),
                lambda v: v.healthStatus.overallStatus is HealthState.OK,
                within=30,
            )

            semaphore_id = semaphore_workflow_id(semaphore_group)
            semaphore: WorkflowHandle = await client.start_workflow(
                names.SEMAPHORE_WORKFLOW, SemaphoreInput(group=semaphore_group), id=semaphore_id, task_queue=task_queue
            )
            started.append(semaphore_id)

            # The repair's group semaphore starts with its one permit held by itself (a holder that is always
            # running, so never reclaimed): the repair asks, waits, and is never granted.
            blocker_id = semaphore_workflow_id(repair_group)
            await client.start_workflow(
                names.SEMAPHORE_WORKFLOW,
                SemaphoreRun(
                    group=repair_group,
                    holders=[
                        Permit(holder_workflow_id=blocker_id, instance_id="fuzz-blocker", since=datetime.now(UTC))
                    ],
                ),
                id=blocker_id,
                task_queue=task_queue,
            )
            started.append(blocker_id)
            repair: WorkflowHandle = await client.start_workflow(
                names.REPAIR_WORKFLOW,
                RepairInput(instance_id=ids.repair_instance, group=repair_group, reason="signal fuzz"),
                id=ids.repair_id,
                task_queue=task_queue,
            )
            started.append(ids.repair_id)
            blocker = client.get_workflow_handle(blocker_id)
            await eventually(
                lambda: blocker.query(names.QUERY_STATE, result_type=SemaphoreView),
                lambda v: [w.holder_workflow_id for w in v.waiters] == [ids.repair_id],
                within=30,
            )

            # The liveness tracker, started as the relay starts it but without a first batch: it reads its group.
            liveness_id = liveness_workflow_id(liveness_group)
            liveness: WorkflowHandle = await client.start_workflow(
                names.LIVENESS_WORKFLOW, LivenessRun(group=liveness_group), id=liveness_id, task_queue=task_queue
            )
            started.append(liveness_id)
            await eventually(
                lambda: liveness.query(names.QUERY_LIVENESS, result_type=LivenessView),
                lambda v: v.window_s is not None,
                within=30,
            )

            targets = [
                Target(
                    "health",
                    health_id,
                    health_first_run,
                    names.QUERY_HEALTH,
                    InstanceHealthView,
                ),
                Target(
                    "semaphore", semaphore_id, semaphore.first_execution_run_id or "", names.QUERY_STATE, SemaphoreView
                ),
                Target(
                    "repair",
                    ids.repair_id,
                    repair.first_execution_run_id or "",
                    names.QUERY_STATUS,
                    RepairStatus,
                    check_view=_repair_still_waiting,
                ),
                Target(
                    "liveness",
                    liveness_id,
                    liveness.first_execution_run_id or "",
                    names.QUERY_LIVENESS,
                    LivenessView,
                    check_view=_tracker_of(liveness_group),
                    describe=_describe_tracker,
                ),
            ]
            plan = {
                "health": health_signals,
                "semaphore": semaphore_signals,
                "repair": repair_signals,
                "liveness": liveness_signals,
            }
            began = time.monotonic()
            gate = asyncio.Semaphore(IN_FLIGHT)
            unsent = None
            try:
                async with asyncio.timeout(SEND_WITHIN):
                    await asyncio.gather(*(send_all(client, t, plan[t.label], gate) for t in targets))
            except TimeoutError:
                unsent = f"sending did not finish within {SEND_WITHIN:.0f}s (signal RPCs or the workflows too slow)"
            sent_in = time.monotonic() - began
            await asyncio.sleep(TRACKER_TIMERS)
            settled = await asyncio.gather(*(settle(client, t.workflow_id) for t in targets))
            print(
                f"sent {len(targets) * SIGNALS_PER_WORKFLOW} signals in {sent_in:.1f}s, "
                f"settled in {time.monotonic() - began:.1f}s"
            )

            report: list[str] = [unsent] if unsent else []
            failed = unsent is not None
            for target, state in zip(targets, settled, strict=True):
                problems, summary = await check_workflow(client, target, state)
                failed = failed or bool(problems)
                report.append(f"{target.label} ({target.workflow_id}): {summary}")
                report += [f"  - {p}" for p in problems]
                for key, n in target.send_errors.most_common(5):
                    report.append(f"  (refused at send x{n}: {key}; e.g. {target.send_error_examples[key]})")
            print("\n".join(report))
            assert not failed, f"seed {seed}:\n" + "\n".join(report)
        finally:
            for workflow_id in started:
                with contextlib.suppress(RPCError):
                    await client.get_workflow_handle(workflow_id).terminate("signal fuzz over")
