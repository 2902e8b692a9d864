"""The ingest's wire protocol: how a GPU host reports its own findings and heartbeats over HTTPS.

A host never talks to Temporal. It POSTs the report (the JSON of a GpuFinding or a Heartbeat) to the ingest, and
proves who it is the way Vault's AWS auth does: it signs an `sts:GetCallerIdentity` request with its own AWS
credentials (SigV4) without sending it, and hands that signed request to the ingest in the PROOF_HEADER. The signed
headers include the ingest's id and the SHA-256 of the report body, so the proof is good for that ingest and that
body only. The ingest sends the signed request to STS itself; STS answers with the caller's ARN, whose assumed-role
session name is the EC2 instance id for instance-profile credentials.
"""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, Field

from contract.limits import MAX_TEXT

FINDINGS_PATH: Final = "/v1/findings"  # body: GpuFinding JSON
HEARTBEATS_PATH: Final = "/v1/heartbeats"  # body: Heartbeat JSON
HEALTH_PATH: Final = "/healthz"  # no identity check: for the load balancer
METRICS_PATH: Final = "/metrics"  # Prometheus text, on the ingest's and the probe's metrics ports (contract/healthz.py)

# On the report request: base64 of the JSON of a SignedStsRequest.
PROOF_HEADER: Final = "X-Autorepair-Proof"
# Instead of a proof: the session token the ingest handed out with an earlier accepted report (Accepted.session).
SESSION_HEADER: Final = "X-Autorepair-Session"
# Signed into the GetCallerIdentity request (so STS checked them as part of the signature).
INGEST_ID_HEADER: Final = "X-Autorepair-Ingest-Id"
BODY_SHA256_HEADER: Final = "X-Autorepair-Body-Sha256"
# A fresh random value per proof: SigV4 is deterministic, so without it a retry of the same body within the same
# second would be the same proof and be refused as a replay.
NONCE_HEADER: Final = "X-Autorepair-Nonce"

# A report body larger than this is refused (413) before it is read further.
MAX_REPORT_BYTES: Final = 64 * 1024
# The signed request's X-Amz-Date must be within this many seconds of the ingest's clock.
PROOF_WINDOW_S: Final = 300

GET_CALLER_IDENTITY_BODY: Final = "Action=GetCallerIdentity&Version=2011-06-15"


class SignedStsRequest(BaseModel):
    """A SigV4-signed sts:GetCallerIdentity POST, as the host signed it and did not send it."""

    method: str = Field(max_length=8)
    url: str = Field(max_length=512)
    headers: dict[str, str] = Field(max_length=32)
    body: str = Field(max_length=256)


class Accepted(BaseModel):
    """The ingest's answer to a report it relayed (202). After a proof, a session token for the next reports: send
    it in SESSION_HEADER instead of a proof until it expires or is refused (401), then prove yourself again."""

    status: int = 202
    session: str | None = Field(default=None, max_length=512)
    session_expires_in_s: int | None = None


# Refusal.kind of a report naming a group the ingest's settings do not have (a probe started with a wrong --group).
REFUSED_UNKNOWN_GROUP: Final = "unknown_group"


class Refusal(BaseModel):
    """The ingest's answer to a report it did not accept (4xx/5xx), for the host's log and `probe report`."""

    status: int
    reason: str = Field(max_length=MAX_TEXT)
    # Which check refused it, as the ingest's metrics name it (not_member, unknown_group, ...); "" from ingests
    # before it.
    kind: str = Field(default="", max_length=64)
