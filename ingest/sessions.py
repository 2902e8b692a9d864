"""Session tokens: after one report proven through STS, the ingest hands the host a short-lived token bound to the
instance STS named, so that its next reports cost no STS call.

A token is `<instance-id>.<expiry epoch s>.<HMAC-SHA256 of the ingest id, instance id and expiry>`: any replica
holding the same `ingest.session_secret` checks it without shared state (with none set, each replica makes its own
secret at start, and a token is good only where it was issued; a host refused one proves itself again). It speaks
for that instance only, never for an access key: a host with the token still passes every other check (the report
names that instance, the membership, the rate limits). It is a bearer token, carried only over HTTPS, and lives
`ingest.session_ttl` (15 minutes by default): revoking a host's role takes effect when its token expires.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from datetime import timedelta

from contract.config import IngestSettings
from ingest.identity import Caller, Refused

SESSION_ARN = "session-token"


class Sessions:
    def __init__(self, settings: IngestSettings, *, clock: Callable[[], float] = time.time) -> None:
        secret = settings.session_secret.get_secret_value() if settings.session_secret else None
        self._key = secret.encode() if secret else secrets.token_bytes(32)
        self._ingest_id = settings.id
        self._ttl = settings.session_ttl
        self._clock = clock

    @property
    def ttl(self) -> timedelta:
        return self._ttl

    def issue(self, caller: Caller) -> str:
        """A token for the instance `caller` was proven to speak for."""
        assert caller.instance_id is not None
        expires = int(self._clock() + self._ttl.total_seconds())
        return f"{caller.instance_id}.{expires}.{self._sign(caller.instance_id, expires)}"

    def check(self, token: str) -> Caller:
        """The instance a token speaks for, or Refused(401): the host then proves itself through STS again."""
        rest = token.rsplit(".", 2)
        if len(rest) != 3 or not rest[0] or not rest[1].isdigit():
            raise Refused(401, "the session token is malformed; send a proof")
        instance_id, expires_text, signature = rest
        expires = int(expires_text)
        if not hmac.compare_digest(signature.encode(), self._sign(instance_id, expires).encode()):
            raise Refused(401, "the session token was not issued by this ingest (or its secret changed); send a proof")
        if expires < self._clock():
            raise Refused(401, "the session token has expired; send a proof")
        return Caller(instance_id=instance_id, account="", arn=SESSION_ARN, role_arn="")

    def _sign(self, instance_id: str, expires: int) -> str:
        message = f"{self._ingest_id}\n{instance_id}\n{expires}".encode()
        digest = hmac.new(self._key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")
