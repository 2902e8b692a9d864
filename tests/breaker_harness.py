"""The long-lived scaffolding of tests/test_breaker_property.py: one event loop owning the time-skipping server, the
gRPC relay that notes the workers' sticky queues, the janitor that empties a dead worker's, and the two workers
(BreakerHarness); it runs one example at a time."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import uuid
from collections.abc import Callable, Iterator

import grpc
from temporalio.api.enums.v1 import QueryResultType, TaskQueueKind, WorkflowTaskFailedCause
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import (
    PollWorkflowTaskQueueRequest,
    RespondQueryTaskCompletedRequest,
    RespondWorkflowTaskFailedRequest,
)
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.workflow_ops import WorkflowOps
from simulator.servers import find_binary
from tests.breaker_example import Example, ExampleReport
from tests.breaker_schedules import Schedule
from tests.breaker_stubs import HOLDER_QUEUE_SUFFIX, StubActivities, StubRepair
from tests.harness import SERVER_STARTUP_TIMEOUT
from worker.main import SANDBOX
from workflows.drain_semaphore import DrainSemaphoreWorkflow

# --- the relay and the janitor (worker restarts on the test server) ----------------------------------------------

POLL_WORKFLOW_TASK = "/temporal.api.workflowservice.v1.WorkflowService/PollWorkflowTaskQueue"
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


class StickyRelay(grpc.GenericRpcHandler):
    """Passes the workers' calls through to the test server unchanged, telling of each sticky queue they poll."""

    def __init__(self, upstream: grpc.aio.Channel, tell: Callable[[str], None]) -> None:
        self._upstream = upstream
        self._tell = tell
        self._sticky_queues: set[str] = set()

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        call = self._upstream.unary_unary(method)

        async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if method == POLL_WORKFLOW_TASK:
                queue = PollWorkflowTaskQueueRequest.FromString(request).task_queue
                if queue.kind == TaskQueueKind.TASK_QUEUE_KIND_STICKY and queue.name not in self._sticky_queues:
                    self._sticky_queues.add(queue.name)
                    self._tell(queue.name)
            try:
                return await call(request, metadata=context.invocation_metadata(), timeout=context.time_remaining())
            except grpc.aio.AioRpcError as err:
                context.set_trailing_metadata(err.trailing_metadata() or ())
                await context.abort(err.code(), err.details() or "")
                raise  # abort raises; this keeps type checkers honest

        return grpc.unary_unary_rpc_method_handler(relay)


async def sticky_janitor(client: Client, queue: str) -> None:
    """Fail every workflow task that lands on a dead worker's sticky queue, so that the server reschedules it on the
    normal queue with the whole history; queries that land there fail and are asked again."""
    while True:
        task = await client.workflow_service.poll_workflow_task_queue(
            PollWorkflowTaskQueueRequest(
                namespace=client.namespace,
                task_queue=TaskQueue(name=queue, kind=TaskQueueKind.TASK_QUEUE_KIND_STICKY),
                identity="sticky-janitor",
            )
        )
        if not task.task_token:
            continue
        if task.HasField("query"):
            await client.workflow_service.respond_query_task_completed(
                RespondQueryTaskCompletedRequest(
                    namespace=client.namespace,
                    task_token=task.task_token,
                    completed_type=QueryResultType.QUERY_RESULT_TYPE_FAILED,
                    error_message="the worker that held this workflow is gone",
                )
            )
            continue
        await client.workflow_service.respond_workflow_task_failed(
            RespondWorkflowTaskFailedRequest(
                namespace=client.namespace,
                task_token=task.task_token,
                cause=WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_STICKY_TASK_QUEUE,
                identity="sticky-janitor",
            )
        )


# --- the harness -----------------------------------------------------------------------------------------------


