"""`autorepair healthcheck URL`: what a container's health check runs, since the images have no curl.

Exit 0 on HTTP 200; 1 otherwise, with one line saying why (the endpoint's own reason when it gives one). The standard
library and operator_cli/output.py only: an orchestrator runs it every few seconds, so it must not load a Temporal or
AWS client (nor rich, which output.py imports only for a table).
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import urllib.error
import urllib.request
from http.client import HTTPException

from operator_cli.exit_codes import FAILED, OK
from operator_cli.output import add_output_arguments, emit

DEFAULT_TIMEOUT_S = 5.0
_MAX_BODY = 4096


def add_healthcheck_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", metavar="URL", help="e.g. http://127.0.0.1:8481/healthz (the worker's)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"give up after this long (default: {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="do not verify the TLS certificate (the ingest's own, asked on 127.0.0.1 where its name does not match)",
    )
    # text: silent when healthy, as a container's health check wants; json/jsonl: the verdict as a document too.
    add_output_arguments(parser, json_flag=False)


def reason(body: bytes) -> str:
    """The endpoint's reason: `reason` of a JSON answer (every /healthz of ours, the ingest's Refusal), else the
    body's first line."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and answer.get("reason"):
        return str(answer["reason"])
    return text.splitlines()[0] if text else "no reason given"


def get(url: str, timeout_s: float, context: ssl.SSLContext | None) -> tuple[int, bytes]:
    """One GET, blocking: the status and the start of the body, an error status's too. URLError (its reason:
    refused, a certificate that does not verify), OSError, HTTPException or ValueError when no answer came."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as response:
            return response.status, response.read(_MAX_BODY)
    except urllib.error.HTTPError as err:
        return err.code, err.read(_MAX_BODY)


def check(url: str, timeout_s: float, *, insecure: bool = False) -> tuple[bool, str]:
    """(healthy, what to say): healthy only on HTTP 200."""
    context = None
    if insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    try:
        status, body = get(url, timeout_s, context)
    except urllib.error.URLError as err:
        return False, f"{url} unreachable: {err.reason}"
    except (OSError, HTTPException, ValueError) as err:  # timeouts, resets, a malformed answer or URL
        return False, f"{url} unreachable: {err or type(err).__name__}"
    if status != 200:
        return False, f"{url} answered {status}: {reason(body)}"
    return True, f"{url}: ok"


def run_healthcheck(args: argparse.Namespace) -> int:
    healthy, said = check(args.url, args.timeout, insecure=args.insecure)
    emit(args, {"url": args.url, "healthy": healthy, "detail": said}, lambda wide: None)
    if not healthy:
        print(f"autorepair healthcheck: {said}", file=sys.stderr)
        return FAILED
    return OK
