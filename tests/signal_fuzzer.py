"""The random signals of tests/test_signal_fuzz.py: names and payloads, all from one seeded generator.

Mostly the real signal names (`contract/names.py`), some random names; payloads from none to several, shaped like
the real models or not, with wrong types, missing or extra fields and out-of-range values; a few just under the
server's 2 MB payload limit. What the test does with them is in its own docstring.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from contract import names
from contract.ids import health_workflow_id, repair_workflow_id
from contract.liveness import MAX_BATCH, MAX_LIVENESS_SHARDS
from contract.repair import RepairPhase

SIGNALS_PER_WORKFLOW = 1_000
LARGE_PER_WORKFLOW = 4  # each 1.5-1.9 MB of JSON: under the server's 2 MB blob limit
LARGE_BYTES = (1_500_000, 1_900_000)

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
    names.SIGNAL_PERMIT_DENIED,
    names.SIGNAL_LAUNCH_OUTCOME,
    names.SIGNAL_AWS_STATUS,
    names.SIGNAL_RECHECK_LOSS,
]
LIVENESS_SIGNALS = {
    names.SIGNAL_LIVENESS,
    names.SIGNAL_LIVENESS_REPORT,
    names.SIGNAL_IGNORE_HEARTBEATS,
    names.SIGNAL_GROUP_CHANGED,
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
        if name == names.SIGNAL_LAUNCH_OUTCOME:
            # Never the holder's token: a forged outcome must change no AZ's launch health.
            return {
                "holder_workflow_id": self.holder(),
                "token": pick(["", "not-the-token", self.text()]),
                "availability_zone": pick(["us-east-1a", "", "x" * 300, self.text()]),
                "capacity_error": pick([True, False, "yes", None]),
            }
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
