"""Who is calling: the ingest's half of "a host speaks only for itself" (contract/ingest.py has the protocol).

A host hands over a SigV4-signed, unsent sts:GetCallerIdentity (node_probe/delivery/proof.py signs it). The ingest
checks what it can locally (the ingest id and the body's SHA-256 are among the signed headers and match, the
signature is fresh and not seen before, the signed Host is the ingest's own STS endpoint), then sends the request,
exactly as signed, to `settings.sts_endpoint` and never anywhere the proof names. STS checks the signature and
answers with the caller's ARN; an EC2 instance profile's credentials are an assumed role whose session name is the
instance id, and that id is who the caller may speak for.

Two kinds of session name are accepted, and nothing else (403): an EC2 instance id (instance-profile credentials),
which is the instance the caller speaks for; and an ECS task id (a task role's credentials: ECS names the session
after the task, 32 hex characters, or a UUID for a task with an old-format ARN), which proves only the task. The
verifier says which (Caller.ecs_task_id); the ingest resolves a task to its container instance's EC2 instance with
the ECS API (ingest/ecs_tasks.py) before it may stand for a host.

Refused carries the HTTP status: 401 when the proof proves nothing (missing, undecodable, unsigned parts, expired,
replayed, rejected by STS), 403 when it is for something else or proves a caller who is not allowed, 503 when STS
could not be asked (timeout, 5xx, throttling): the host should retry that one later with a fresh proof.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import heapq
import math
import re
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from urllib.parse import urlsplit

import aiohttp
from pydantic import ValidationError

from contract.config import IngestSettings
from contract.ingest import (
    BODY_SHA256_HEADER,
    GET_CALLER_IDENTITY_BODY,
    INGEST_ID_HEADER,
    PROOF_WINDOW_S,
    SignedStsRequest,
)
from contract.limits import MAX_TEXT

STS_TIMEOUT_S = 5.0  # read at each call, so a test may shorten it
MAX_PROOF_CHARS = 16 * 1024  # the PROOF_HEADER value, base64
MAX_HEADER_VALUE_CHARS = 4096  # a session token is the longest signed header, well under this
MAX_STS_RESPONSE_BYTES = 64 * 1024

_HEADER_NAME = re.compile(r"[A-Za-z0-9-]{1,64}")
_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")  # printable ASCII only: no CR, LF or NUL to smuggle into a request
_SIGNATURE = re.compile(r"[0-9a-f]{64}")
_AMZ_DATE = "%Y%m%dT%H%M%SZ"
_INSTANCE_ID = re.compile(r"i-[0-9a-f]{8,17}")
# An ECS task id as ECS names a task role's session: 32 hex characters (the current ARN format), or a UUID (tasks of
# the old ARN format, and moto's).
_ECS_TASK_ID = re.compile(r"[0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_ASSUMED_ROLE_ARN = re.compile(r"arn:(aws[a-z-]*):sts::(\d{12}):assumed-role/([\w+=,.@-]+)/([\w+=,.@-]+)")
_ROLE_ARN = re.compile(r"arn:(aws[a-z-]*):iam::(\d{12}):role/(?:[\w+=,.@/-]*/)?([\w+=,.@-]+)")
_STS_ERROR_CODE = re.compile(r"[A-Za-z0-9.]{1,64}")
_THROTTLED = {"Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException"}
_DEFAULT_PORTS = {"http": 80, "https": 443}
# Required among the proof's SignedHeaders (lower-cased, as SigV4 lists them).
_MUST_SIGN = ("host", "x-amz-date", INGEST_ID_HEADER.lower(), BODY_SHA256_HEADER.lower())
# The only headers a proof may sign, so the ones sent to STS: what botocore signs for a query-protocol POST plus
# the contract's own. Never Content-Length, Transfer-Encoding or Connection: those are the HTTP client's to set.
_FORWARDED = re.compile(r"host|content-type|x-amz-[a-z0-9-]+|x-autorepair-[a-z0-9-]+")


class Refused(Exception):
    """A report the ingest does not accept, as an HTTP status and one line that says why."""

    def __init__(self, status: int, reason: str) -> None:
        reason = " ".join(reason.split())[:MAX_TEXT]
        super().__init__(reason)
        self.status = status
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class Caller:
    """A caller STS vouched for: the EC2 instance whose instance profile signed the proof, or the ECS task whose
    task role did.

    `instance_id` is the instance the caller speaks for: the session name of an instance profile; None for an ECS
    task (`ecs_task_id`, the session name) until the ingest resolves the task to its instance (`on_instance`).
    `arn` is the assumed-role ARN STS answered; `role_arn` is the role's IAM ARN rebuilt from it, without a path
    (an assumed-role ARN does not carry the role's path).
    """

    instance_id: str | None
    account: str
    arn: str
    role_arn: str
    ecs_task_id: str | None = None

    def on_instance(self, instance_id: str) -> Caller:
        """This caller, speaking for `instance_id` (an ECS task's container instance, as the ECS API resolved it)."""
        return replace(self, instance_id=instance_id)


def _host_header(url: str) -> str:
    """host[:port] as SigV4 signs it for `url`: lower-cased, the port only when not the scheme's default."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None and parts.port != _DEFAULT_PORTS.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


def _role_key(arn: str) -> tuple[str, str, str]:
    """(partition, account, role name) of an IAM role ARN, the path dropped."""
    match = _ROLE_ARN.fullmatch(arn)
    if match is None:
        raise ValueError(f"ingest.allowed_role_arns: {arn!r} is not an IAM role ARN (arn:aws:iam::ACCOUNT:role/NAME)")
    return match.group(1), match.group(2), match.group(3)


class _SeenProofs:
    """Signatures of proofs already used, each until its X-Amz-Date leaves the window, for replay protection.

    Each ingest replica keeps its own, in memory: a proof replayed to another replica is not caught here. Across
    replicas replay protection rests on the short PROOF_WINDOW_S and on the body digest signed into the proof (a
    replay can only deliver the very same report again, within minutes, which the health workflow de-duplicates).

    A signature is claimed before STS is asked (so two concurrent copies cannot both pass) and remembered only when
    STS accepted it; a refused or failed one is released, so garbage cannot fill the map. The map is bounded: when
    full of unexpired proofs a new one is refused with 503 rather than an old one forgotten.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._expiry: dict[str, float] = {}
        self._by_expiry: list[tuple[float, str]] = []
        self._pending: set[str] = set()

    def __len__(self) -> int:
        return len(self._expiry)

    def _purge(self, now: float) -> None:
        while self._by_expiry and self._by_expiry[0][0] < now:
            expiry, signature = heapq.heappop(self._by_expiry)
            if self._expiry.get(signature) == expiry:
                del self._expiry[signature]

    def claim(self, signature: str, now: float) -> None:
        self._purge(now)
        if signature in self._pending or signature in self._expiry:
            raise Refused(401, "the proof was used before (a replay): sign a fresh proof for every request")
        if len(self._expiry) + len(self._pending) >= self.capacity:
            raise Refused(503, f"the ingest is tracking {self.capacity} recent proofs; retry shortly")
        self._pending.add(signature)

    def confirm(self, signature: str, expiry: float) -> None:
        self._pending.discard(signature)
        self._expiry[signature] = expiry
        heapq.heappush(self._by_expiry, (expiry, signature))

    def release(self, signature: str) -> None:
        self._pending.discard(signature)


def _decode(proof: str | None) -> SignedStsRequest:
    if not proof:
        raise Refused(401, "no identity proof: sign an sts:GetCallerIdentity request and send it in the proof header")
    if len(proof) > MAX_PROOF_CHARS:
        raise Refused(401, f"the identity proof is longer than {MAX_PROOF_CHARS} characters")
    try:
        raw = base64.b64decode(proof, validate=True)
    except (binascii.Error, ValueError):
        raise Refused(401, "the identity proof is not base64") from None
    try:
        request = SignedStsRequest.model_validate_json(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "proof"
        raise Refused(401, f"the identity proof is not a signed STS request ({where}: {first['msg']})") from None
    for name, value in request.headers.items():
        if not _HEADER_NAME.fullmatch(name):
            raise Refused(401, f"the identity proof has a malformed header name {name[:64]!r}")
        if len(value) > MAX_HEADER_VALUE_CHARS or not _HEADER_VALUE.fullmatch(value):
            raise Refused(401, f"the identity proof's header {name} is too long or not printable ASCII")
    return request


def _lower_headers(request: SignedStsRequest) -> dict[str, str]:
    lowered: dict[str, str] = {}
    for name, value in request.headers.items():
        if name.lower() in lowered:
            raise Refused(401, f"the identity proof has the header {name} twice")
        lowered[name.lower()] = value
    return lowered


def _signed_headers_and_signature(headers: dict[str, str]) -> tuple[set[str], str]:
    """SignedHeaders and Signature from `AWS4-HMAC-SHA256 Credential=.../sts/aws4_request, SignedHeaders=a;b,
    Signature=hex`."""
    authorization = headers.get("authorization", "")
    algorithm, _, rest = authorization.partition(" ")
    if algorithm != "AWS4-HMAC-SHA256":
        raise Refused(401, "the identity proof is not SigV4-signed (no AWS4-HMAC-SHA256 Authorization header)")
    fields: dict[str, str] = {}
    for part in rest.split(","):
        key, _, value = part.strip().partition("=")
        fields[key] = value
    scope = fields.get("Credential", "").split("/")
    if len(scope) != 5 or scope[3] != "sts" or scope[4] != "aws4_request":
        raise Refused(401, "the identity proof is not signed for STS (Credential scope .../sts/aws4_request)")
    signature = fields.get("Signature", "")
    if not _SIGNATURE.fullmatch(signature):
        raise Refused(401, "the identity proof's Authorization has no SigV4 Signature")
    signed = {name for name in fields.get("SignedHeaders", "").split(";") if name}
    missing = [name for name in _MUST_SIGN if name not in signed]
    if missing:
        raise Refused(401, f"the identity proof does not sign {', '.join(missing)}")
    foreign = sorted(name for name in signed if not _FORWARDED.fullmatch(name))
    if foreign:
        raise Refused(401, f"the identity proof signs headers the ingest does not forward: {', '.join(foreign)}")
    absent = sorted(name for name in signed if name not in headers)
    if absent:
        raise Refused(401, f"the identity proof signs headers it does not carry: {', '.join(absent)}")
    return signed, signature


def _signed_at(headers: dict[str, str]) -> float:
    try:
        return datetime.strptime(headers["x-amz-date"], _AMZ_DATE).replace(tzinfo=UTC).timestamp()
    except ValueError:
        raise Refused(401, "the identity proof's X-Amz-Date is not a SigV4 date (YYYYMMDDTHHMMSSZ)") from None


def _xml_text(root: ET.Element, name: str) -> str | None:
    """The text of the first element called `name` (any namespace)."""
    for element in root.iter():
        if element.tag.rpartition("}")[2] == name:
            return (element.text or "").strip()
    return None


class ProofVerifier:
    """Turns a report's proof header and body into the Caller STS vouches for, or a Refused."""

    def __init__(
        self,
        settings: IngestSettings,
        session: aiohttp.ClientSession,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.session = session
        self.clock = clock
        self._sts_host = _host_header(settings.sts_endpoint)
        self._accounts = frozenset(settings.allowed_accounts)
        # Compared by (partition, account, role name): the assumed-role ARN STS answers drops the role's path, so
        # arn:aws:iam::123456789012:role/fleet/gpu-node allows the role gpu-node of that account, whatever its path.
        self._roles = frozenset(_role_key(arn) for arn in settings.allowed_role_arns)
        # The ingest accepts at most total_burst + total_rate * t reports in t seconds, and a proof is remembered at
        # most 2 * PROOF_WINDOW_S (its X-Amz-Date may lead the clock by a window): this many cover full rate.
        self._seen = _SeenProofs(settings.total_burst + math.ceil(settings.total_rate * 2 * PROOF_WINDOW_S))

    async def verify(self, proof: str | None, body: bytes) -> Caller:
        """The caller that signed `proof` for this ingest and this `body`, as STS names it; Refused otherwise."""
        request = _decode(proof)
        if request.method != "POST" or request.body != GET_CALLER_IDENTITY_BODY:
            raise Refused(401, "the identity proof is not a POST of sts:GetCallerIdentity")
        headers = _lower_headers(request)
        signed, signature = _signed_headers_and_signature(headers)
        if headers[INGEST_ID_HEADER.lower()] != self.settings.id:
            raise Refused(403, f"the identity proof is for another ingest, not {self.settings.id!r}")
        if headers[BODY_SHA256_HEADER.lower()] != hashlib.sha256(body).hexdigest():
            raise Refused(403, "the identity proof was signed for another body (SHA-256 differs)")
        signed_at = _signed_at(headers)
        now = self.clock()
        if abs(now - signed_at) > PROOF_WINDOW_S:
            age = f"{now - signed_at:.0f} s old" if now > signed_at else f"{signed_at - now:.0f} s in the future"
            raise Refused(
                401,
                f"the identity proof has expired: its X-Amz-Date is {age} by the ingest's clock (the window is "
                f"{PROOF_WINDOW_S} s); sign a fresh one, and check the host's clock",
            )
        if headers["host"].lower() != self._sts_host:
            raise Refused(401, f"the identity proof is signed for STS at {headers['host']!r}, not {self._sts_host!r}")
        self._seen.claim(signature, now)
        accepted = False
        try:
            arn, account = await self._ask_sts(request, signed)
            accepted = True
        finally:
            if accepted:
                self._seen.confirm(signature, signed_at + PROOF_WINDOW_S)
            else:
                self._seen.release(signature)
        return self._allowed(arn, account)

    async def _ask_sts(self, request: SignedStsRequest, signed: set[str]) -> tuple[str, str]:
        """(Arn, Account) from STS for the signed request, sent as signed to the configured endpoint only."""
        # The signed headers and the Authorization, nothing else: an unsigned header would be the sender's choice.
        headers = {name: value for name, value in request.headers.items() if name.lower() in signed}
        headers["Authorization"] = next(v for k, v in request.headers.items() if k.lower() == "authorization")
        # (every signed header is host, content-type, x-amz-* or x-autorepair-*, so Authorization is not among them)
        try:
            async with self.session.post(
                self.settings.sts_endpoint,
                data=request.body.encode(),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=STS_TIMEOUT_S),
                allow_redirects=False,
            ) as response:
                status = response.status
                payload = await response.content.read(MAX_STS_RESPONSE_BYTES + 1)
        except TimeoutError:
            raise Refused(503, f"STS did not answer within {STS_TIMEOUT_S:g} s; retry with a fresh proof") from None
        except aiohttp.ClientError as err:
            raise Refused(503, f"STS could not be reached ({type(err).__name__}); retry with a fresh proof") from None
        if len(payload) > MAX_STS_RESPONSE_BYTES:
            raise Refused(503, f"STS answered with more than {MAX_STS_RESPONSE_BYTES} bytes")
        try:
            root: ET.Element | None = ET.fromstring(payload)
        except ET.ParseError:
            root = None
        if status != 200:
            code = _xml_text(root, "Code") if root is not None else None
            code = code if code and _STS_ERROR_CODE.fullmatch(code) else f"HTTP {status}"
            if status >= 500 or status == 429 or code in _THROTTLED or not 400 <= status < 500:
                raise Refused(503, f"STS could not check the proof now: {code}; retry with a fresh proof")
            raise Refused(401, f"STS refused the signature: {code}")
        arn = _xml_text(root, "Arn") if root is not None else None
        account = _xml_text(root, "Account") if root is not None else None
        if not arn or not account:
            raise Refused(503, "STS answered without an Arn and Account (not a GetCallerIdentityResponse)")
        return arn, account

    def _allowed(self, arn: str, account: str) -> Caller:
        match = _ASSUMED_ROLE_ARN.fullmatch(arn)
        if match is None:
            raise Refused(403, f"the caller {arn} is not an assumed role (an IAM user or root is never a host)")
        partition, arn_account, role, session = match.groups()
        if arn_account != account:
            raise Refused(403, f"STS named account {account} for {arn}")
        if not self._accounts:
            raise Refused(403, "no account is allowed: ingest.allowed_accounts is empty, so every caller is refused")
        if account not in self._accounts:
            raise Refused(403, f"account {account} is not in ingest.allowed_accounts")
        if self._roles and (partition, account, role) not in self._roles:
            raise Refused(403, f"role {role} of account {account} is not in ingest.allowed_role_arns")
        role_arn = f"arn:{partition}:iam::{account}:role/{role}"
        if _INSTANCE_ID.fullmatch(session):
            return Caller(instance_id=session, account=account, arn=arn, role_arn=role_arn)
        if _ECS_TASK_ID.fullmatch(session):
            return Caller(instance_id=None, account=account, arn=arn, role_arn=role_arn, ecs_task_id=session)
        raise Refused(
            403,
            f"the session name {session!r} is not an EC2 instance id nor an ECS task id: only instance-profile and "
            "ECS task-role credentials are accepted",
        )
