"""The remediation ladder's rung in place: reboot an instance, reset one GPU, read whether it came back, set it ACTIVE.

Each activity is one look or one step, idempotent, and the repair workflow (workflows/repair_reboot.py) polls the
looks between named timers:
- `reboot_instance`: EC2 RebootInstances, then the instance is tagged with the step's token (REBOOT_TAG); a retry
  that finds the tag does not reboot again. A retry between the two reboots twice, which costs a boot, no more.
- `send_gpu_reset` / `gpu_reset_status`: `nvidia-smi -r -i <pci>` through SSM Run Command (AWS-RunShellScript).
  The command's comment carries the step's token, so a retry finds the command it already sent. A command that did
  not succeed is a refused reset: its output says why (processes still hold the GPU; on NVSwitch systems the GPUs
  reset only together); the workflow reboots instead.
- `recovery_status`: the instance's health workflow's view (the probe's boot id, its sources, the recent findings)
  and ECS's agentConnected.
- `set_active`: the container instance back to ACTIVE. Already ACTIVE is success.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.aws import AwsClients
from activities.ec2 import GONE_EC2_STATES, Ec2, tags_of
from activities.ecs import Ecs, resolve_group
from activities.models import (
    ActivateResult,
    CommandStatus,
    GateCommandRequest,
    GpuResetCheck,
    GpuResetRequest,
    GpuResetStatus,
    HealthViewExcerpt,
    HostCommand,
    HostCommandCheck,
    InstanceRef,
    RebootRequest,
    RebootResult,
    RecoveryCheck,
    RecoveryStatus,
)
from activities.ssm import command_status, send_once
from contract import names
from contract.groups import CapacityGroup
from contract.ids import health_workflow_id

# nvidia-smi resets one GPU in seconds; a command still running after this is stopped by SSM and counts as refused.
RESET_COMMAND_TIMEOUT_S = 300
WHY_MAX = 500
QUERY_TIMEOUT = timedelta(seconds=10)
# A health workflow that gave no answer: none started yet (NOT_FOUND), or no worker took the query within
# QUERY_TIMEOUT, by the server's deadline (DEADLINE_EXCEEDED, "query timed out before a worker could process it") or
# the client's own, whichever fires first (CANCELLED, "Timeout expired").
NO_ANSWER = frozenset({RPCStatusCode.NOT_FOUND, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED})
PCI_ADDRESS_CHARS = frozenset("0123456789abcdefABCDEF:.")


def reset_command(gpu: str) -> str:
    # The address goes into a shell command: only what a PCI address is made of.
    if not gpu or not set(gpu) <= PCI_ADDRESS_CHARS:
        raise ApplicationError(f"not a PCI address: {gpu!r}", type="InvalidGpuAddress", non_retryable=True)
    # The finding names the device (dddd:bb:dd); nvidia-smi takes a function too.
    return f"nvidia-smi -r -i {gpu if '.' in gpu else gpu + '.0'}"


def gate_script(group: CapacityGroup) -> list[str]:
    """The fix's gate on the host: DCGM's diagnostic where DCGM is installed, then the operator's own command; exit 0
    passes. None of it when the group asks for neither."""
    lines = ["set -e"]
    if group.gate_diag_level:
        level = int(group.gate_diag_level)  # an int by the settings' type: nothing else reaches the shell
        lines.append(
            f"if command -v dcgmi >/dev/null 2>&1; then dcgmi diag -r {level}; "
            "else echo 'dcgmi not installed: no DCGM diagnostic'; fi"
        )
    if group.gate_command:
        lines.append(group.gate_command)  # the operator's, from the worker's settings: trusted as the worker is
    return lines if len(lines) > 1 else []


class RemediationActivities:
    def __init__(self, aws: AwsClients, groups: Callable[[str], CapacityGroup], client: Client) -> None:
        self._aws = aws
        self._ec2 = Ec2(aws)
        self._ecs = Ecs(aws)
        self._groups = groups
        self._client = client

    def activities(self) -> list[Callable[..., Any]]:
        """The bound activity methods, for `Worker(activities=...)`."""
        return [
            self.reboot_instance,
            self.send_gpu_reset,
            self.gpu_reset_status,
            self.send_gate_command,
            self.host_command_status,
            self.recovery_status,
            self.set_active,
        ]

    @activity.defn(name="reboot_instance")
    async def reboot_instance(self, request: RebootRequest) -> RebootResult:
        """Reboot the instance once per token; a terminated instance is an error no retry helps."""
        self._group(request.group)
        instance = await self._ec2.instance(request.instance_id)
        if instance is None or instance.get("State", {}).get("Name") in GONE_EC2_STATES:
            state = (instance or {}).get("State", {}).get("Name", "not found")
            raise ApplicationError(
                f"EC2 instance {request.instance_id} is {state}: nothing to reboot",
                type="InstanceTerminated",
                non_retryable=True,
            )
        if tags_of(instance.get("Tags")).get(names.REBOOT_TAG) == request.token:
            return RebootResult(already_rebooted=True)
        await self._aws.call(
            f"EC2 instance {request.instance_id}", self._aws.ec2.reboot_instances, InstanceIds=[request.instance_id]
        )
        await self._aws.call(
            f"EC2 instance {request.instance_id}",
            self._aws.ec2.create_tags,
            Resources=[request.instance_id],
            Tags=[{"Key": names.REBOOT_TAG, "Value": request.token}],
        )
        return RebootResult()

    @activity.defn(name="send_gpu_reset")
    async def send_gpu_reset(self, request: GpuResetRequest) -> HostCommand:
        """Send `nvidia-smi -r -i <pci>` through Run Command, once per token."""
        self._group(request.group)
        comment = f"{names.GPU_RESET_COMMENT} {request.instance_id} {request.token}"
        command = reset_command(request.gpu)
        command_id = await send_once(self._aws, request.instance_id, comment, [command], RESET_COMMAND_TIMEOUT_S)
        return HostCommand(command_id=command_id)

    @activity.defn(name="gpu_reset_status")
    async def gpu_reset_status(self, check: GpuResetCheck) -> GpuResetStatus:
        """One look at the reset command on the instance."""
        look = await command_status(self._aws, check.instance_id, check.command_id)
        if not look.done or look.succeeded:
            return GpuResetStatus(done=look.done, reset=look.succeeded, status=look.status, exit_code=look.exit_code)
        return GpuResetStatus(done=True, status=look.status, exit_code=look.exit_code, why=look.output[:WHY_MAX])

    @activity.defn(name="send_gate_command")
    async def send_gate_command(self, request: GateCommandRequest) -> HostCommand:
        """Send the fix's gate script (gate_script) through Run Command, once per token."""
        group = self._group(request.group)
        comment = f"{names.GATE_COMMENT} {request.instance_id} {request.token}"
        timeout_s = int(group.gate_timeout.total_seconds())
        command_id = await send_once(self._aws, request.instance_id, comment, gate_script(group), timeout_s)
        return HostCommand(command_id=command_id)

    @activity.defn(name="host_command_status")
    async def host_command_status(self, check: HostCommandCheck) -> CommandStatus:
        """One look at a command on the instance."""
        return await command_status(self._aws, check.instance_id, check.command_id)

    @activity.defn(name="recovery_status")
    async def recovery_status(self, check: RecoveryCheck) -> RecoveryStatus:
        """The probe's view (through the health workflow) and ECS's agentConnected, in one look."""
        group = self._group(check.group)
        look, ci = await asyncio.gather(
            self._probe_view(check.instance_id),
            self._ecs.container_instance(group, check.instance_id, check.container_instance_arn),
        )
        return look.model_copy(
            update={
                "agent_connected": ci.get("agentConnected") if ci is not None else None,
                "container_status": ci.get("status") if ci is not None else None,
            }
        )

    @activity.defn(name="set_active")
    async def set_active(self, ref: InstanceRef) -> ActivateResult:
        """Let ECS place tasks on the instance again. Already ACTIVE is success."""
        group = self._group(ref.group)
        ci = await self._ecs.registered(group, ref.instance_id, "ACTIVE")
        changed = await self._ecs.set_status(group.cluster, ci, "ACTIVE")
        return ActivateResult(container_instance_arn=ci["containerInstanceArn"], already_active=not changed)

    # --- lookups ------------------------------------------------------------------------------------------

    async def _probe_view(self, instance_id: str) -> RecoveryStatus:
        """The probe's view through the instance's health workflow, or why it did not answer."""
        handle = self._client.get_workflow_handle(health_workflow_id(instance_id))
        try:
            view = await handle.query(names.QUERY_HEALTH, result_type=HealthViewExcerpt, rpc_timeout=QUERY_TIMEOUT)
        except RPCError as err:
            if err.status not in NO_ANSWER:
                raise
            # Ours either way, never the instance's: a query no worker took in time, or a health workflow not started
            # yet (a repair looks only at an instance registered in ECS, which the AWS watch covers with one).
            return RecoveryStatus(
                probe_error=f"health workflow did not answer: {err.message}"[:WHY_MAX], probe_unanswered=True
            )
        return RecoveryStatus(probe=view)

    def _group(self, name: str) -> CapacityGroup:
        return resolve_group(self._groups, name)
