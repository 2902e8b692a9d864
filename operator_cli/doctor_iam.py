"""`autorepair doctor`'s IAM check: whether the worker's role may make the calls its groups need
(activities/permissions.py), asked of IAM's policy simulator (iam:SimulatePrincipalPolicy) for the worker's principal:
the one these credentials are (sts:GetCallerIdentity), or the one `--worker-role` names.

The simulator cannot be asked everywhere: the worker's own policy does not grant it, and moto has none. A simulator
that cannot be asked is a SKIP that says why, never a FAIL: the check has found nothing wrong."""

from __future__ import annotations

import re
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

from activities.permissions import actions_needed
from operator_cli.doctor_aws import NO_IDENTITY
from operator_cli.doctor_checks import Doctor, Verdict, error_code, error_message, failed, passed, refused, skipped

_ARN = re.compile(r"^arn:(?P<partition>[^:]+):(?P<service>sts|iam)::(?P<account>\d{12}):(?P<kind>[\w-]+)/(?P<rest>.+)$")
_POLICY = "attach deploy/iam/worker-policy.json to it, its placeholders filled in (deploy/iam/README.md)"


def principal_of(caller_arn: str) -> str | None:
    """The IAM principal whose policies apply to a caller: an assumed role's role (arn:aws:sts::A:assumed-role/R/S
    is arn:aws:iam::A:role/R, a path aside), an IAM user or role itself; None for what IAM cannot simulate (the root
    user, a federated user)."""
    found = _ARN.match(caller_arn)
    if found is None:
        return None
    partition, account, kind, rest = found["partition"], found["account"], found["kind"], found["rest"]
    if found["service"] == "sts" and kind == "assumed-role":
        return f"arn:{partition}:iam::{account}:role/{rest.split('/', 1)[0]}"
    if found["service"] == "iam" and kind in ("role", "user"):
        return caller_arn
    return None


async def _with_path(doc: Doctor, role_arn: str) -> str:
    """A role's ARN with its path (an assumed role's ARN drops it), where these credentials may read the role."""
    try:
        role = await doc.call(doc.iam.get_role, RoleName=role_arn.rsplit("/", 1)[-1])
    except (ClientError, BotoCoreError):
        return role_arn
    return str(role["Role"]["Arn"])


async def _simulate(doc: Doctor, principal: str, actions: list[str]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    marker: dict[str, str] = {}
    while True:
        page = await doc.call(
            doc.iam.simulate_principal_policy, PolicySourceArn=principal, ActionNames=actions, **marker
        )
        results += page.get("EvaluationResults", [])
        if not page.get("IsTruncated"):
            return results
        marker = {"Marker": page["Marker"]}


async def _principal(doc: Doctor) -> str | Verdict:
    """Whose policies to simulate: --worker-role, else the principal these credentials are; a SKIP when neither."""
    if doc.worker_role is not None:
        return doc.worker_role
    if doc.caller_arn is None:
        return skipped(NO_IDENTITY)
    principal = principal_of(doc.caller_arn)
    if principal is None:
        return skipped(f"IAM cannot simulate {doc.caller_arn}: name the worker's role with --worker-role ARN")
    return await _with_path(doc, principal) if ":role/" in principal else principal


async def worker_iam(doc: Doctor) -> Verdict:
    needed = actions_needed(doc.settings.groups, doc.settings.events)
    if not needed:
        return skipped("no groups and no EventBridge: the worker makes no AWS call")
    principal = await _principal(doc)
    if isinstance(principal, Verdict):
        return principal
    try:
        results = await _simulate(doc, principal, list(needed))
    except ClientError as err:
        if refused(err, "iam:SimulatePrincipalPolicy") is not None:
            return skipped(
                "these credentials may not call iam:SimulatePrincipalPolicy: grant it to them, or run doctor as "
                "someone who may, with --worker-role naming the worker's role"
            )
        if error_code(err) == "NoSuchEntity":
            return failed(f"no IAM role or user {principal}", "name the worker's role with --worker-role ARN")
        return skipped(f"IAM did not simulate the policy: {error_code(err)}: {error_message(err)}")
    except (BotoCoreError, ResponseParserError) as err:
        return skipped(f"this IAM endpoint does not simulate policies: {' '.join(str(err).split())[:160]}")
    denied, conditional = [], []
    for result in results:
        decision, action = result.get("EvalDecision"), str(result.get("EvalActionName"))
        if decision == "allowed":
            continue
        if decision == "implicitDeny" and result.get("MissingContextValues"):
            # Allowed only under conditions on the request (the resource's tag, the cluster) the simulation was not
            # given: what the policy means, not a gap.
            conditional.append(action)
        else:
            denied.append(f"{action} ({needed.get(action, 'needed')})")
    if denied:
        return failed(f"{principal} may not call {'; '.join(denied)}", _POLICY)
    under = f"; {len(conditional)} under conditions not simulated ({', '.join(conditional)})" if conditional else ""
    return passed(f"{principal} may call the {len(needed)} actions its settings need{under}")
