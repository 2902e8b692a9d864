"""The webhook sink's one try: a signed POST of the event's JSON line, never followed through a redirect.

`publish_event` makes one try per event with a short timeout (`events.webhook_timeout`); what the receiver does not
take waits in the webhook's event outbox, a Temporal workflow (workflows/event_outbox.py), which tries again later.

Receivers must tolerate redelivery (a request that timed out may still have been processed): drop duplicates by the
`event_id` in the body or the `X-Autorepair-Event-Id` header. Order holds per outbox: an event never overtakes an
older one that waits; with several workers, order by the event's `time`. Every attempt carries
`X-Autorepair-Timestamp`, its own Unix time in seconds; with `webhook_secret` set, `X-Autorepair-Signature:
sha256=<hex>` is the HMAC-SHA256 under the secret of the timestamp, a `.` and the exact request body, so a receiver
can reject a captured request replayed later (docs/operations.md, "The webhook sink", shows how). Redirects are not
followed (urllib would turn the POST into a body-less GET that might answer 2xx): a 3xx is a failed attempt like any
other, reported with its `Location`. The URL and the secret come from the delivering worker's settings and never
enter a workflow history.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import urllib.error
import urllib.request
from http.client import HTTPMessage
from typing import IO

from activities.aws import AwsCalls
from contract.config import EventSettings

SIGNATURE_HEADER = "X-Autorepair-Signature"
TIMESTAMP_HEADER = "X-Autorepair-Timestamp"
EVENT_ID_HEADER = "X-Autorepair-Event-Id"
EVENT_TYPE_HEADER = "X-Autorepair-Event-Type"


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The signature header's value: HMAC-SHA256 of `{timestamp}.{body}`, as Stripe and Slack sign theirs."""
    return "sha256=" + hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Refuse every redirect, so that the 3xx surfaces as an HTTPError. Followed, a 301/302/303 would resend the
    POST as a GET without its body, and a 2xx to that would count as delivered."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        return None


class WebhookClient:
    def __init__(self, settings: EventSettings, calls: AwsCalls) -> None:
        assert settings.webhook_url is not None
        self._calls = calls  # the worker's call threads, not asyncio's default executor (activities/event_sinks.py)
        self._url = settings.webhook_url
        self._secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret else None
        self._timeout = settings.webhook_timeout.total_seconds()
        self._opener = urllib.request.build_opener(_NoRedirects)

    async def post(self, body: bytes) -> str | None:
        """One attempt, bounded by the timeout as a whole; None on success, else why it failed."""
        try:
            # urllib's timeout bounds each socket operation, not the request; wait_for bounds the request. A thread
            # left behind by wait_for ends at its own socket timeout.
            return await asyncio.wait_for(self._calls.run("webhook:POST", self._post_blocking, body), self._timeout)
        except TimeoutError:
            return f"no answer within {self._timeout:g}s"

    def _post_blocking(self, body: bytes) -> str | None:
        try:
            head = json.loads(body)
        except ValueError:
            head = {}
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "gpu-autorepair",
            EVENT_ID_HEADER: str(head.get("event_id", "")),
            EVENT_TYPE_HEADER: str(head.get("type", "")),
        }
        # The time of this attempt, not of the event: a redelivery hours later is signed afresh and still passes a
        # receiver's freshness check, while a captured request replayed later does not.
        timestamp = str(int(time.time()))
        headers[TIMESTAMP_HEADER] = timestamp
        if self._secret is not None:
            headers[SIGNATURE_HEADER] = sign(self._secret, timestamp, body)
        request = urllib.request.Request(self._url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=self._timeout) as response:
                response.read()
                status = int(response.status)
        except urllib.error.HTTPError as err:
            err.close()
            if 300 <= err.code < 400:
                location = err.headers.get("Location") if err.headers is not None else None
                return (
                    f"HTTP {err.code} {err.reason}, a redirect to {location!r}: redirects are not followed, point "
                    f"events.webhook_url at the receiver itself"
                )
            return f"HTTP {err.code} {err.reason}"
        except Exception as err:
            # Refused, reset, DNS, TLS, a socket timeout, a garbled answer (http.client.HTTPException): whatever
            # went wrong with one attempt, the answer is the same, queue the event and try again later.
            return f"{type(err).__name__}: {err}"
        return None if 200 <= status < 300 else f"HTTP {status}"
