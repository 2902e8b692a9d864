"""The IAM actions the worker's activities call, by what a capacity group asks of them.

The worker's role needs these (deploy/iam/worker-policy.json grants them) and `autorepair doctor` simulates them on
it. A group is asked only for what its settings use: a reboot-first group needs ec2:RebootInstances, a replace-only
group does not. tests/test_deploy_files.py keeps this table equal to the AWS calls the activities make.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from contract.config import EventSettings
from contract.groups import CapacityGroup, Remediation


@dataclass(frozen=True)
class Need:
    """Actions a group needs when `applies` says so, and why, for the operator."""

    why: str
    actions: tuple[str, ...]
    applies: Callable[[CapacityGroup], bool]


def _runs_on_host(group: CapacityGroup) -> bool:
    """SSM Run Command: the GPU reset, the host's part of the fix's gate, the bug report."""
    reboot_first = group.remediation == Remediation.REBOOT_FIRST
    return (
        group.bug_report
        or (reboot_first and (group.gpu_reset or group.gates_on_host))
        or group.gates_replacement_on_host
    )


NEEDS: tuple[Need, ...] = (
    Need(
        "watch, drain, deregister and terminate the group's instances",
        (
            "ecs:ListContainerInstances",
            "ecs:DescribeContainerInstances",
            "ecs:UpdateContainerInstancesState",
            "ecs:DeregisterContainerInstance",
            "ecs:ListTasks",
            "ecs:DescribeTasks",
            "ecs:StopTask",
            "ecs:DescribeTaskDefinition",
            "ec2:DescribeInstances",
            "ec2:DescribeInstanceStatus",
            "ec2:DescribeInstanceTypes",
            "ec2:DescribeSpotInstanceRequests",
            "ec2:DescribeCapacityReservations",
            "ec2:CreateTags",
            "ec2:TerminateInstances",
            "autoscaling:DescribeAutoScalingInstances",
        ),
        lambda group: True,
    ),
    Need(
        "launch replacements from the launch template",
        ("ec2:DescribeLaunchTemplates", "ec2:RunInstances", "iam:PassRole"),
        lambda group: group.launch_template is not None and group.auto_scaling_group is None,
    ),
    Need(
        "move a replacement to another AZ's subnet",
        ("ec2:DescribeSubnets",),
        lambda group: group.allow_other_azs and group.launch_template is not None and bool(group.subnets),
    ),
    Need(
        "replace through the Auto Scaling group",
        ("autoscaling:DescribeAutoScalingGroups", "autoscaling:DetachInstances"),
        lambda group: group.auto_scaling_group is not None,
    ),
    Need(
        "reboot first (remediation = reboot-first)",
        ("ec2:RebootInstances",),
        lambda group: group.remediation == Remediation.REBOOT_FIRST,
    ),
    Need(
        "run commands on the host (gpu_reset, the gate on the host, bug_report)",
        ("ssm:SendCommand", "ssm:ListCommands", "ssm:GetCommandInvocation"),
        _runs_on_host,
    ),
    Need(
        "watch the group's ECS daemon services (daemon_services)",
        ("ecs:DescribeServices",),
        lambda group: bool(group.daemon_services),
    ),
    Need(
        "keep the evidence (evidence_bucket)",
        ("s3:PutObject", "s3:GetObject"),
        lambda group: group.evidence_bucket is not None,
    ),
    Need(
        "quarantine the impaired instance (quarantine = true)",
        ("ec2:StopInstances", "ec2:DeleteTags"),
        lambda group: group.quarantine,
    ),
)

# Publishing to EventBridge: the worker's, whatever its groups (events.eventbridge).
EVENTS_ACTIONS = ("events:PutEvents",)


def every_action() -> set[str]:
    """Each action the activities may call, whichever settings ask for it."""
    return {action for need in NEEDS for action in need.actions} | set(EVENTS_ACTIONS)


def actions_needed(groups: Iterable[CapacityGroup], events: EventSettings) -> dict[str, str]:
    """The actions these groups and event settings need, sorted, each with what it is needed for (the first need
    that asks for it)."""
    needed: dict[str, str] = {}
    for group in groups:
        for need in NEEDS:
            if need.applies(group):
                for action in need.actions:
                    needed.setdefault(action, need.why)
    if events.eventbridge:
        needed.update(dict.fromkeys(EVENTS_ACTIONS, "publish events to EventBridge"))
    return dict(sorted(needed.items()))
