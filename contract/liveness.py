"""Liveness that costs almost nothing: reporters (the ingest, or a trusted-lab probe) tell a group's liveness
tracker when they last heard each instance, in batches; the tracker tells a health workflow only of a loss or a
recovery.

The timing rules live here, once, because both sides depend on them:
- A reporter sends each (group, shard) it has heard of a batch at least every `report_every` (even an empty one: a
  keepalive, so that the tracker can tell a silent pipeline from silent hosts), and sends an instance's newest
  receipt time no later than `report_every` after the one it last sent for it.
- The tracker declares an instance lost `grace` after max(threshold, report_every) has passed since the last
  receipt it knows of. With report_every <= threshold, a later receipt always reaches it before that.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Annotated, Final

from pydantic import BaseModel, Field

from contract.limits import Id, Name, Text, Timestamp

# One shard of a group's tracker holds at most this many instances (its carried state stays far under Temporal's
# 2 MB payload limit: about 40 bytes each). A larger group sets `liveness_shards`.
MAX_INSTANCES_PER_SHARD: Final = 20_000
MAX_LIVENESS_SHARDS: Final = 256
# Instance ids in one batch signal: a shard's whole membership fits in one.
MAX_BATCH: Final = MAX_INSTANCES_PER_SHARD
LivenessShards = Annotated[int, Field(ge=1, le=MAX_LIVENESS_SHARDS)]


def report_every(threshold: timedelta, heartbeat_interval: timedelta) -> timedelta:
    """How often a reporter tells the tracker about an instance it keeps hearing: two heartbeats short of the
    group's threshold (the fewer batches, the cheaper), but never more than half of it, so a live halving of the
    threshold still keeps losses exact."""
    return max(threshold / 2, threshold - 2 * heartbeat_interval)


def loss_grace(threshold: timedelta) -> timedelta:
    """The room after a deadline for the last batch to arrive: a quarter of the threshold, 2 s to 15 s."""
    return min(max(threshold / 4, timedelta(seconds=2)), timedelta(seconds=15))


def flush_tick(every: timedelta) -> timedelta:
    """How often a reporter looks for batches that are due: well inside the tracker's grace."""
    return min(max(every / 10, timedelta(seconds=0.2)), timedelta(seconds=5))


def shard_of(instance_id: str, shards: int) -> int:
    """Stable across processes and versions (Python's hash() is salted per process)."""
    if shards <= 1:
        return 0
    return int.from_bytes(hashlib.sha256(instance_id.encode()).digest()[:8], "big") % shards


class LivenessReport(BaseModel):
    """One reporter's batch for one shard of a group: who it heard, and when (seconds before `at`, its clock)."""

    group: Id
    shard: int = Field(default=0, ge=0, lt=MAX_LIVENESS_SHARDS)
    shards: LivenessShards = 1
    reporter: Name = Field(min_length=1, description="One process: a new id after each restart")
    at: Timestamp
    report_every: timedelta = Field(gt=timedelta(0), le=timedelta(days=1))
    # A relay (the ingest) speaks for many hosts and keeps reporting while they are silent, so its own silence means
    # the pipeline is down. A probe signalling directly (trusted lab) speaks for itself: its silence is its loss.
    relay: bool = True
    # instance id -> whole seconds between its last receipt and `at`; compact, since a batch may hold a shard's all.
    heard: dict[Id, Annotated[int, Field(ge=0, le=86_400)]] = Field(default_factory=dict, max_length=MAX_BATCH)


class LivenessChange(BaseModel):
    """The tracker to one health workflow: the agent is lost (no receipt since `last_heard`) or heard again."""

    instance_id: Id
    lost: bool
    last_heard: Timestamp | None = None
    threshold: timedelta | None = None
    # Set when the lost instance left on purpose (EC2 says terminated, by someone other than a repair): retire.
    gone: Text | None = None
    # Gone for good (terminated, a Spot interruption, its Capacity Block ending): the health workflow completes.
    # Otherwise (stopped, in standby, detached, deregistered) it may come back: the health workflow stays, dormant,
    # until it is heard from again.
    for_good: bool = True


class LivenessInput(BaseModel):
    """What starts `liveness/<group>[/<shard>of<shards>]` (a reporter's signal-with-start)."""

    group: Id
    shard: int = Field(default=0, ge=0, lt=MAX_LIVENESS_SHARDS)
    shards: LivenessShards = 1


class RecheckLoss(BaseModel):
    """From a health workflow to its tracker: an operator cleared the instance's heartbeat loss, or let its held
    repair go (`--resume --discard-held`). A loss the tracker declared is forgotten and the silence is judged
    afresh from now: still silent after a full window, it is lost again."""

    instance_id: Id


class IgnoreHeartbeats(BaseModel):
    """Game day, from the instance's health workflow to its tracker: ignore this instance's receipts until then."""

    instance_id: Id
    until: Timestamp
    # The game day's start: the silence counts from here, as if the probe had stopped then.
    since: Timestamp | None = None
