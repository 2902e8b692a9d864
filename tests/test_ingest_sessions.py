"""Session tokens (ingest/sessions.py): after one report proven through STS, a host's next reports cost no STS call;
a token speaks only for the instance it was issued to, only at ingests holding the same secret, and only until it
expires. Against the real ingest over HTTP, moto's STS and the real Temporal dev server (tests/test_ingest.py's
stack)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import aiohttp
import pytest
from pydantic import SecretStr

from contract.config import IngestSettings
from contract.ingest import FINDINGS_PATH, HEARTBEATS_PATH, SESSION_HEADER
from contract.probe import Heartbeat
from ingest.identity import Caller, Refused
from ingest.sessions import Sessions
from tests import test_ingest
from tests.test_ingest import Stack, finding_about, post, running_ingest

stack = test_ingest.stack  # the module-scoped fixture: a worker, moto's IAM role for the hosts, the group


def heartbeat(instance_id: str, group: str) -> Heartbeat:
    return Heartbeat(instance_id=instance_id, group=group, sent_at=datetime.now(UTC))


def beat(instance_id: str, group: str) -> bytes:
    return heartbeat(instance_id, group).model_dump_json().encode()


async def with_token(url: str, path: str, body: bytes, token: str) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", SESSION_HEADER: token}
    async with aiohttp.ClientSession() as session, session.post(f"{url}{path}", data=body, headers=headers) as resp:
        return resp.status, await resp.text()


async def test_a_probe_proves_itself_once_then_reports_on_its_session_token(stack: Stack) -> None:
    host = stack.launch(group=stack.group)
    async with running_ingest(stack) as (url, ingest), stack.reporter(url, host) as reporter:
        for _ in range(4):
            await reporter.send_heartbeat(
                Heartbeat(instance_id=host.instance_id, group=stack.group, sent_at=datetime.now(UTC)), "q"
            )
        await reporter.send_finding(finding_about(host.instance_id, stack.group), "q")
        assert reporter.proofs_signed == 1
        assert ingest.metrics.value("autorepair_ingest_reports_relayed_total", kind="heartbeat") == 4
        assert ingest.metrics.value("autorepair_ingest_reports_relayed_total", kind="finding") == 1


async def test_a_token_speaks_only_for_its_instance_and_only_where_it_was_issued(stack: Stack) -> None:
    me, other = stack.launch(group=stack.group), stack.launch(group=stack.group)
    async with running_ingest(stack) as (url, ingest):
        status, _, accepted = await post(
            url, HEARTBEATS_PATH, beat(me.instance_id, stack.group), signer=me, stack=stack
        )
        assert status == 202 and accepted["session_expires_in_s"] == 15 * 60
        token = accepted["session"]
        assert token.startswith(f"{me.instance_id}.")

        # About another instance: refused as any report about another instance is.
        forged = finding_about(other.instance_id, stack.group).model_dump_json().encode()
        status, text = await with_token(url, FINDINGS_PATH, forged, token)
        assert status == 403 and "only about itself" in text
        # The same signature under another instance's name: not a token this ingest issued.
        tampered = other.instance_id + token[len(me.instance_id) :]
        status, text = await with_token(url, FINDINGS_PATH, forged, tampered)
        assert status == 401 and "not issued by this ingest" in text
        for bad in ("x", "a.b.c", f"{me.instance_id}.notanumber.sig"):
            status, _ = await with_token(url, HEARTBEATS_PATH, beat(me.instance_id, stack.group), bad)
            assert status == 401, bad
        assert ingest.metrics.value("autorepair_ingest_reports_refused_total", status="401", reason="session") == 4

    # Another replica with a secret of its own does not know it; one sharing the secret does.
    async with running_ingest(stack) as (url, _):
        status, text = await with_token(url, HEARTBEATS_PATH, beat(me.instance_id, stack.group), token)
        assert status == 401 and "send a proof" in text
        # The probe's reporter falls back to a proof at once, within the same send.
        async with stack.reporter(url, me) as reporter:
            reporter._session = (token, float("inf"))
            await reporter.send_heartbeat(
                Heartbeat(instance_id=me.instance_id, group=stack.group, sent_at=datetime.now(UTC)), "q"
            )
            assert reporter.proofs_signed == 1 and reporter._session is not None and reporter._session[0] != token

    shared = stack.with_ingest(session_secret=SecretStr("shared-between-replicas"))
    async with running_ingest(stack, shared) as (first, _), running_ingest(stack, shared) as (second, _):
        status, _, accepted = await post(
            first, HEARTBEATS_PATH, beat(me.instance_id, stack.group), signer=me, stack=stack
        )
        assert status == 202
        status, _ = await with_token(second, HEARTBEATS_PATH, beat(me.instance_id, stack.group), accepted["session"])
        assert status == 202


def test_a_token_expires_and_the_ttl_is_bounded() -> None:
    now = [1_000_000.0]
    sessions = Sessions(IngestSettings(session_ttl=timedelta(minutes=5)), clock=lambda: now[0])
    token = sessions.issue(Caller(instance_id="i-0abc", account="123456789012", arn="arn", role_arn="role"))
    assert sessions.check(token).instance_id == "i-0abc"
    now[0] += 5 * 60 + 1
    with pytest.raises(Refused, match="expired"):
        sessions.check(token)
    with pytest.raises(ValueError):
        IngestSettings(session_ttl=timedelta(hours=2))
