"""Looking at a simulated fleet: what AWS and the simulator know of it (`FleetWorld`), and that with the engine's view
of each instance's health added (`FleetSnapshot`, what the demo's summary and judge read).

The two halves come from different places on purpose: the world from the simulator (in the demo's process, or in
`autorepair sim`'s, over its control endpoint), the health from Temporal, which the simulator never talks to when it
runs as a process of its own (its probes report through the ingest, as real hosts do).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from pydantic import BaseModel
from temporalio.client import Client
from temporalio.common import SearchAttributeKey

from contract import names
from contract import search_attributes as sa
from contract.health import HealthState
from contract.ids import health_workflow_id
from contract.repair import RepairPhase
from workflows.models import InstanceHealthView

log = logging.getLogger(__name__)

E = TypeVar("E", HealthState, RepairPhase)


class FleetWorld(BaseModel):
    """AWS's view (EC2, ECS) of the group and the simulator's own lists of its nodes."""

    ec2_states: dict[str, int]
    container_active: int
    container_draining: int
    running_tasks: int
    live: list[str]  # booted, not terminated: the instances whose health the engine should know
    initial_instances: list[str]
    replacements_running: list[str]
    terminated: list[str]
    booting: list[str]
    probe_errors: dict[str, str]
    probes: str = "real"  # "real": the node probe per instance; "stand-in": simulator.probe_standin


class FleetSnapshot(BaseModel):
    """What a live summary shows: AWS's view (EC2, ECS) and the engine's view (health workflows)."""

    taken_at: datetime
    ec2_states: dict[str, int]
    container_active: int
    container_draining: int
    running_tasks: int
    # Running, registered instances -> overall health from the health workflow (None: no answer yet).
    health: dict[str, HealthState | None]
    repair_phase: dict[str, RepairPhase]
    retired: list[str]
    initial_instances: list[str]
    replacements_running: list[str]
    terminated: list[str]
    booting: list[str]
    probe_errors: dict[str, str]

    @classmethod
    def of(
        cls,
        world: FleetWorld,
        health: dict[str, HealthState | None],
        phases: dict[str, RepairPhase],
        retired: list[str] | None = None,
    ) -> FleetSnapshot:
        return cls(
            taken_at=datetime.now(UTC),
            health=health,
            repair_phase=phases,
            retired=retired or [],
            **world.model_dump(exclude={"live", "probes"}),
        )

    @property
    def running(self) -> int:
        return self.ec2_states.get("running", 0)

    def count(self, state: HealthState) -> int:
        return sum(1 for status in self.health.values() if status == state)

    @property
    def healthy(self) -> int:
        return self.count(HealthState.OK)

    @property
    def impaired(self) -> int:
        return self.count(HealthState.IMPAIRED)


async def snapshot_from_visibility(client: Client | None, group: str, world: FleetWorld) -> FleetSnapshot:
    """The world, with each live instance's health and repair phase from Temporal visibility (the HealthStatus and
    RepairPhase search attributes, one list each, whatever the fleet's size; a moment behind the workflows, and
    `retired` is not known there: always empty)."""
    statuses, repairs = await visibility(client, group)
    health: dict[str, HealthState | None] = {i: statuses.get(i) for i in world.live}
    phases = {i: phase for i, phase in repairs.items() if i in health}
    return FleetSnapshot.of(world, health, phases)


async def visibility(client: Client | None, group: str) -> tuple[dict[str, HealthState], dict[str, RepairPhase]]:
    """(instance -> overall health, instance -> repair phase) of the group's running health and repair workflows,
    from their search attributes; empty without a client or when visibility does not answer."""
    if client is None:
        return {}, {}
    try:
        statuses = await _running(client, group, names.HEALTH_WORKFLOW, sa.HEALTH_STATUS, HealthState)
        phases = await _running(client, group, names.REPAIR_WORKFLOW, sa.REPAIR_PHASE, RepairPhase)
    except Exception:
        log.warning("fleet-sim: visibility did not answer", exc_info=True)
        return {}, {}
    return statuses, phases


async def _running(
    client: Client, group: str, workflow_type: str, attribute: SearchAttributeKey[str], kind: type[E]
) -> dict[str, E]:
    """Instance -> `attribute` (as `kind`) of the group's running workflows of `workflow_type`."""
    found: dict[str, E] = {}
    query = (
        f"WorkflowType={sa.quoted(workflow_type)} AND {sa.CAPACITY_GROUP.name}={sa.quoted(group)} "
        "AND ExecutionStatus='Running'"
    )
    async for execution in client.list_workflows(query, page_size=1000):
        instance_id = execution.typed_search_attributes.get(sa.INSTANCE_ID)
        value = execution.typed_search_attributes.get(attribute)
        with contextlib.suppress(ValueError, TypeError):
            if instance_id:
                found[instance_id] = kind(str(value))
    return found


async def query_health(client: Client | None, instance_id: str) -> InstanceHealthView | None:
    """The health workflow's view of an instance; None when there is none to ask or it does not answer."""
    if client is None:
        return None
    handle = client.get_workflow_handle(health_workflow_id(instance_id))
    try:
        return await handle.query(names.QUERY_HEALTH, result_type=InstanceHealthView, rpc_timeout=timedelta(seconds=3))
    except Exception:
        # Not started yet (no heartbeat so far), or no worker to answer: unknown, not unhealthy.
        return None
