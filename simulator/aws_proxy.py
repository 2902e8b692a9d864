"""A fault-injecting proxy in front of moto: AWS's API as the engine meets it on a bad day, and at its real speed.

moto answers every call at once and never runs out of capacity. Real AWS throttles (EC2 `RequestLimitExceeded`,
ECS `ThrottlingException`), runs out of GPU capacity (`InsufficientInstanceCapacity`) and refuses calls the role
may not make (`UnauthorizedOperation`). `FlakyAws` listens on loopback, forwards every request to moto unchanged,
and answers instead with AWS's own error response (same protocol, status and body shape, so botocore parses and
retries it exactly as it would a real one) whenever a `Fault` rule matches. A `Canned` rule answers a json-protocol
call with a successful body of the test's choosing instead: what moto cannot say (an SSM command that failed on the
host, with the output it printed). A `Rewrite` rule changes moto's own successful answer on its way back, in the
service's wire format: moto says every status check is "ok", with no scheduled event, and every ECS agent connected.
`simulate_policy` plays IAM's policy simulator, which moto lacks (simulator/policy_simulation.py).

moto also answers in a millisecond where AWS takes tens to hundreds: a `Latency` rule holds each matching answer for
a delay drawn from the API's range (`AWS_LATENCY_MS` is a profile of them), so a benchmark shows what the engine's
serial calls cost.

It serves from its own threads: the test's event loop (which runs the Temporal worker) is never blocked, and the
engine's boto3 calls (made from worker threads) are served concurrently, each held for its own delay.

Only the engine is pointed at the proxy; whatever plays the world (the simulated fleet, the test's own checks)
keeps talking to moto directly, so its calls neither see faults nor use up a rule's count. The world may still
follow what the engine does: a listener (`FlakyAws.listen`) hears of every answered request, its body and the
answer's, as it happens (the simulated fleet learns of the engine's launches, drains and terminations so).
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

from simulator.policy_simulation import Decision, PolicySimulation

log = logging.getLogger(__name__)

# Status codes AWS answers these errors with (EC2 capacity and throttling are server-side: 500 and 503).
DEFAULT_STATUS = {
    "InsufficientInstanceCapacity": 500,
    "InsufficientCapacity": 500,
    "InternalError": 500,
    "ServiceUnavailable": 503,
    "RequestLimitExceeded": 503,
    "ThrottlingException": 400,
    "Throttling": 400,
    "UnauthorizedOperation": 403,
    "AccessDeniedException": 400,
    "AccessDenied": 403,
}

DEFAULT_MESSAGE = {
    "InsufficientInstanceCapacity": (
        "We currently do not have sufficient p5.48xlarge capacity in the Availability Zone you requested. "
        "Our system will be working on provisioning additional capacity."
    ),
    "RequestLimitExceeded": "Request limit exceeded.",
    "ThrottlingException": "Rate exceeded",
    "Throttling": "Rate exceeded",
    "UnauthorizedOperation": (
        "You are not authorized to perform this operation. User: arn:aws:sts::123456789012:assumed-role/"
        "gpu-autorepair/worker is not authorized to perform: ec2:RunInstances"
    ),
}

# How long AWS takes to answer, by API, in milliseconds (low, high): the 50-300 ms most calls take, longer for the
# calls that do work before they answer (a launch, a termination). Set for benchmarks, from typical observed ranges,
# not from a published SLA; "*" is every other call.
AWS_LATENCY_MS: dict[str, tuple[float, float]] = {
    "*": (50, 300),
    "RunInstances": (300, 900),
    "TerminateInstances": (150, 500),
    "DetachInstances": (150, 500),
    "UpdateContainerInstancesState": (80, 300),
    "DescribeInstances": (60, 250),
    "DescribeInstanceStatus": (60, 250),
    "DescribeContainerInstances": (50, 200),
    "ListContainerInstances": (50, 150),
    "ListTasks": (50, 150),
    "DescribeTasks": (50, 200),
    "PutEvents": (30, 120),
}

# Not forwarded: they describe one hop of the connection, not the request (RFC 9110, 7.6.1).
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "content-length"}
)


@dataclass(frozen=True)
class AwsRequest:
    """What a rule can match on: the API call, and which attempt of which logical SDK call it is."""

    service: str  # signing name from the SigV4 credential scope: ec2, ecs, events, autoscaling
    action: str  # RunInstances, UpdateContainerInstancesState, ... ("" for a protocol we do not parse)
    protocol: str  # "json" (X-Amz-Target) or "query" (form-encoded Action=), or "other"
    attempt: int  # botocore's attempt number within one logical call (amz-sdk-request header), 1 if absent
    invocation: str  # one logical SDK call, the same on each of its retries (amz-sdk-invocation-id header)
    # Query protocol: the form's parameters (first value of each), e.g. {"InstanceId.1": "i-0abc..."}, so a test
    # can tell which instance a call was about. Empty for the json protocol.
    params: dict[str, str] = field(default_factory=dict, compare=False)
    # The request's body as sent: the json protocol's parameters are here (a rewrite or a listener may read them).
    body: bytes = field(default=b"", compare=False, repr=False)


@dataclass
class Fault:
    """Answer `action` with AWS error `code` instead of forwarding it.

    `per="request"` counts HTTP requests: each of botocore's attempts is a request, so a throttle on the first
    N requests is partly absorbed by botocore's own retries, as a real throttle is. `per="call"` counts logical
    SDK calls: every attempt of a failed call fails too, as when a capacity shortage outlasts botocore's few
    seconds of backoff, so each failed call reaches the activity as an error.

    `times=None` fails every matching request or call; otherwise the first `times` ones after the rule was
    added fail and later ones go through. `every=k` fails only every k-th one (k, 2k, ...), so a throttle can
    run through a whole repair without starving any single call.
    """

    action: str
    code: str
    status: int
    message: str
    times: int | None = None
    every: int = 1
    per: Literal["request", "call"] = "request"
    service: str | None = None
    # Query protocol only: fail only requests with these parameters, e.g. {"SubnetId": "subnet-1"} (one AZ).
    where: dict[str, str] = field(default_factory=dict)
    matched: int = 0  # requests or calls (see `per`) that matched the rule while it was active
    failed: int = 0  # requests or calls (see `per`) answered with the error
    _doomed: set[str] = field(default_factory=set, init=False, repr=False)
    _spared: set[str] = field(default_factory=set, init=False, repr=False)

    def applies(self, request: AwsRequest) -> bool:
        """Count a matching request and say whether to fail it. Called under the proxy's lock."""
        if request.action != self.action or (self.service is not None and request.service != self.service):
            return False
        if any(request.params.get(key) != value for key, value in self.where.items()):
            return False
        if self.per == "call":
            # A retry of a call already decided on gets the same answer; only a new call counts.
            if request.invocation in self._doomed:
                return True
            if request.invocation in self._spared:
                return False
        if self.times is not None and self.failed >= self.times:
            return False
        self.matched += 1
        doomed = self.matched % self.every == 0
        if doomed:
            self.failed += 1
        if self.per == "call" and request.invocation:
            (self._doomed if doomed else self._spared).add(request.invocation)
        return doomed


