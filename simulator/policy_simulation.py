"""IAM's policy simulator as the fault-injecting proxy plays it (simulator/aws_proxy.py, `FlakyAws.simulate_policy`):
moto has no iam:SimulatePrincipalPolicy, so `autorepair doctor`'s IAM check is tested against these answers, in the
query protocol's XML that botocore parses from the real IAM."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal
from xml.sax.saxutils import escape

Decision = Literal["allowed", "implicitDeny", "explicitDeny"]
_ACTION_PARAM = "ActionNames.member."


@dataclass
class PolicySimulation:
    """Every action asked is allowed, but those in `denied` (IAM action names, e.g. ec2:RunInstances), which get
    `decision`. `asked` records each call's principal and actions, for the test to see what was simulated."""

    denied: frozenset[str]
    decision: Decision = "implicitDeny"
    asked: list[tuple[str, list[str]]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def answer(self, params: Mapping[str, str]) -> bytes:
        """The SimulatePrincipalPolicy response to one request's form parameters."""
        numbered = sorted(
            (int(key.removeprefix(_ACTION_PARAM)), value)
            for key, value in params.items()
            if key.startswith(_ACTION_PARAM) and key.removeprefix(_ACTION_PARAM).isdigit()
        )
        actions = [action for _, action in numbered]
        with self._lock:
            self.asked.append((params.get("PolicySourceArn", ""), actions))
        return _response((action, self.decision if action in self.denied else "allowed") for action in actions).encode()


def _response(results: Iterable[tuple[str, str]]) -> str:
    members = "".join(
        "<member>"
        f"<EvalActionName>{escape(action)}</EvalActionName><EvalResourceName>*</EvalResourceName>"
        f"<EvalDecision>{decision}</EvalDecision><MatchedStatements/><MissingContextValues/>"
        "</member>"
        for action, decision in results
    )
    return (
        '<SimulatePrincipalPolicyResponse xmlns="https://iam.amazonaws.com/doc/2010-05-08/">'
        f"<SimulatePrincipalPolicyResult><IsTruncated>false</IsTruncated><EvaluationResults>{members}"
        "</EvaluationResults></SimulatePrincipalPolicyResult>"
        f"<ResponseMetadata><RequestId>{uuid.uuid4()}</RequestId></ResponseMetadata>"
        "</SimulatePrincipalPolicyResponse>"
    )
