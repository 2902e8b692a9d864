"""A host speaks only for itself: the proof a host signs (node_probe/delivery/proof.py) and the ingest's check of it
(ingest/identity.py), against moto's real STS over HTTP.

moto checks SigV4 signatures only with its IAM auth on, which is one switch for the whole server (POST
/moto-api/reset-auth), so the tests that need STS to reject a bad signature run against a moto server of their own.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import pytest
from aiohttp import web
from botocore.credentials import ReadOnlyCredentials

from contract.config import IngestSettings
from contract.ingest import BODY_SHA256_HEADER, GET_CALLER_IDENTITY_BODY, INGEST_ID_HEADER
from ingest import identity
from ingest.identity import Caller, ProofVerifier, Refused
from node_probe.delivery.proof import MissingCredentials, ambient_credentials, sign_proof
from simulator.servers import MotoServer, free_port

ACCOUNT = "123456789012"  # moto's default
INSTANCE = "i-0123456789abcdef0"
TASK_ID = "0123456789abcdef0123456789abcdef"  # an ECS task id, as ECS names a task role's session
INGEST_ID = "ingest-under-test"
REGION = "us-east-1"
ROLE_NAME = "autorepair-identity-node"
# Allowlisted with its path; the assumed-role ARN STS answers has no path, so the verifier compares by name.
ROLE_ARN_WITH_PATH = f"arn:aws:iam::{ACCOUNT}:role/fleet/gpu/{ROLE_NAME}"
BODY = b'{"kind":"heartbeat","instance_id":"i-0123456789abcdef0"}'
TRUST = json.dumps(
    {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}],
    }
)


@dataclass(frozen=True)
class Identities:
    """Credentials made in one moto server: the instance profile's, an ECS task role's, a session that is neither's,
    one named almost like a task, an IAM user's."""

    endpoint: str
    instance: ReadOnlyCredentials
    ecs_task: ReadOnlyCredentials
    not_an_instance: ReadOnlyCredentials
    almost_a_task: ReadOnlyCredentials
    iam_user: ReadOnlyCredentials


def _make_identities(endpoint: str) -> Identities:
    setup = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION)
    iam: Any = setup.client("iam", endpoint_url=endpoint)
    sts: Any = setup.client("sts", endpoint_url=endpoint)
    role_arn = iam.create_role(RoleName=ROLE_NAME, Path="/fleet/gpu/", AssumeRolePolicyDocument=TRUST)["Role"]["Arn"]
    assert role_arn == ROLE_ARN_WITH_PATH

    def assume(session_name: str) -> ReadOnlyCredentials:
        creds = sts.assume_role(RoleArn=role_arn, RoleSessionName=session_name)["Credentials"]
        return ReadOnlyCredentials(creds["AccessKeyId"], creds["SecretAccessKey"], creds["SessionToken"])

    iam.create_user(UserName="autorepair-identity-operator")
    key = iam.create_access_key(UserName="autorepair-identity-operator")["AccessKey"]
    return Identities(
        endpoint=endpoint,
        instance=assume(INSTANCE),
        ecs_task=assume(TASK_ID),
        not_an_instance=assume("build-runner"),
        almost_a_task=assume(TASK_ID.upper()),
        iam_user=ReadOnlyCredentials(key["AccessKeyId"], key["SecretAccessKey"], None),
    )


@pytest.fixture(scope="module")
def ids(aws_env: str) -> Identities:
    """The session's moto server (signatures not checked): good for every check the ingest makes itself."""
    return _make_identities(aws_env)