@dataclass
class Canned:
    """Answer `action` (json protocol) with HTTP 200 and `body`, the first `times` times (None: always)."""

    action: str
    body: dict[str, object]
    times: int | None = None
    service: str | None = None
    served: int = 0

    def applies(self, request: AwsRequest) -> bool:
        """Count a matching request and say whether to answer it. Called under the proxy's lock."""
        if request.action != self.action or request.protocol != "json":
            return False
        if (self.service is not None and request.service != self.service) or (
            self.times is not None and self.served >= self.times
        ):
            return False
        self.served += 1
        return True


@dataclass
class Rewrite:
    """Change moto's successful answer to `action` (FlakyAws.rewrite)."""

    action: str
    edit: Callable[[AwsRequest, bytes], bytes]
    service: str | None = None

    def applies(self, request: AwsRequest) -> bool:
        return request.action == self.action and self.service in (None, request.service)


@dataclass
class Answerer:
    """Answer `action` (json protocol) with HTTP 200 and what `make(request)` returns, or pass it on to moto when that
    is None (FlakyAws.answer_with)."""

    action: str
    make: Callable[[AwsRequest], dict[str, object] | None]
    service: str | None = None

    def applies(self, request: AwsRequest) -> bool:
        return request.action == self.action and request.protocol == "json" and self.service in (None, request.service)


