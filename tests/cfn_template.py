"""The ECS template, deploy/ecs/gpu-autorepair.yaml, loaded and evaluated for the tests that read it
(test_ecs_template.py, test_ecs_template_agrees.py).

The template is evaluated here as CloudFormation would with one set of parameter values (Fn::ForEach expanded,
conditions decided, Ref/Fn::Sub/Fn::GetAtt given plausible values), so that a typo in a setting's variable name, a
flag the probe does not have or a port that disagrees fails a test instead of a deployment. Then the lookups the tests
share: a container's environment, what a role is granted, whether a variable names a settings field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from cfnlint.decode import decode
from pydantic import BaseModel

from contract.config import CONFIG_ENV, CONFIG_TEXT_ENV, ENV_PREFIX

ROOT = Path(__file__).resolve().parent.parent
ECS = ROOT / "deploy" / "ecs"
TEMPLATE = ECS / "gpu-autorepair.yaml"
ACCOUNT, REGION, STACK = "123456789012", "eu-west-1", "gpu-autorepair"
# Every optional part switched on, and values that agree with deploy/ecs/settings.example.toml.
FULL = {
    "VpcId": "vpc-0123456789abcdef0",
    "OpsSubnetIds": "subnet-0a,subnet-0b",
    "LoadBalancerSubnetIds": "subnet-0c,subnet-0d",
    "GpuInstancesSecurityGroupId": "sg-0123456789abcdef0",
    "GpuInstancesCidr": "10.20.0.0/16",
    "MetricsScrapeSecurityGroupId": "sg-0fedcba9876543210",
    "IngestDomainName": "ingest.gpu.example.com",
    "CertificateArn": f"arn:aws:acm:{REGION}:{ACCOUNT}:certificate/0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0",
    "IngestHostedZoneId": "Z0123456789ABCDEFGHIJ",
    "GpuClusterName": "gpu-training",
    "CapacityGroups": "p5-training,p4d-batch",
    "GpuNodeRoleName": "gpu-node",
    "LaunchTemplateIds": "lt-0123456789abcdef0,lt-0fedcba9876543210",
    "AutoScalingGroupNames": "g6-inference-asg",
    "EvidenceBucket": "gpu-autorepair-evidence",
    "ProbeGpuAccess": "nvidia-default-runtime",
    "TemporalAddress": "fleet.a1b2c.tmprl.cloud:7233",
    "TemporalNamespace": "fleet.a1b2c",
    "TemporalApiKeySecretArn": f"arn:aws:secretsmanager:{REGION}:{ACCOUNT}:secret:temporal-api-key-AbCdEf",
    "AlertEmail": "gpu-oncall@example.com",
}
# Only what has no default.
MINIMAL = {
    key: FULL[key]
    for key in (
        "VpcId",
        "OpsSubnetIds",
        "LoadBalancerSubnetIds",
        "GpuInstancesSecurityGroupId",
        "IngestDomainName",
        "CertificateArn",
        "GpuClusterName",
        "CapacityGroups",
        "GpuNodeRoleName",
        "TemporalAddress",
    )
}


# --- CloudFormation, evaluated -------------------------------------------------------------------------------------

NO_VALUE = object()
PSEUDO = {
    "AWS::AccountId": ACCOUNT,
    "AWS::Region": REGION,
    "AWS::Partition": "aws",
    "AWS::URLSuffix": "amazonaws.com",
    "AWS::StackName": STACK,
    "AWS::StackId": f"arn:aws:cloudformation:{REGION}:{ACCOUNT}:stack/{STACK}/0000",
}
_SUB_VARIABLE = re.compile(r"\$\{([^}]+)\}")


def load_template(path: Path) -> dict[str, Any]:
    template, matches = decode(str(path))  # cfn-lint's own loader: it reads !Ref and !Sub short forms too
    assert template is not None and not matches, [str(m) for m in matches]
    return json.loads(json.dumps(template))  # plain dicts and strings


def _substitute(node: Any, identifier: str, value: str) -> Any:
    """What Fn::ForEach does to its fragment: ${Id} and &{Id} (alphanumerics only) in every key and string, and
    {"Ref": Id} as the value itself."""
    if isinstance(node, str):
        return node.replace(f"${{{identifier}}}", value).replace(
            f"&{{{identifier}}}", re.sub(r"[^0-9A-Za-z]", "", value)
        )
    if isinstance(node, list):
        return [_substitute(item, identifier, value) for item in node]
    if isinstance(node, dict):
        if node == {"Ref": identifier}:
            return value
        return {_substitute(k, identifier, value): _substitute(v, identifier, value) for k, v in node.items()}
    return node


class Stack:
    """The template as CloudFormation would see it with these parameter values."""

    def __init__(self, template: dict[str, Any], given: dict[str, str]) -> None:
        self.template = template
        unknown = set(given) - set(template["Parameters"])
        assert not unknown, f"not parameters of the template: {sorted(unknown)}"
        self.params: dict[str, Any] = {}
        for name, spec in template["Parameters"].items():
            if name in given:
                raw = given[name]
            else:
                assert "Default" in spec, f"parameter {name} has no default and the test gives no value"
                raw = spec["Default"]
            raw = str(raw)  # a Number parameter is a string wherever it is used
            if "AllowedValues" in spec:
                assert raw in [str(v) for v in spec["AllowedValues"]], (name, raw)
            if "AllowedPattern" in spec and not spec["Type"].startswith(("List<", "CommaDelimitedList")):
                assert re.fullmatch(spec["AllowedPattern"], raw), (name, raw)
            listed = spec["Type"] == "CommaDelimitedList" or spec["Type"].startswith("List<")
            self.params[name] = raw.split(",") if listed else raw
        self.conditions: dict[str, bool] = {}
        for name, expression in template.get("Conditions", {}).items():
            self.conditions[name] = self.condition(expression)
        self.resources = {
            name: resource
            for name, resource in self._expand(template["Resources"]).items()
            if self.conditions.get(resource.get("Condition", ""), True)
        }
        self.outputs = {
            name: self.value(output["Value"])
            for name, output in self._expand(template.get("Outputs", {})).items()
            if self.conditions.get(output.get("Condition", ""), True)
        }

    def _expand(self, section: dict[str, Any]) -> dict[str, Any]:
        expanded: dict[str, Any] = {}
        for key, value in section.items():
            if not key.startswith("Fn::ForEach::"):
                expanded[key] = value
                continue
            identifier, collection, fragment = value
            for item in self.value(collection):
                for name, body in self._expand(_substitute(fragment, identifier, item)).items():
                    assert name not in expanded, f"{key} makes {name} twice"
                    expanded[name] = body
        return expanded

    def condition(self, expression: Any) -> bool:
        ((function, args),) = expression.items()
        if function == "Condition":
            return self.condition(self.template["Conditions"][args])
        if function == "Fn::Equals":
            left, right = (self.value(a) for a in args)
            return bool(left == right)
        if function == "Fn::Not":
            return not self.condition(args[0])
        if function == "Fn::And":
            return all(self.condition(a) for a in args)
        if function == "Fn::Or":
            return any(self.condition(a) for a in args)
        raise AssertionError(f"condition function {function} not evaluated by this test")

    def ref(self, name: str) -> Any:
        if name in PSEUDO:
            return PSEUDO[name]
        if name == "AWS::NoValue":
            return NO_VALUE
        if name in self.params:
            return self.params[name]
        resource = self.resources[name]  # KeyError: a Ref to nothing
        kind, props = resource["Type"], resource.get("Properties", {})
        if kind == "AWS::Events::EventBus":
            return self.value(props["Name"])
        if kind == "AWS::Logs::LogGroup":
            return self.value(props["LogGroupName"])
        if kind == "AWS::ECS::Cluster":
            return self.value(props.get("ClusterName", f"{STACK}-{name}"))
        if kind == "AWS::SecretsManager::Secret":
            return f"arn:aws:secretsmanager:{REGION}:{ACCOUNT}:secret:{STACK}-{name}-Ab12Cd"
        if kind == "AWS::ECS::TaskDefinition":
            return self.get_att(name, "TaskDefinitionArn")
        if kind == "AWS::SNS::Topic":
            return f"arn:aws:sns:{REGION}:{ACCOUNT}:{STACK}-{name}"
        return f"{STACK}-{name}-0A1B2C"

    def get_att(self, name: str, attribute: str) -> str:
        resource = self.resources[name]  # KeyError: an attribute of nothing
        kind, props = resource["Type"], resource.get("Properties", {})
        known = {
            ("AWS::IAM::Role", "Arn"): lambda: f"arn:aws:iam::{ACCOUNT}:role/{STACK}-{name}-0A1B2C",
            ("AWS::Events::EventBus", "Arn"): lambda: f"arn:aws:events:{REGION}:{ACCOUNT}:event-bus/{self.ref(name)}",
            ("AWS::Events::Rule", "Arn"): lambda: f"arn:aws:events:{REGION}:{ACCOUNT}:rule/{STACK}-{name}",
            ("AWS::Logs::LogGroup", "Arn"): lambda: f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:{self.ref(name)}:*",
            ("AWS::Lambda::Function", "Arn"): lambda: f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{STACK}-{name}",
            ("AWS::ECS::TaskDefinition", "TaskDefinitionArn"): lambda: (
                f"arn:aws:ecs:{REGION}:{ACCOUNT}:task-definition/{self.value(props['Family'])}:1"
            ),
            ("AWS::ElasticLoadBalancingV2::LoadBalancer", "DNSName"): lambda: (
                f"internal-{STACK}-{name}-1234567890.{REGION}.elb.amazonaws.com"
            ),
            ("AWS::ElasticLoadBalancingV2::LoadBalancer", "CanonicalHostedZoneID"): lambda: "Z32O12XQLNTSW2",
        }
        return known[(kind, attribute)]()

    def value(self, node: Any) -> Any:
        if isinstance(node, list):
            return [v for v in (self.value(item) for item in node) if v is not NO_VALUE]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            ((key, args),) = node.items()
            if key == "Ref":
                return self.ref(args)
            if key == "Fn::GetAtt":
                name, attribute = args.split(".", 1) if isinstance(args, str) else [self.value(a) for a in args]
                return self.get_att(name, attribute)
            if key == "Fn::Sub":
                return self._sub(args)
            if key == "Fn::If":
                chosen = args[1] if self.condition({"Condition": args[0]}) else args[2]
                return self.value(chosen)
            if key == "Fn::Join":
                return args[0].join(self.value(args[1]))
            if key == "Fn::Split":
                return self.value(args[1]).split(args[0])
            if key == "Fn::Select":
                return self.value(args[1])[int(self.value(args[0]))]
            assert not key.startswith("Fn::"), f"{key} is not evaluated by this test"
        values = {k: self.value(v) for k, v in node.items()}
        return {k: v for k, v in values.items() if v is not NO_VALUE}

    def _sub(self, args: Any) -> str:
        text, variables = (args, {}) if isinstance(args, str) else (args[0], args[1])
        bound = {name: self.value(v) for name, v in variables.items()}

        def one(match: re.Match[str]) -> str:
            name = match.group(1)
            if name.startswith("!"):
                return "${" + name[1:] + "}"
            if name in bound:
                return str(bound[name])
            if "." in name and name.split(".", 1)[0] in self.resources:
                return self.get_att(*name.split(".", 1))
            return str(self.ref(name))

        return _SUB_VARIABLE.sub(one, text)

    # --- what the tests look at ---

    def of_type(self, kind: str) -> dict[str, dict[str, Any]]:
        return {n: self.value(r.get("Properties", {})) for n, r in self.resources.items() if r["Type"] == kind}

    def props(self, name: str) -> dict[str, Any]:
        return self.value(self.resources[name].get("Properties", {}))

    def container(self, task_definition: str, name: str | None = None) -> dict[str, Any]:
        containers = self.props(task_definition)["ContainerDefinitions"]
        if name is None:
            (only,) = containers
            return only
        return next(c for c in containers if c["Name"] == name)

    def probe_groups(self) -> dict[str, str]:
        """Capacity group (the probe's --group) -> the logical id of the task definition its DAEMON service runs."""
        by_arn = {self.get_att(n, "TaskDefinitionArn"): n for n in self.of_type("AWS::ECS::TaskDefinition")}
        groups = {}
        for service in self.of_type("AWS::ECS::Service").values():
            if service.get("SchedulingStrategy") == "DAEMON":
                task_definition = by_arn[service["TaskDefinition"]]
                command = self.container(task_definition, "probe")["Command"]
                groups[command[command.index("--group") + 1]] = task_definition
        return groups


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template(TEMPLATE)


@pytest.fixture(scope="module")
def stack(template: dict[str, Any]) -> Stack:
    return Stack(template, FULL)


@pytest.fixture(scope="module")
def minimal(template: dict[str, Any]) -> Stack:
    return Stack(template, MINIMAL)


# --- lookups -------------------------------------------------------------------------------------------------------


def env_vars(container: dict[str, Any]) -> dict[str, str]:
    return {e["Name"]: e["Value"] for e in container.get("Environment", [])}


def secret_names(container: dict[str, Any]) -> list[str]:
    return [s["Name"] for s in container.get("Secrets", [])]


def field_path_problem(name: str, model: type[BaseModel]) -> str | None:
    """Why AUTOREPAIR_<A>__<B> names no field of `model` (None: it names one). pydantic-settings ignores a top-level
    variable it does not know, so a typo there would otherwise pass silently."""
    if name in (CONFIG_ENV, CONFIG_TEXT_ENV):
        return None
    parts = name.removeprefix(ENV_PREFIX).lower().split("__")
    current: Any = model
    for depth, part in enumerate(parts):
        fields = getattr(current, "model_fields", None)
        if fields is None or part not in fields:
            return f"{name}: no field {'.'.join(parts[: depth + 1])} in {model.__name__}"
        annotation = fields[part].annotation
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return None


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def role_statements(stack: Stack, role: str) -> list[dict[str, Any]]:
    """Every statement granted to `role`: its inline policies and the managed policies attached to it."""
    statements = [
        st for policy in stack.props(role).get("Policies", []) for st in policy["PolicyDocument"]["Statement"]
    ]
    for kind in ("AWS::IAM::ManagedPolicy", "AWS::IAM::Policy", "AWS::IAM::RolePolicy"):
        for props in stack.of_type(kind).values():
            if stack.ref(role) in [*props.get("Roles", []), props.get("RoleName")]:
                statements += props["PolicyDocument"]["Statement"]
    return statements


def statement_resources(stack: Stack, role: str) -> set[str]:
    return {r for st in role_statements(stack, role) for r in as_list(st["Resource"])}


def actions(statements: list[dict[str, Any]]) -> set[str]:
    return {action for st in statements for action in as_list(st["Action"])}