@pytest.fixture(scope="module")
async def strict_ids(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Identities]:
    """A moto server of its own with IAM auth on after setup: STS there checks every signature."""
    server = MotoServer(Path(tmp_path_factory.mktemp("moto-auth")), free_port())
    await server.start()
    try:
        made = await asyncio.to_thread(_make_identities, server.endpoint_url)
        # The body is the number of requests still let through unchecked; not form-encoded, or moto reads no body.
        request = urllib.request.Request(
            f"{server.endpoint_url}/moto-api/reset-auth", data=b"0", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
        yield made
    finally:
        await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def settings(endpoint: str, **overrides: Any) -> IngestSettings:
    values: dict[str, Any] = {
        "id": INGEST_ID,
        "sts_endpoint": endpoint,
        "allowed_accounts": [ACCOUNT],
        "allowed_role_arns": [ROLE_ARN_WITH_PATH],
    }
    return IngestSettings(**(values | overrides))


def proof_for(creds: ReadOnlyCredentials, endpoint: str, body: bytes = BODY, ingest_id: str = INGEST_ID) -> str:
    return sign_proof(body, ingest_id=ingest_id, sts_endpoint=endpoint, region=REGION, credentials=creds)


def edited(proof: str, edit: Callable[[dict[str, Any]], None]) -> str:
    """The proof with its decoded JSON changed by `edit`, re-encoded (what a forger can do without the secret)."""
    document = json.loads(base64.b64decode(proof))
    edit(document)
    return base64.b64encode(json.dumps(document).encode()).decode()


async def refusal(verifier: ProofVerifier, proof: str | None, body: bytes = BODY) -> Refused:
    with pytest.raises(Refused) as caught:
        await verifier.verify(proof, body)
    assert str(caught.value) == caught.value.reason
    return caught.value


# --- the host's side -------------------------------------------------------------------------------------------


def test_the_proof_signs_the_ingest_id_and_the_body_digest() -> None:
    creds = ReadOnlyCredentials("ASIAEXAMPLE", "secret", "token")
    proof = proof_for(creds, "https://sts.us-east-1.amazonaws.com")
    document = json.loads(base64.b64decode(proof))
    headers = document["headers"]
    assert document["method"] == "POST"
    assert document["body"] == GET_CALLER_IDENTITY_BODY
    assert headers["Host"] == "sts.us-east-1.amazonaws.com"
    assert headers[INGEST_ID_HEADER] == INGEST_ID
    assert headers[BODY_SHA256_HEADER] == hashlib.sha256(BODY).hexdigest()
    assert headers["X-Amz-Security-Token"] == "token"
    authorization = headers["Authorization"]
    assert authorization.startswith("AWS4-HMAC-SHA256 Credential=ASIAEXAMPLE/")
    assert "/us-east-1/sts/aws4_request" in authorization
    signed = authorization.split("SignedHeaders=")[1].split(",")[0].split(";")
    assert {"host", "x-amz-date", "x-amz-security-token", INGEST_ID_HEADER.lower(), BODY_SHA256_HEADER.lower()} <= set(
        signed
    )


# --- accepted --------------------------------------------------------------------------------------------------


async def test_an_instance_proves_itself_with_its_own_role(ids: Identities, http: aiohttp.ClientSession) -> None:
    caller = await ProofVerifier(settings(ids.endpoint), http).verify(proof_for(ids.instance, ids.endpoint), BODY)
    assert caller == Caller(
        instance_id=INSTANCE,
        account=ACCOUNT,
        arn=f"arn:aws:sts::{ACCOUNT}:assumed-role/{ROLE_NAME}/{INSTANCE}",
        role_arn=f"arn:aws:iam::{ACCOUNT}:role/{ROLE_NAME}",
    )


async def test_any_role_of_an_allowed_account_when_no_roles_are_listed(
    ids: Identities, http: aiohttp.ClientSession
) -> None:
    verifier = ProofVerifier(settings(ids.endpoint, allowed_role_arns=[]), http)
    assert (await verifier.verify(proof_for(ids.instance, ids.endpoint), BODY)).instance_id == INSTANCE


# --- refused before STS is asked ------------------------------------------------------------------------------


async def test_no_proof_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    verifier = ProofVerifier(settings(ids.endpoint), http)
    for missing in ("", None):
        refused = await refusal(verifier, missing)
        assert refused.status == 401
        assert "no identity proof" in refused.reason


async def test_garbage_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    verifier = ProofVerifier(settings(ids.endpoint), http)
    assert (await refusal(verifier, "%%% not base64 %%%")).status == 401
    not_json = await refusal(verifier, base64.b64encode(b"\x00\xffhello").decode())
    assert not_json.status == 401
    assert "not a signed STS request" in not_json.reason
    too_long = await refusal(verifier, "A" * (identity.MAX_PROOF_CHARS + 4))
    assert too_long.status == 401


async def test_a_proof_for_another_ingest_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    proof = proof_for(ids.instance, ids.endpoint, ingest_id="some-other-ingest")
    refused = await refusal(ProofVerifier(settings(ids.endpoint), http), proof)
    assert refused.status == 403
    assert "another ingest" in refused.reason


async def test_a_body_changed_after_signing_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    proof = proof_for(ids.instance, ids.endpoint)
    refused = await refusal(ProofVerifier(settings(ids.endpoint), http), proof, body=BODY.replace(b"0123", b"9999"))
    assert refused.status == 403
    assert "another body" in refused.reason


async def test_a_replayed_proof_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    verifier = ProofVerifier(settings(ids.endpoint), http)
    proof = proof_for(ids.instance, ids.endpoint)
    assert (await verifier.verify(proof, BODY)).instance_id == INSTANCE
    refused = await refusal(verifier, proof)
    assert refused.status == 401
    assert "replay" in refused.reason
    # Two copies at once: one passes, the other is the replay.
    twin = proof_for(ids.instance, ids.endpoint)
    results = await asyncio.gather(verifier.verify(twin, BODY), verifier.verify(twin, BODY), return_exceptions=True)
    assert sorted(type(result).__name__ for result in results) == ["Caller", "Refused"]


async def test_the_same_report_signed_again_at_once_is_no_replay(ids: Identities, http: aiohttp.ClientSession) -> None:
    """SigV4 is deterministic; the signed nonce makes a retry within the same second a proof of its own."""
    verifier = ProofVerifier(settings(ids.endpoint), http)
    first, second = proof_for(ids.instance, ids.endpoint), proof_for(ids.instance, ids.endpoint)
    assert first != second
    assert (await verifier.verify(first, BODY)).instance_id == INSTANCE
    assert (await verifier.verify(second, BODY)).instance_id == INSTANCE


async def test_an_expired_proof_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    verifier = ProofVerifier(settings(ids.endpoint), http, clock=lambda: time.time() + 400)
    refused = await refusal(verifier, proof_for(ids.instance, ids.endpoint))
    assert refused.status == 401
    assert "expired" in refused.reason
    assert "s old" in refused.reason
    from_the_future = ProofVerifier(settings(ids.endpoint), http, clock=lambda: time.time() - 400)
    refused = await refusal(from_the_future, proof_for(ids.instance, ids.endpoint))
    assert refused.status == 401
    assert "in the future" in refused.reason


async def test_a_host_header_pointing_elsewhere_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    def elsewhere(document: dict[str, Any]) -> None:
        document["headers"]["Host"] = "sts.attacker.example"

    refused = await refusal(
        ProofVerifier(settings(ids.endpoint), http), edited(proof_for(ids.instance, ids.endpoint), elsewhere)
    )
    assert refused.status == 401
    assert "sts.attacker.example" in refused.reason


async def test_the_url_in_the_proof_is_never_used(ids: Identities, http: aiohttp.ClientSession) -> None:
    """The ingest sends the proof to its own STS endpoint only, whatever URL the proof names."""
    hits: list[str] = []

    async def record(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(status=500)

    async with _fake_server(record) as decoy:

        def to_decoy(document: dict[str, Any]) -> None:
            document["url"] = decoy

        proof = edited(proof_for(ids.instance, ids.endpoint), to_decoy)
        caller = await ProofVerifier(settings(ids.endpoint), http).verify(proof, BODY)
    assert caller.instance_id == INSTANCE
    assert hits == []


async def test_an_unsigned_ingest_id_header_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    def unsign(document: dict[str, Any]) -> None:
        headers = document["headers"]
        headers["Authorization"] = headers["Authorization"].replace(f";{INGEST_ID_HEADER.lower()}", "")

    proof = edited(proof_for(ids.instance, ids.endpoint), unsign)
    assert INGEST_ID_HEADER.lower() not in json.loads(base64.b64decode(proof))["headers"]["Authorization"]
    refused = await refusal(ProofVerifier(settings(ids.endpoint), http), proof)
    assert refused.status == 401
    assert f"does not sign {INGEST_ID_HEADER.lower()}" in refused.reason


async def test_a_proof_signing_a_transport_header_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    def chunked(document: dict[str, Any]) -> None:
        headers = document["headers"]
        headers["Transfer-Encoding"] = "chunked"
        headers["Authorization"] = headers["Authorization"].replace(
            "SignedHeaders=", "SignedHeaders=transfer-encoding;"
        )

    refused = await refusal(
        ProofVerifier(settings(ids.endpoint), http), edited(proof_for(ids.instance, ids.endpoint), chunked)
    )
    assert refused.status == 401
    assert "transfer-encoding" in refused.reason


# --- refused after STS named the caller -------------------------------------------------------------------------


async def test_an_account_not_allowed_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    verifier = ProofVerifier(settings(ids.endpoint, allowed_accounts=["210987654321"], allowed_role_arns=[]), http)
    refused = await refusal(verifier, proof_for(ids.instance, ids.endpoint))
    assert refused.status == 403
    assert f"account {ACCOUNT} is not in ingest.allowed_accounts" in refused.reason

    nobody = ProofVerifier(settings(ids.endpoint, allowed_accounts=[], allowed_role_arns=[]), http)
    refused = await refusal(nobody, proof_for(ids.instance, ids.endpoint))
    assert refused.status == 403
    assert "allowed_accounts is empty" in refused.reason


async def test_a_role_not_allowed_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    verifier = ProofVerifier(
        settings(ids.endpoint, allowed_role_arns=[f"arn:aws:iam::{ACCOUNT}:role/other-role"]), http
    )
    refused = await refusal(verifier, proof_for(ids.instance, ids.endpoint))
    assert refused.status == 403
    assert f"role {ROLE_NAME}" in refused.reason


async def test_a_session_that_is_not_an_instance_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    refused = await refusal(ProofVerifier(settings(ids.endpoint), http), proof_for(ids.not_an_instance, ids.endpoint))
    assert refused.status == 403
    assert "'build-runner' is not an EC2 instance id" in refused.reason


async def test_an_ecs_task_role_proves_its_task_which_the_ingest_resolves_to_an_instance(
    ids: Identities, http: aiohttp.ClientSession
) -> None:
    caller = await ProofVerifier(settings(ids.endpoint), http).verify(proof_for(ids.ecs_task, ids.endpoint), BODY)
    assert caller == Caller(
        instance_id=None,
        account=ACCOUNT,
        arn=f"arn:aws:sts::{ACCOUNT}:assumed-role/{ROLE_NAME}/{TASK_ID}",
        role_arn=f"arn:aws:iam::{ACCOUNT}:role/{ROLE_NAME}",
        ecs_task_id=TASK_ID,
    )
    assert caller.on_instance(INSTANCE).instance_id == INSTANCE

    # Exactly ECS's shape: lower-case hex.
    refused = await refusal(ProofVerifier(settings(ids.endpoint), http), proof_for(ids.almost_a_task, ids.endpoint))
    assert refused.status == 403 and "nor an ECS task id" in refused.reason


async def test_an_iam_user_is_refused(ids: Identities, http: aiohttp.ClientSession) -> None:
    refused = await refusal(ProofVerifier(settings(ids.endpoint), http), proof_for(ids.iam_user, ids.endpoint))
    assert refused.status == 403
    assert f"arn:aws:iam::{ACCOUNT}:user/autorepair-identity-operator is not an assumed role" in refused.reason


def test_a_malformed_role_allowlist_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="allowed_role_arns"):
        ProofVerifier(settings("http://127.0.0.1:1", allowed_role_arns=["gpu-node"]), None)  # type: ignore[arg-type]


# --- STS checks the signature (moto with IAM auth on) ------------------------------------------------------------


async def test_with_signatures_checked_a_genuine_proof_verifies(
    strict_ids: Identities, http: aiohttp.ClientSession
) -> None:
    caller = await ProofVerifier(settings(strict_ids.endpoint), http).verify(
        proof_for(strict_ids.instance, strict_ids.endpoint), BODY
    )
    assert caller.instance_id == INSTANCE


async def test_a_forged_signature_is_refused_by_sts(strict_ids: Identities, http: aiohttp.ClientSession) -> None:
    forged = strict_ids.instance._replace(secret_key="not-the-secret-key")
    refused = await refusal(ProofVerifier(settings(strict_ids.endpoint), http), proof_for(forged, strict_ids.endpoint))
    assert refused.status == 401
    assert refused.reason == "STS refused the signature: SignatureDoesNotMatch"


async def test_signed_headers_edited_after_signing_are_refused_by_sts(
    strict_ids: Identities, http: aiohttp.ClientSession
) -> None:
    """A proof made for another ingest and another body, its headers rewritten to pass the local checks."""
    other_body = b'{"kind":"heartbeat","instance_id":"i-0fffffffffffffff0"}'
    proof = proof_for(strict_ids.instance, strict_ids.endpoint, body=other_body, ingest_id="some-other-ingest")

    def rewrite(document: dict[str, Any]) -> None:
        document["headers"][INGEST_ID_HEADER] = INGEST_ID
        document["headers"][BODY_SHA256_HEADER] = hashlib.sha256(BODY).hexdigest()

    refused = await refusal(ProofVerifier(settings(strict_ids.endpoint), http), edited(proof, rewrite))
    assert refused.status == 401
    assert refused.reason == "STS refused the signature: SignatureDoesNotMatch"


# --- STS unavailable: 503, and the same proof may be tried again ------------------------------------------------


class _fake_server:
    """An aiohttp server on a free loopback port with one handler, as `async with ... as url`."""

    def __init__(self, handler: Callable[[web.Request], Any]) -> None:
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", handler)
        self.runner = web.AppRunner(self.app)
        self.port = free_port()

    async def __aenter__(self) -> str:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return f"http://127.0.0.1:{self.port}"

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


CALLER_XML = f"""<GetCallerIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">
<GetCallerIdentityResult><Arn>arn:aws:sts::{ACCOUNT}:assumed-role/{ROLE_NAME}/{INSTANCE}</Arn>
<UserId>AROAEXAMPLE:{INSTANCE}</UserId><Account>{ACCOUNT}</Account></GetCallerIdentityResult>
</GetCallerIdentityResponse>"""


def _error_xml(code: str) -> str:
    return f"<ErrorResponse><Error><Type>Sender</Type><Code>{code}</Code><Message>m</Message></Error></ErrorResponse>"


CREDS = ReadOnlyCredentials("ASIAEXAMPLE", "secret", "token")


async def test_sts_errors_are_503_and_the_proof_stays_usable(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers: list[web.Response | float] = [
        web.Response(status=500, text=_error_xml("InternalFailure")),
        web.Response(status=400, text=_error_xml("Throttling")),
        2.0,  # seconds to sleep: longer than the timeout
        web.Response(status=200, text=CALLER_XML, content_type="text/xml"),
    ]
    seen: list[dict[str, str]] = []

    async def sts(request: web.Request) -> web.Response:
        seen.append(dict(request.headers) | {"body": await request.text()})
        answer = answers.pop(0)
        if isinstance(answer, float):
            await asyncio.sleep(answer)
            return web.Response(status=200, text=CALLER_XML)
        return answer

    monkeypatch.setattr(identity, "STS_TIMEOUT_S", 0.3)
    async with _fake_server(sts) as endpoint:
        verifier = ProofVerifier(settings(endpoint), http)
        proof = proof_for(CREDS, endpoint)
        for expected in ("InternalFailure", "Throttling", "did not answer within 0.3 s"):
            refused = await refusal(verifier, proof)
            assert refused.status == 503
            assert expected in refused.reason
        # Not marked as used while STS could not answer: the host's retry of it goes through.
        assert (await verifier.verify(proof, BODY)).instance_id == INSTANCE
    # Sent as signed: the signed headers, the Authorization and the GetCallerIdentity body.
    sent = seen[-1]
    signed_headers = json.loads(base64.b64decode(proof))["headers"]
    assert {name: sent[name] for name in signed_headers} == signed_headers
    assert sent["body"] == GET_CALLER_IDENTITY_BODY


async def test_a_4xx_from_sts_is_401_and_an_unreachable_sts_is_503(http: aiohttp.ClientSession) -> None:
    async def sts(request: web.Request) -> web.Response:
        return web.Response(status=403, text=_error_xml("InvalidClientTokenId"))

    async with _fake_server(sts) as endpoint:
        refused = await refusal(ProofVerifier(settings(endpoint), http), proof_for(CREDS, endpoint))
    assert (refused.status, refused.reason) == (401, "STS refused the signature: InvalidClientTokenId")

    nothing = f"http://127.0.0.1:{free_port()}"
    refused = await refusal(ProofVerifier(settings(nothing), http), proof_for(CREDS, nothing))
    assert refused.status == 503
    assert "could not be reached" in refused.reason


def test_ambient_credentials_come_from_the_usual_chain_or_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_ROLE_ARN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAAMBIENT")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "ambient-secret")
    assert ambient_credentials(REGION) == ReadOnlyCredentials("AKIAAMBIENT", "ambient-secret", None)

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(MissingCredentials, match="no AWS credentials found"):
        ambient_credentials(REGION)