@dataclass(frozen=True)
class Latency:
    """Hold the answer to `action` ("*": any call no other rule names) for a delay drawn uniformly from
    [low_s, high_s], whether moto, a fault or a canned answer makes it."""

    action: str
    low_s: float
    high_s: float
    service: str | None = None

    def applies(self, request: AwsRequest) -> bool:
        return self.action in ("*", request.action) and self.service in (None, request.service)


@dataclass(frozen=True)
class Seen:
    """One request as the proxy handled it, in arrival order."""

    request: AwsRequest
    status: int
    fault: str | None  # the error code injected, or None when moto answered


@dataclass(frozen=True)
class Answered:
    """One request as a listener hears of it, once answered (FlakyAws.listen)."""

    request: AwsRequest  # its body is what the caller sent
    status: int
    answer: bytes  # what the caller gets back: moto's (rewritten), a fault's or a canned body
    elapsed_s: float  # from the request's arrival to its answer, before any latency rule's hold


Listener = Callable[[Answered], None]


@dataclass
class _Log:
    seen: list[Seen] = field(default_factory=list)
    calls: Counter[str] = field(default_factory=Counter)
    injected: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    peak_in_flight: int = 0


class FlakyAws:
    """Loopback HTTP proxy to `upstream` (moto) that injects AWS error responses by rule.

    Use as a context manager; `url` is what the engine's `settings.aws.endpoint_url` should be.
    """

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http:// URL, not {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self._faults: list[Fault] = []
        self._canned: list[Canned] = []
        self._rewrites: list[Rewrite] = []
        self._answerers: list[Answerer] = []
        self._simulation: PolicySimulation | None = None
        self._latencies: list[Latency] = []
        self._random = random.Random(0)  # the same delays in the same order on every run with the same calls
        self._log = _Log()
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        # Handler threads end with the process; a keep-alive connection botocore never closes must not hang close().
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # --- rules and counters --------------------------------------------------------------------------------

    def fail(
        self,
        action: str,
        code: str,
        *,
        times: int | None = None,
        every: int = 1,
        per: Literal["request", "call"] = "request",
        status: int | None = None,
        message: str | None = None,
        service: str | None = None,
        where: dict[str, str] | None = None,
    ) -> Fault:
        """Add a rule; the first rule (in order added) that still has calls to fail is the one applied."""
        if every < 1 or (times is not None and times < 0):
            raise ValueError("every must be >= 1 and times >= 0")
        fault = Fault(
            action=action,
            code=code,
            status=status if status is not None else DEFAULT_STATUS.get(code, 400),
            message=message if message is not None else DEFAULT_MESSAGE.get(code, f"{code} (injected by FlakyAws)"),
            times=times,
            every=every,
            per=per,
            service=service,
            where=dict(where or {}),
        )
        with self._lock:
            self._faults.append(fault)
        return fault

    def answer(
        self, action: str, body: dict[str, object], *, times: int | None = None, service: str | None = None
    ) -> Canned:
        """Add a canned answer; the first one (in order added) that still has answers to give is served."""
        canned = Canned(action=action, body=body, times=times, service=service)
        with self._lock:
            self._canned.append(canned)
        return canned

    def answer_with(
        self, action: str, make: Callable[[AwsRequest], dict[str, object] | None], *, service: str | None = None
    ) -> Answerer:
        """Add a rule that answers `action` itself (on the proxy's threads, after faults and canned answers): what
        `make(request)` returns, or moto's answer when it returns None. For what moto does at a cost real AWS does
        not (a query it ignores, so that it lists a whole cluster to find one instance)."""
        rule = Answerer(action=action, make=make, service=service)
        with self._lock:
            self._answerers.append(rule)
        return rule

    def rewrite(
        self, action: str, edit: Callable[[AwsRequest, bytes], bytes], *, service: str | None = None
    ) -> Rewrite:
        """Add a rule that changes moto's successful answer to `action`: `edit(request, body)` returns the body to
        send instead (on the proxy's threads). Rules apply in the order added, each to the one before's output."""
        rule = Rewrite(action=action, edit=edit, service=service)
        with self._lock:
            self._rewrites.append(rule)
        return rule

    def slow(self, action: str, low_s: float, high_s: float | None = None, *, service: str | None = None) -> Latency:
        """Add a latency rule; a rule for the action itself wins over "*" whatever the order added."""
        if low_s < 0 or (high_s is not None and high_s < low_s):
            raise ValueError("need 0 <= low_s <= high_s")
        rule = Latency(action=action, low_s=low_s, high_s=low_s if high_s is None else high_s, service=service)
        with self._lock:
            self._latencies.append(rule)
        return rule

    def like_aws(self, profile: dict[str, tuple[float, float]] | None = None) -> None:
        """Every call as slow as AWS answers it (AWS_LATENCY_MS, or the given profile in milliseconds)."""
        for action, (low, high) in (profile or AWS_LATENCY_MS).items():
            self.slow(action, low / 1000, high / 1000)

    def delay(self, request: AwsRequest) -> float:
        with self._lock:
            rules = [r for r in self._latencies if r.applies(request)]
            named = [r for r in rules if r.action != "*"]
            chosen = named or rules
            return self._random.uniform(chosen[-1].low_s, chosen[-1].high_s) if chosen else 0.0

    def heal(self) -> None:
        """Drop every fault, canned answer, answerer and rewrite: from now on everything is forwarded, unchanged.
        Latency rules stay: AWS that works again is not AWS that answers at once."""
        with self._lock:
            self._faults.clear()
            self._canned.clear()
            self._answerers.clear()
            self._simulation = None
            self._rewrites.clear()

    def calls(self, action: str) -> int:
        """Requests seen for `action` (every botocore attempt counts), failed or forwarded."""
        with self._lock:
            return self._log.calls[action]

    def injected(self, action: str) -> int:
        """Requests for `action` answered with an injected error."""
        with self._lock:
            return self._log.injected[action]

    def seen(self) -> list[Seen]:
        with self._lock:
            return list(self._log.seen)

    @property
    def peak_in_flight(self) -> int:
        """The most requests the proxy held at once, from arrival until their answer left: what concurrent callers
        overlapped in, whatever moto or a loaded machine took."""
        with self._lock:
            return self._log.peak_in_flight

    def listen(self, listener: Listener) -> Callable[[], None]:
        """Tell `listener` of every request once it is answered, before the answer leaves (and before a latency
        rule holds it): what the caller will read is what moto already did. It runs on the proxy's threads, several
        at once, so it must be quick and thread-safe; an exception it raises is logged and the answer still goes.
        Returns a function that stops it."""
        with self._lock:
            self._listeners.append(listener)

        def stop() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return stop

    def tell(self, answered: Answered) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(answered)
            except Exception:
                log.exception("FlakyAws listener failed on %s", answered.request.action)

    # --- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> FlakyAws:
        # Short poll interval: shutdown() waits for the serve loop to notice.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="flaky-aws", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> FlakyAws:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- request handling (proxy threads) ------------------------------------------------------------------

    def decide(self, request: AwsRequest) -> Fault | Canned | None:
        with self._lock:
            self._log.calls[request.action] += 1
            for canned in self._canned:
                if canned.applies(request):
                    return canned
            for fault in self._faults:
                if fault.applies(request):
                    self._log.injected[request.action] += 1
                    return fault
            return None

    def arrived(self) -> None:
        with self._lock:
            self._log.in_flight += 1
            self._log.peak_in_flight = max(self._log.peak_in_flight, self._log.in_flight)

    def left(self) -> None:
        with self._lock:
            self._log.in_flight -= 1

    def record(self, request: AwsRequest, status: int, fault: Fault | None) -> None:
        with self._lock:
            self._log.seen.append(Seen(request=request, status=status, fault=fault.code if fault else None))

    def simulate_policy(self, denied: Iterable[str] = (), *, decision: Decision = "implicitDeny") -> PolicySimulation:
        """Answer iam:SimulatePrincipalPolicy, which moto lacks: every action asked is allowed but `denied`, which get
        `decision`. A fault rule for the action still wins (the caller may not simulate at all)."""
        simulation = PolicySimulation(denied=frozenset(denied), decision=decision)
        with self._lock:
            self._simulation = simulation
        return simulation

    def simulated(self, request: AwsRequest) -> bytes | None:
        with self._lock:
            simulation = self._simulation
        if simulation is None or request.action != "SimulatePrincipalPolicy" or request.protocol != "query":
            return None
        return simulation.answer(request.params)

    def made(self, request: AwsRequest) -> dict[str, object] | None:
        with self._lock:
            rules = [r for r in self._answerers if r.applies(request)]
        for rule in rules:
            made = rule.make(request)
            if made is not None:
                return made
        return None

    def rewritten(self, request: AwsRequest, status: int, body: bytes) -> bytes:
        if not 200 <= status < 300:
            return body
        with self._lock:
            rules = [r for r in self._rewrites if r.applies(request)]
        for rule in rules:
            body = rule.edit(request, body)
        return body

    def canned_served(self, action: str) -> int:
        with self._lock:
            return sum(c.served for c in self._canned if c.action == action)


