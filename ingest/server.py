"""The ingest's web app: a GPU host POSTs its own findings and heartbeats; each is checked, then relayed to the
instance's health workflow with the probe's own signal-with-start (node_probe.delivery.reporter.Reporter).

Heartbeats are coalesced (node_probe.delivery.liveness_relay): the health workflow hears only what changed, and
the group's liveness tracker hears in batches who was heard when.

Checks, cheapest first, and what a failure answers (JSON contract.ingest.Refusal; none reaches Temporal):
    body over MAX_REPORT_BYTES -> 413, not read further     not a GpuFinding / Heartbeat -> 400
    the whole ingest over its rate (before STS is asked) -> 429 with Retry-After
    a session token instead of a proof (ingest/sessions.py): unknown or expired -> 401 (the host proves itself again)
    no proof -> 401; a bad proof -> the verifier's status (401/403; 503 when STS cannot be reached)
    an ECS task's proof: the task resolved to its EC2 instance -> 403 when no configured cluster runs it (503 when
        ECS cannot say)
    a report about another instance -> 403                  over the instance's own rate -> 429 with Retry-After
    a group not in the settings -> 403 (unknown_group: the probe's --group is wrong, no AWS call is made)
    not a member of the group it names -> 403 (503 when AWS cannot say)
    Temporal failed -> 503;  relayed -> 202 (contract.ingest.Accepted: after a proof, with a session token)

GET HEALTH_PATH (the load balancer's target health check): "ok", or 503 (a Refusal) while Temporal has not answered
for a while (worker/health_endpoint.py): the hosts' reports then go to a replica that can relay them. The metrics
(ingest/metrics.py) are not served here but on a port of their own (ingest/cli.py): this is the port the hosts reach.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from pydantic import BaseModel, ValidationError

from contract.ingest import (
    FINDINGS_PATH,
    HEALTH_PATH,
    HEARTBEATS_PATH,
    MAX_REPORT_BYTES,
    PROOF_HEADER,
    REFUSED_UNKNOWN_GROUP,
    SESSION_HEADER,
    Accepted,
    Refusal,
)
from contract.limits import MAX_TEXT
from contract.probe import GpuFinding, Heartbeat
from ingest.ecs_tasks import TaskHosts, TaskLookupUnavailable
from ingest.identity import Caller, Refused
from ingest.membership import GroupMembership, MembershipUnknown
from ingest.metrics import IngestMetrics
from ingest.rate_limit import RateLimiter, retry_after
from ingest.sessions import SESSION_ARN, Sessions
from node_probe.delivery.liveness_relay import LivenessRelay
from worker.health_endpoint import TemporalReachability

log = logging.getLogger(__name__)

_READ_CHUNK = 16 * 1024


class Verifier(Protocol):
    async def verify(self, proof: str, body: bytes) -> Caller: ...


@dataclass
class Ingest:
    """Everything a request needs; built once by `autorepair ingest` (ingest/cli.py) or a test."""

    verifier: Verifier
    membership: GroupMembership
    tasks: TaskHosts
    limiter: RateLimiter
    relay: LivenessRelay
    task_queue: str
    metrics: IngestMetrics
    sessions: Sessions
    # What HEALTH_PATH answers from (checked in the background, and told of each relay that went through); None:
    # not checked, always "ok".
    temporal: TemporalReachability | None = None


class _Refuse(Exception):
    def __init__(self, status: int, kind: str, reason: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.kind = kind
        self.reason = reason
        self.retry_after_s = retry_after_s


async def _read_body(request: web.Request) -> bytes:
    """The body, refused (413) as soon as it is known to be too large: by Content-Length before any of it is
    read, or while reading one that did not say."""
    if request.content_length is not None and request.content_length > MAX_REPORT_BYTES:
        raise _Refuse(413, "too_large", f"report of {request.content_length} bytes; at most {MAX_REPORT_BYTES}")
    body = bytearray()
    while True:
        chunk = await request.content.read(min(_READ_CHUNK, MAX_REPORT_BYTES + 1 - len(body)))
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > MAX_REPORT_BYTES:
            raise _Refuse(413, "too_large", f"report over {MAX_REPORT_BYTES} bytes")


def _parse(model: type[GpuFinding] | type[Heartbeat], body: bytes) -> GpuFinding | Heartbeat:
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        problem = f"{where}: {first['msg']}" if where else first["msg"]
        raise _Refuse(400, "invalid", f"not a {model.__name__}: {problem}") from None


def _refusal_response(refusal: _Refuse) -> web.Response:
    headers = {"Retry-After": str(refusal.retry_after_s)} if refusal.retry_after_s is not None else None
    body = Refusal(status=refusal.status, reason=refusal.reason[:MAX_TEXT], kind=refusal.kind).model_dump_json()
    return web.Response(status=refusal.status, text=body, content_type="application/json", headers=headers)


class _Reports:
    def __init__(self, ingest: Ingest) -> None:
        self.ingest = ingest

    async def finding(self, request: web.Request) -> web.Response:
        return await self._report(request, "finding", GpuFinding, self._send_finding)

    async def heartbeat(self, request: web.Request) -> web.Response:
        return await self._report(request, "heartbeat", Heartbeat, self._send_heartbeat)

    async def _send_finding(self, report: BaseModel) -> None:
        assert isinstance(report, GpuFinding)
        await self.ingest.relay.send_finding(report, self.ingest.task_queue)

    async def _send_heartbeat(self, report: BaseModel) -> None:
        assert isinstance(report, Heartbeat)
        await self.ingest.relay.send_heartbeat(report, self.ingest.task_queue)

    async def _report(
        self,
        request: web.Request,
        kind: str,
        model: type[GpuFinding] | type[Heartbeat],
        send: Callable[[BaseModel], Awaitable[None]],
    ) -> web.Response:
        started = time.perf_counter()
        response = await self._answer(request, kind, model, send)
        self.ingest.metrics.answered(kind, response.status, time.perf_counter() - started)
        return response

    async def _answer(
        self,
        request: web.Request,
        kind: str,
        model: type[GpuFinding] | type[Heartbeat],
        send: Callable[[BaseModel], Awaitable[None]],
    ) -> web.Response:
        claimed: str | None = None
        caller: Caller | None = None
        try:
            body = await _read_body(request)
            report = _parse(model, body)
            claimed = report.instance_id
            caller = await self._check(request, body, report)
            self.ingest.metrics.accepted(kind)
            relay_started = time.perf_counter()
            try:
                await send(report)
                if self.ingest.temporal is not None:
                    self.ingest.temporal.answered()
            except Exception as err:  # unreachable, timed out, refused: the host keeps it and tries again
                log.warning("%s of %s not relayed to Temporal: %s", kind, claimed, err)
                raise _Refuse(503, "temporal", "Temporal is unavailable; try again later", retry_after_s=5) from err
            finally:
                self.ingest.metrics.relay_took(kind, time.perf_counter() - relay_started)
        except _Refuse as refusal:
            self.ingest.metrics.refused(refusal.status, refusal.kind)
            log.warning(
                "refused %s %d (%s): %s; claimed instance %s, proven %s (%s)",
                kind,
                refusal.status,
                refusal.kind,
                refusal.reason,
                claimed or "-",
                (caller.instance_id or caller.ecs_task_id) if caller else "-",
                caller.arn if caller else "no identity",
            )
            return _refusal_response(refusal)
        self.ingest.metrics.relayed(kind)
        # A heartbeat per host per minute would be most of the log (and of the CPU): they are counted in the metrics.
        log.log(
            logging.INFO if kind == "finding" else logging.DEBUG, "relayed %s of %s in %s", kind, claimed, report.group
        )
        accepted = Accepted()
        if caller.arn != SESSION_ARN:  # proven through STS just now: the next reports need not be
            sessions = self.ingest.sessions
            accepted = Accepted(session=sessions.issue(caller), session_expires_in_s=int(sessions.ttl.total_seconds()))
        return web.Response(status=202, text=accepted.model_dump_json(), content_type="application/json")

    async def _check(self, request: web.Request, body: bytes, report: GpuFinding | Heartbeat) -> Caller:
        ingest = self.ingest
        wait = ingest.limiter.take_total()
        if wait:
            raise _Refuse(429, "rate_total", "the ingest is over its total rate", retry_after_s=retry_after(wait))
        caller = await self._identify(request, body)
        if caller.ecs_task_id is not None:
            caller = caller.on_instance(await self._task_instance(caller.ecs_task_id))
        instance_id = caller.instance_id
        if instance_id is None or instance_id != report.instance_id:
            raise _Refuse(
                403,
                "not_self",
                f"a host reports only about itself: proven {instance_id}, report names {report.instance_id}",
            )
        wait = ingest.limiter.take_instance(instance_id)
        if wait:
            raise _Refuse(429, "rate_instance", f"{instance_id} is over its rate", retry_after_s=retry_after(wait))
        try:
            membership = await ingest.membership.check(instance_id, report.group)
        except MembershipUnknown as err:
            raise _Refuse(503, "membership_unknown", str(err), retry_after_s=5) from None
        if not membership.group_known:
            raise _Refuse(403, REFUSED_UNKNOWN_GROUP, membership.how)
        if not membership.member:
            raise _Refuse(403, "not_member", membership.how)
        return caller

    async def _identify(self, request: web.Request, body: bytes) -> Caller:
        token = request.headers.get(SESSION_HEADER)
        if token:
            try:
                caller = self.ingest.sessions.check(token)
            except Refused as refused:
                raise _Refuse(refused.status, "session", refused.reason) from None
            self.ingest.metrics.identity(cached=True)
            return caller
        proof = request.headers.get(PROOF_HEADER)
        if not proof:
            raise _Refuse(401, "unsigned", f"no {PROOF_HEADER}: the report must carry the host's signed proof")
        self.ingest.metrics.identity(cached=False)
        try:
            return await self.ingest.verifier.verify(proof, body)
        except Refused as refused:
            kind = "sts_unavailable" if refused.status == 503 else "proof"
            raise _Refuse(refused.status, kind, refused.reason) from None

    async def _task_instance(self, task_id: str) -> str:
        """The EC2 instance the proven ECS task runs on, or a refusal."""
        try:
            instance_id = await self.ingest.tasks.instance_of(task_id)
        except TaskLookupUnavailable as err:
            raise _Refuse(503, "task_unknown", str(err), retry_after_s=5) from None
        if instance_id is None:
            clusters = ", ".join(self.ingest.tasks.clusters) or "none configured"
            raise _Refuse(
                403,
                "task_not_running",
                f"the ECS task {task_id} is not running on a container instance in any group's cluster ({clusters})",
            )
        return instance_id


def build_app(ingest: Ingest) -> web.Application:
    # client_max_size bounds what aiohttp itself would buffer; the report handlers read and bound the body
    # themselves (413 before reading a body whose Content-Length is already too large).
    app = web.Application(client_max_size=MAX_REPORT_BYTES)
    reports = _Reports(ingest)

    async def liveness_batches(app: web.Application) -> AsyncIterator[None]:
        async with ingest.relay.running():
            yield

    app.cleanup_ctx.append(liveness_batches)

    async def membership_reads(app: web.Application) -> AsyncIterator[None]:
        yield
        await ingest.membership.close()  # its background reads of EC2 end with the app

    app.cleanup_ctx.append(membership_reads)
    temporal = ingest.temporal
    if temporal is not None:

        async def reachability(app: web.Application) -> AsyncIterator[None]:
            async with temporal.checking():
                yield

        app.cleanup_ctx.append(reachability)

    async def health(request: web.Request) -> web.Response:
        # 503 while Temporal has not answered recently: every report would be refused (503) here, and the load
        # balancer should send the hosts to a replica that can relay them. Never asks Temporal while it waits.
        problem = temporal.problem() if temporal is not None else None
        if problem is None:
            return web.Response(text="ok")
        return _refusal_response(_Refuse(503, "temporal", problem))

    app.router.add_post(FINDINGS_PATH, reports.finding)
    app.router.add_post(HEARTBEATS_PATH, reports.heartbeat)
    app.router.add_get(HEALTH_PATH, health)
    return app
