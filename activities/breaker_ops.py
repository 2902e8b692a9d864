"""Activities of the breaker: what its workflows cannot do from inside (signal-with-start the semaphore or the fleet
breaker, which may not be running yet; read the fleet's rule from the worker's settings; ask the fleet breaker
whether it holds)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowQueryRejectedError
from temporalio.common import QueryRejectCondition, WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from activities.models import FleetReports
from activities.semaphore_start import start_drain_semaphore
from contract import names
from contract.breaker import (
    FleetBreakerConfig,
    FleetBreakerInput,
    FleetBreakerView,
    FleetHoldAnswer,
    FleetHoldQuery,
    ImpairmentReport,
)
from contract.concurrency import gather_at_most
from contract.ids import fleet_breaker_workflow_id

QUERY_TIMEOUT = timedelta(seconds=10)
# Signal-with-starts in flight at once from one batch of fleet reports.
REPORTS_IN_FLIGHT = 16


class BreakerOps:
    def __init__(self, client: Client, task_queue: str, fleet: FleetBreakerConfig) -> None:
        self._client = client
        self._task_queue = task_queue
        self._fleet = fleet

    def activities(self) -> list[Callable[..., Any]]:
        """The bound activity methods, for `Worker(activities=...)`."""
        return [
            self.report_impairment,
            self.report_to_fleet_breaker,
            self.report_many_to_fleet_breaker,
            self.fleet_breaker_config,
            self.fleet_hold,
        ]

    @activity.defn
    async def report_impairment(self, report: ImpairmentReport) -> None:
        """Tell the group's semaphore (starting it if need be) that an instance became IMPAIRED."""
        await start_drain_semaphore(self._client, self._task_queue, report.group, names.SIGNAL_IMPAIRED, [report])

    @activity.defn
    async def report_to_fleet_breaker(self, report: ImpairmentReport) -> None:
        """Pass a group's impairment on to the fleet breaker (starting it if need be)."""
        await self._to_fleet_breaker(report)

    @activity.defn
    async def report_many_to_fleet_breaker(self, batch: FleetReports) -> None:
        """Pass a surge's impairments on together: one activity on the semaphore's history, not one each. Each is
        still a signal of its own (the fleet breaker's wire is unchanged); a retry sends them all again, and the
        fleet breaker counts an instance's impairment once."""
        await gather_at_most(REPORTS_IN_FLIGHT, (self._to_fleet_breaker(report) for report in batch.reports))

    async def _to_fleet_breaker(self, report: ImpairmentReport) -> None:
        await self._client.start_workflow(
            names.FLEET_BREAKER_WORKFLOW,
            FleetBreakerInput(),
            id=fleet_breaker_workflow_id(self._task_queue),
            task_queue=self._task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal=names.SIGNAL_IMPAIRED,
            start_signal_args=[report],
            static_summary="fleet-wide breaker across every capacity group",
        )

    @activity.defn
    async def fleet_breaker_config(self) -> FleetBreakerConfig:
        # An activity, not a constant: the settings may change between worker deploys.
        return self._fleet

    @activity.defn
    async def fleet_hold(self, query: FleetHoldQuery) -> FleetHoldAnswer:
        """Whether the fleet breaker holds repairs now: a semaphore asks when it starts, in case it missed the
        notice (it was not running when the fleet breaker tripped). No fleet breaker running: nothing held."""
        handle = self._client.get_workflow_handle(fleet_breaker_workflow_id(self._task_queue))
        try:
            view = await handle.query(
                names.QUERY_FLEET_BREAKER,
                result_type=FleetBreakerView,
                reject_condition=QueryRejectCondition.NOT_OPEN,
                rpc_timeout=QUERY_TIMEOUT,
            )
        except WorkflowQueryRejectedError:
            return FleetHoldAnswer()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return FleetHoldAnswer()
            raise
        return FleetHoldAnswer(held=view.held)