def forward(
    upstream: tuple[str, int], method: str, path: str, headers: list[tuple[str, str]], body: bytes
) -> tuple[int, list[tuple[str, str]], bytes]:
    """One request to moto, as it came: (status, headers, body)."""
    # One connection per request: simple, and moto is on loopback, so the handshake costs nothing.
    conn = http.client.HTTPConnection(*upstream, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.getheaders(), response.read()
    finally:
        conn.close()


def parse_request(headers: dict[str, str], path: str, body: bytes) -> AwsRequest:
    """Service and action of a botocore request, for the json and query (and ec2) protocols."""
    service = ""
    auth = headers.get("authorization", "")
    if "Credential=" in auth:
        # Credential=AKID/20240101/us-east-1/ec2/aws4_request
        scope = auth.split("Credential=", 1)[1].split(",", 1)[0].split("/")
        if len(scope) >= 5:
            service = scope[3]
    attempt = 1
    for part in headers.get("amz-sdk-request", "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == "attempt" and value.isdigit():
            attempt = int(value)
    # Without the header (not botocore), each request is a call of its own.
    invocation = headers.get("amz-sdk-invocation-id") or str(uuid.uuid4())
    target = headers.get("x-amz-target")
    if target:
        action = target.rsplit(".", 1)[-1]
        return AwsRequest(
            service=service, action=action, protocol="json", attempt=attempt, invocation=invocation, body=body
        )
    form = parse_qs(urlsplit(path).query)
    if "x-www-form-urlencoded" in headers.get("content-type", ""):
        form.update(parse_qs(body.decode("utf-8", "replace")))
    action = form.get("Action", [""])[0]
    protocol = "query" if action else "other"
    params = {key: values[0] for key, values in form.items()}
    return AwsRequest(
        service=service,
        action=action,
        protocol=protocol,
        attempt=attempt,
        invocation=invocation,
        params=params,
        body=body,
    )


def error_response(request: AwsRequest, fault: Fault) -> tuple[list[tuple[str, str]], bytes]:
    """AWS's error body for the request's protocol: what botocore's parsers expect from the real service."""
    request_id = str(uuid.uuid4())
    if request.protocol == "json":
        body = json.dumps({"__type": fault.code, "message": fault.message}).encode()
        return [("Content-Type", "application/x-amz-json-1.1"), ("x-amzn-RequestId", request_id)], body
    code, message = escape(fault.code), escape(fault.message)
    if request.service == "ec2":
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors>"
            f"<RequestID>{request_id}</RequestID></Response>"
        )
    else:
        kind = "Receiver" if fault.status >= 500 else "Sender"
        xml = (
            "<ErrorResponse>"
            f"<Error><Type>{kind}</Type><Code>{code}</Code><Message>{message}</Message></Error>"
            f"<RequestId>{request_id}</RequestId></ErrorResponse>"
        )
    return [("Content-Type", "text/xml;charset=UTF-8"), ("x-amzn-RequestId", request_id)], xml.encode()


def _handler_for(proxy: FlakyAws) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.1: botocore keeps connections alive; every answer below carries a Content-Length.
        protocol_version = "HTTP/1.1"

        def _handle(self) -> None:
            proxy.arrived()
            try:
                self._answer()
            except (BrokenPipeError, ConnectionResetError):
                # The caller gave up waiting (its read timeout) and hung up; the call took effect, as it does on AWS
                # when a client stops listening. Not an error of the proxy's: no traceback on the demo's output.
                self.close_connection = True
            finally:
                proxy.left()

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            request = parse_request(headers, self.path, body)
            delay = proxy.delay(request)
            started = time.monotonic()
            decided = proxy.decide(request)
            fault = decided if isinstance(decided, Fault) else None
            made = proxy.made(request) if decided is None else None
            simulated = proxy.simulated(request) if decided is None and made is None else None
            # HEAD (S3's HeadObject): no body either way, and the length said is moto's, the object's.
            head_length: str | None = None
            if isinstance(decided, Canned) or made is not None:
                out_body = json.dumps(decided.body if isinstance(decided, Canned) else made).encode()
                out_headers = [("Content-Type", "application/x-amz-json-1.1"), ("x-amzn-RequestId", str(uuid.uuid4()))]
                status = 200
            elif simulated is not None:
                out_body = simulated
                out_headers = [("Content-Type", "text/xml"), ("x-amzn-RequestId", str(uuid.uuid4()))]
                status = 200
            elif fault is not None:
                out_headers, out_body = error_response(request, fault)
                status = fault.status
            else:
                forwarded = [(k, v) for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP]
                status, upstream_headers, out_body = forward(proxy.upstream, self.command, self.path, forwarded, body)
                # send_response() writes its own Server and Date.
                out_headers = [(k, v) for k, v in upstream_headers if k.lower() not in HOP_BY_HOP | {"server", "date"}]
                out_body = proxy.rewritten(request, status, out_body)
                if self.command == "HEAD":
                    head_length = next((v for k, v in upstream_headers if k.lower() == "content-length"), "0")
            proxy.record(request, status, fault)
            proxy.tell(Answered(request, status, out_body, time.monotonic() - started))
            # The delay covers moto's own time: the answer leaves no sooner than AWS's would.
            left = delay - (time.monotonic() - started)
            if left > 0:
                time.sleep(left)
            self.send_response(status)
            for name, value in out_headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(out_body)) if head_length is None else head_length)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(out_body)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per request on stderr would drown pytest's output

    return Handler