class BreakerHarness:
    """One event loop, one time-skipping server, the relay, and the two workers (the semaphore's under SANDBOX with
    the stub activities; the stub repairs' unsandboxed, on a queue of their own), for any number of examples."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.stubs = StubActivities()
        self.task_queue = f"breaker-property-{uuid.uuid4().hex[:8]}"
        self.restarts = 0
        self.examples = 0
        self._janitors: set[asyncio.Task[None]] = set()
        self.sticky_queues: set[str] = set()  # of the current semaphore worker, as the relay tells
        self._workers: list[tuple[Worker, asyncio.Task[None]]] = []
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        self.env = await WorkflowEnvironment.start_time_skipping(
            test_server_existing_path=find_binary("temporal-test-server"),
            data_converter=pydantic_data_converter,
            test_server_startup_timeout=SERVER_STARTUP_TIMEOUT,
        )
        self.client = self.env.client
        self.stubs.ops = WorkflowOps(self.client, self.task_queue)
        # In this process: a relay process of its own was slower on two cores (measured), not faster.
        self._upstream = grpc.aio.insecure_channel(self.client.service_client.config.target_host, options=UNLIMITED)
        self._relay = grpc.aio.server(options=UNLIMITED)
        self._relay.add_generic_rpc_handlers([StickyRelay(self._upstream, self.sticky_queues.add)])
        port = self._relay.add_insecure_port("127.0.0.1:0")
        await self._relay.start()
        self.worker_client = await Client.connect(
            f"127.0.0.1:{port}", namespace=self.client.namespace, data_converter=pydantic_data_converter
        )
        self._start_workers()

    def _start_workers(self) -> None:
        workers = [
            Worker(
                self.worker_client,
                task_queue=self.task_queue,
                workflows=[DrainSemaphoreWorkflow],
                activities=self.stubs.activities(),
                workflow_runner=SANDBOX,
            ),
            # The stub repairs keep no cache: every workflow task replays their short histories, nothing is left on
            # a sticky queue when their worker restarts, and their many calls need not go through the relay.
            Worker(
                self.client,
                task_queue=self.task_queue + HOLDER_QUEUE_SUFFIX,
                workflows=[StubRepair],
                workflow_runner=UnsandboxedWorkflowRunner(),
                max_cached_workflows=0,
            ),
        ]
        self._workers = [(worker, asyncio.ensure_future(worker.run())) for worker in workers]

    async def restart_workers(self) -> set[asyncio.Task[None]]:
        """Shut both workers down and start new ones; the janitors returned must run until every running workflow
        has had a workflow task on the new workers."""
        dead = set(self.sticky_queues)
        self.sticky_queues.clear()
        for worker, task in self._workers:
            await worker.shutdown()
            await task
        janitors = {asyncio.ensure_future(sticky_janitor(self.client, queue)) for queue in dead}
        self._janitors |= janitors
        self._start_workers()
        self.restarts += 1
        return janitors

    async def stop_janitors(self, janitors: set[asyncio.Task[None]]) -> None:
        for janitor in janitors:
            janitor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await janitor
        self._janitors -= janitors

    def run(self, schedule: Schedule) -> ExampleReport:
        self.examples += 1
        example = self.loop.create_task(Example(self, schedule).run())
        try:
            return self.loop.run_until_complete(example)
        except BaseException:
            # Interrupted (a timeout's signal, ^C): let the example clean up, or the next one would share this
            # loop with it.
            example.cancel()
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(example)
            raise

    def close(self) -> None:
        async def stop() -> None:
            try:
                await self.stop_janitors(set(self._janitors))
                for worker, task in self._workers:
                    await worker.shutdown()
                    await task
                await self._relay.stop(None)
                await self._upstream.close()
            finally:
                await self.env.shutdown()  # whatever else failed: no test server left running
            # Calls still open in the SDK's own threads (long polls) fail now that the server is gone; let them
            # land while this loop runs. And gRPC's asyncio engine runs until its last channel and server are
            # freed: freed only at interpreter exit, both abort it (PyGILState_Release while finalizing).
            await asyncio.sleep(0.5)
            del self._relay, self._upstream
            gc.collect()

        self.loop.run_until_complete(stop())
        self.loop.close()


@contextlib.contextmanager
def breaker_harness() -> Iterator[BreakerHarness]:
    harness = BreakerHarness()
    try:
        yield harness
    finally:
        harness.close()
