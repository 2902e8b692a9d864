"""SSM Run Command, the one way the worker asks a host for something (a GPU reset, the evidence): send a command
once per token, and look at how it went.

A command's comment carries the step's token: a retried step finds the command it already sent instead of sending
another. The host runs what it is sent with its own SSM agent; it never gets a credential of the worker's.
"""

from __future__ import annotations

from typing import Any

from temporalio.exceptions import ApplicationError

from activities.aws import AwsClients
from activities.models import CommandStatus

SHELL_DOCUMENT = "AWS-RunShellScript"
# SSM's terminal statuses of a command invocation; any other (Pending, InProgress, Delayed) is still running.
TERMINAL_STATUSES = frozenset({"Success", "Failed", "Cancelled", "TimedOut", "Cancelling", "Undeliverable"})
OUTPUT_MAX = 500
# SendCommand refuses a TimeoutSeconds (how long SSM tries to deliver it) under 30 s; a shorter step (a gate_timeout
# of a few seconds) is still bounded by its own deadline in the workflow, and by executionTimeout on the host.
MIN_DELIVERY_TIMEOUT_S = 30


async def send_once(aws: AwsClients, instance_id: str, comment: str, lines: list[str], timeout_s: int) -> str:
    """Send a shell script to one instance unless a command with this comment was sent already; its command id."""
    sent = await aws.call(f"SSM commands of {instance_id}", aws.ssm.list_commands, InstanceId=instance_id)
    for earlier in sent.get("Commands", []):
        if earlier.get("Comment") == comment:
            return str(earlier["CommandId"])
    resp = await aws.call(
        f"EC2 instance {instance_id}",
        aws.ssm.send_command,
        InstanceIds=[instance_id],
        DocumentName=SHELL_DOCUMENT,
        Parameters={"commands": lines, "executionTimeout": [str(timeout_s)]},
        Comment=comment,
        TimeoutSeconds=max(timeout_s, MIN_DELIVERY_TIMEOUT_S),
    )
    return str(resp["Command"]["CommandId"])


async def command_status(aws: AwsClients, instance_id: str, command_id: str) -> CommandStatus:
    """One look at the command on the instance."""
    try:
        invocation: Any = await aws.call(
            f"SSM command {command_id} on {instance_id}",
            aws.ssm.get_command_invocation,
            CommandId=command_id,
            InstanceId=instance_id,
        )
    except ApplicationError as err:
        if err.type == "InvocationDoesNotExist":  # SSM has not registered it on the instance yet
            return CommandStatus(done=False, status="Pending")
        raise
    status = str(invocation.get("Status", ""))
    if status not in TERMINAL_STATUSES:
        return CommandStatus(done=False, status=status)
    code = invocation.get("ResponseCode")
    exit_code = code if isinstance(code, int) and code >= 0 else None
    output = " ".join(
        " ".join(str(invocation.get(key) or "").split()) for key in ("StandardOutputContent", "StandardErrorContent")
    ).strip()
    return CommandStatus(
        done=True,
        succeeded=status == "Success" and exit_code in (0, None),
        status=status,
        exit_code=exit_code,
        output=(output or str(invocation.get("StatusDetails") or status))[:OUTPUT_MAX],
    )
