"""Deliver findings and heartbeats through the ingest (contract/ingest.py): POST the report's JSON over HTTPS with a
proof of this host's identity, a fresh one per attempt, signed with the host's own AWS credentials; or, once the
ingest has handed out a session token for this instance, with that token until it expires or is refused.

The probe's deliverer retries whatever raises here, oldest finding first, with a backoff doubling up to its
retry_max_backoff; a finding leaves the spool only when this returns. So every answer but 202 raises, except the
few that mean this one report can never be accepted (see `_permanent`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from botocore.credentials import ReadOnlyCredentials
from pydantic import BaseModel, ValidationError

from contract.ingest import (
    FINDINGS_PATH,
    HEARTBEATS_PATH,
    PROOF_HEADER,
    REFUSED_UNKNOWN_GROUP,
    SESSION_HEADER,
    Accepted,
    Refusal,
)
from contract.probe import GpuFinding, Heartbeat
from node_probe.delivery.proof import ambient_credentials, sign_proof

log = logging.getLogger(__name__)

DEFAULT_INGEST_ID = "gpu-autorepair-ingest"  # the ingest's default `ingest.id`
# Frozen credentials are re-read after this long. Instance-profile credentials rotate about hourly and stay valid
# well past their rotation; a 401 (an expired or rotated key) re-reads them at once.
CREDENTIALS_MAX_AGE_S = 300.0
# A Retry-After longer than this is not believed (a misconfigured proxy must not silence the probe for a day).
MAX_RETRY_AFTER_S = 300.0
REQUEST_TIMEOUT_S = 10.0
SESSION_MARGIN_S = 60
# Longer than the default heartbeat interval (60 s), shorter than the ingest's own idle limit (KEEPALIVE_S there).
KEEPALIVE_S = 120.0


def default_sts_endpoint(region: str) -> str:
    return f"https://sts.{region}.amazonaws.com"


class IngestRefused(Exception):
    """The ingest answered something other than 202; the probe keeps the report and tries again. `kind` is the
    ingest's name for the check that refused it (contract.ingest.Refusal.kind), "" when it gave none."""

    def __init__(self, status: int, reason: str, kind: str = "") -> None:
        super().__init__(f"ingest refused it ({status}{', ' + kind if kind else ''}): {reason}")
        self.status = status
        self.reason = reason
        self.kind = kind

    @property
    def unknown_group(self) -> bool:
        """The ingest's settings have no such group: every report of this probe is refused until its --group (or
        the settings) is fixed."""
        return self.kind == REFUSED_UNKNOWN_GROUP


def refusal_of(status: int, body: str) -> tuple[str, str]:
    """The reason and kind in an ingest's JSON Refusal, or the start of whatever else answered (a proxy's page)."""
    try:
        refusal = Refusal.model_validate_json(body)
    except ValidationError:
        text = " ".join(body.split())[:200]
        return text or f"HTTP {status}", ""
    return refusal.reason, refusal.kind


def _permanent(status: int) -> bool:
    """Whether a refusal means this report can never be accepted, so retrying it would only block the findings
    spooled behind it. Only the report's own faults are: 400 (not a valid GpuFinding: a probe newer or older than
    the ingest's model) and 413 (too large). Everything about the host rather than the report is retried: 401
    (expired or rotated credentials, a clock off by minutes), 403 (a missing group tag, an instance not yet
    registered in its cluster, a role not yet allowed, a wrong --instance-id, a --group not in the ingest's settings)
    and 404 (a wrong --ingest URL) would
    refuse every later finding from this host just the same, so dropping this one would lose it and unblock
    nothing; kept, the spool drains in order, nothing lost, once the operator fixes the cause (the ingest believes
    a membership answer for ingest.membership_ttl). The probe logs each failed attempt, with the ingest's reason,
    at its backoff (at most one a retry_max_backoff)."""
    return status in (400, 413)


