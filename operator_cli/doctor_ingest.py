"""`autorepair doctor`'s ingest check: the ingest's /healthz answers 200 over TLS whose certificate verifies against
the CA the hosts trust (`--ingest-ca`, as the probe's SSL_CERT_FILE; else this machine's trust store)."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
from http.client import HTTPException
from pathlib import Path
from urllib.parse import urlsplit

from contract.ingest import HEALTH_PATH
from operator_cli.doctor_checks import Doctor, Verdict, failed, passed, skipped
from operator_cli.healthcheck import get, reason

TIMEOUT_S = 10.0
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
_UNREACHABLE_FIX = (
    "start `autorepair ingest` there, or give the URL the hosts use (--ingest), and open its port to here"
)


def healthz_url(ingest_url: str) -> str:
    """The probes' --ingest URL is the ingest's base; its health is at HEALTH_PATH beneath it."""
    base = ingest_url.rstrip("/")
    return base if base.endswith(HEALTH_PATH) else f"{base}{HEALTH_PATH}"


def _get(url: str, ca: Path | None) -> Verdict:
    """One GET, blocking: a verdict on what answered (or did not)."""
    trust = f"the CA in {ca}" if ca else "this machine's trust store"
    try:
        context = ssl.create_default_context(cafile=str(ca) if ca else None)
    except (OSError, ssl.SSLError) as err:
        return failed(f"cannot read --ingest-ca {ca}: {err}", "give the PEM file of the CA that signed the certificate")
    try:
        status, body = get(url, TIMEOUT_S, context)
    except urllib.error.URLError as err:
        if isinstance(err.reason, ssl.SSLCertVerificationError):
            return failed(
                f"{url}: its certificate does not verify against {trust}: {err.reason.verify_message}",
                "give the CA that signed it with --ingest-ca (the hosts trust it as SSL_CERT_FILE: install-probe.sh's "
                "INGEST_CA_PEM), or reissue ingest.tls_cert for this host name from a CA the hosts trust",
            )
        return failed(f"{url} unreachable: {err.reason}", _UNREACHABLE_FIX)
    except (OSError, HTTPException, ValueError) as err:
        return failed(f"{url} unreachable: {err or type(err).__name__}", _UNREACHABLE_FIX)
    if status != 200:
        return failed(
            f"{url} answered {status}: {reason(body)}",
            "the ingest is up but not ready: its reason above (503: it cannot reach Temporal)",
        )
    return passed(f"{url} answered 200, its certificate verified against {trust}")


async def ingest_healthy(doc: Doctor) -> Verdict:
    url = doc.ingest_url
    if url is None:
        return skipped("no --ingest URL given")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return failed(f"--ingest {url!r} is not an https:// URL", "give the URL the probes use: https://HOST:PORT")
    if parts.scheme == "http" and parts.hostname not in _LOOPBACK:
        return failed(
            f"{url}: plain HTTP off loopback, which the probes refuse",
            "serve the ingest over TLS (ingest.tls_cert and tls_key, or a load balancer's) and give its https:// URL",
        )
    return await asyncio.to_thread(_get, healthz_url(url), doc.ingest_ca)
