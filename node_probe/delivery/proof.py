"""The host's half of "a host speaks only for itself": a signed, unsent sts:GetCallerIdentity (contract/ingest.py).

The probe signs a GetCallerIdentity POST with the host's own AWS credentials (SigV4, botocore's signer) and hands
it to the ingest in the PROOF_HEADER; the ingest sends it to STS and learns from the answer whose credentials signed
it. The ingest's id and the SHA-256 of the report body are signed in as headers, so one proof is good for one
ingest and one body, and only for PROOF_WINDOW_S around its X-Amz-Date. The ingest refuses a proof it has seen
before: sign a fresh one for every attempt, retries included.

Nothing here touches the network; only `ambient_credentials` may (botocore's credential chain reads IMDS on EC2).
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from urllib.parse import urlsplit

import boto3
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials, ReadOnlyCredentials

from contract.ingest import (
    BODY_SHA256_HEADER,
    GET_CALLER_IDENTITY_BODY,
    INGEST_ID_HEADER,
    NONCE_HEADER,
    SignedStsRequest,
)

CONTENT_TYPE = "application/x-www-form-urlencoded; charset=utf-8"
_DEFAULT_PORTS = {"http": 80, "https": 443}


class MissingCredentials(RuntimeError):
    """No AWS credentials on this host: the probe cannot prove who it is to the ingest."""


def host_header(url: str) -> str:
    """The Host header SigV4 signs for `url`: the lower-cased host, with the port only when it is not the scheme's
    default (the same rule as botocore's signer and as the ingest's check)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    if parts.port is not None and parts.port != _DEFAULT_PORTS.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


def sign_proof(
    body: bytes,
    *,
    ingest_id: str,
    sts_endpoint: str,
    region: str,
    credentials: ReadOnlyCredentials | Credentials,
) -> str:
    """The PROOF_HEADER value for a report with this `body`: base64 of the JSON of a SignedStsRequest.

    The request is a POST of GET_CALLER_IDENTITY_BODY to `sts_endpoint`, SigV4-signed for service "sts" in `region`
    with INGEST_ID_HEADER and BODY_SHA256_HEADER among its SignedHeaders (botocore signs every header on the
    request). It is signed now (X-Amz-Date) and never sent from here.
    """
    parts = urlsplit(sts_endpoint)
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"sts_endpoint must be an http(s) URL, not {sts_endpoint!r}")
    if not credentials.access_key or not credentials.secret_key:
        raise MissingCredentials("the AWS credentials have no access key or secret key")
    request = AWSRequest(
        method="POST",
        url=sts_endpoint,
        data=GET_CALLER_IDENTITY_BODY,
        headers={
            "Content-Type": CONTENT_TYPE,
            # Set here rather than left to the HTTP client, so it is on the proof exactly as it was signed.
            "Host": host_header(sts_endpoint),
            INGEST_ID_HEADER: ingest_id,
            BODY_SHA256_HEADER: hashlib.sha256(body).hexdigest(),
            NONCE_HEADER: secrets.token_hex(16),
        },
    )
    SigV4Auth(credentials, "sts", region).add_auth(request)
    signed = SignedStsRequest(
        method="POST",
        url=sts_endpoint,
        headers={name: str(value) for name, value in request.headers.items()},
        body=GET_CALLER_IDENTITY_BODY,
    )
    return base64.b64encode(signed.model_dump_json().encode()).decode("ascii")


def ambient_credentials(region: str) -> ReadOnlyCredentials:
    """The host's own credentials from botocore's usual chain (on EC2: the instance profile, through IMDS), frozen
    so one proof is signed with one consistent key, secret and token."""
    credentials = boto3.Session(region_name=region).get_credentials()
    if credentials is None:
        raise MissingCredentials(
            "no AWS credentials found (instance profile, environment, or shared config): "
            "the probe cannot sign its identity proof for the ingest"
        )
    return credentials.get_frozen_credentials()