class IngestReporter:
    """node_probe.delivery.reporter.ReporterProtocol over the ingest. `task_queue` is the ingest's to choose; the
    argument is ignored."""

    def __init__(
        self,
        url: str,
        *,
        ingest_id: str = DEFAULT_INGEST_ID,
        sts_endpoint: str | None = None,
        region: str = "us-east-1",
        credentials: Callable[[], ReadOnlyCredentials] | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        use_sessions: bool = True,
    ) -> None:
        self.url = url.rstrip("/")
        self.ingest_id = ingest_id
        self.region = region
        self.sts_endpoint = sts_endpoint or default_sts_endpoint(region)
        self._read_credentials = credentials or (lambda: ambient_credentials(region))
        self._credentials: ReadOnlyCredentials | None = None
        self._credentials_at = 0.0
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock
        self._http: aiohttp.ClientSession | None = None
        self._not_before = 0.0  # clock() before which nothing is sent: the last Retry-After
        self.dropped = 0  # findings refused for good (400, 413), logged each
        self._use_sessions = use_sessions
        self._session: tuple[str, float] | None = None  # the ingest's session token and when to stop using it
        self.proofs_signed = 0

    async def send_finding(self, finding: GpuFinding, task_queue: str) -> None:
        try:
            await self._post(FINDINGS_PATH, finding)
        except IngestRefused as refused:
            if not _permanent(refused.status):
                raise
            self.dropped += 1
            log.error(
                "finding %s (%s) refused for good by the ingest, dropped so the findings behind it go on: %s",
                finding.finding_id,
                finding.reason,
                refused,
            )

    async def send_heartbeat(self, heartbeat: Heartbeat, task_queue: str) -> None:
        # Not retried by the probe: the next one replaces it. A refused heartbeat raises all the same, so the
        # probe's log says why the health workflow is not hearing from this host.
        await self._post(HEARTBEATS_PATH, heartbeat)

    async def send_once(self, path: str, report: BaseModel) -> tuple[int, str]:
        """One attempt, for `autorepair probe-report`: the status and, unless 202, the ingest's reason."""
        try:
            await self._post(path, report, wait=False)
        except IngestRefused as refused:
            return refused.status, refused.reason
        return 202, ""

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> IngestReporter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _post(self, path: str, report: BaseModel, *, wait: bool = True) -> None:
        if wait:
            pause = self._not_before - self._clock()
            if pause > 0:
                await asyncio.sleep(pause)
        body = report.model_dump_json().encode()
        token = self._current_session()
        status, text = await self._send(path, body, token)
        if status == 401 and token is not None:
            # The token expired or another replica does not know it: prove ourselves, once, right away.
            self._session = None
            status, text = await self._send(path, body, None)
        if 200 <= status < 300:
            self._note_session(text)
            return
        if status == 401:
            self._credentials = None  # expired or rotated: read them again for the next attempt
        raise IngestRefused(status, *refusal_of(status, text))

    async def _send(self, path: str, body: bytes, token: str | None) -> tuple[int, str]:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers[SESSION_HEADER] = token
        else:
            headers[PROOF_HEADER] = sign_proof(
                body,
                ingest_id=self.ingest_id,
                sts_endpoint=self.sts_endpoint,
                region=self.region,
                credentials=await self._current_credentials(),
            )
            self.proofs_signed += 1
        if self._http is None:
            # One connection kept open across heartbeats (aiohttp's default drops it after 15 s idle): no new TLS
            # handshake per report, and behind a connection-level load balancer the host stays on one replica,
            # whose liveness batches then carry its heartbeats in order (docs/operations.md, section 11).
            connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
            self._http = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        async with self._http.post(f"{self.url}{path}", data=body, headers=headers) as response:
            text = await response.text(errors="replace")
            if not 200 <= response.status < 300:
                self._note_retry_after(response.headers.get("Retry-After"))
            return response.status, text

    def _current_session(self) -> str | None:
        if self._session is None:
            return None
        token, use_until = self._session
        return token if self._clock() < use_until else None

    def _note_session(self, text: str) -> None:
        if not self._use_sessions:
            return
        try:
            accepted = Accepted.model_validate_json(text)
        except ValidationError:
            return  # an ingest from before session tokens: a proof every time
        if accepted.session and accepted.session_expires_in_s:
            # Stop a little early: a token that expires on the way costs a 401 and a second request.
            use_for = max(accepted.session_expires_in_s - SESSION_MARGIN_S, 0)
            self._session = (accepted.session, self._clock() + use_for)

    def _note_retry_after(self, value: Any) -> None:
        if value is None:
            return
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            return  # an HTTP date: the probe's own backoff applies
        if seconds > 0:
            self._not_before = max(self._not_before, self._clock() + min(seconds, MAX_RETRY_AFTER_S))

    async def _current_credentials(self) -> ReadOnlyCredentials:
        now = self._clock()
        if self._credentials is None or now - self._credentials_at > CREDENTIALS_MAX_AGE_S:
            # Blocking: on EC2 botocore reads the instance profile from IMDS.
            self._credentials = await asyncio.to_thread(self._read_credentials)
            self._credentials_at = now
        return self._credentials
