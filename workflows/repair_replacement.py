"""Steps 3 and 4 of a repair: launch a replacement and wait until it is ACTIVE, one attempt after another.

A replacement that is not ACTIVE in ECS within the group's `replacement_ready_timeout` (a bad AMI, an agent that
cannot reach ECS, an instance that died while booting) is terminated, and the next attempt launches another with a
client token of its own: EC2 answers a repeated token with the first launch, dead or not. After
`max_replacement_attempts` the repair fails and leaves the impaired instance DRAINING: start-before-stop never
terminates an instance without a ready replacement.

A launch call that fails (no capacity) is not an attempt: each attempt retries its launch with backoff for as long as
it takes, as before. Attempts count replacements that launched and never became ready.

With the group's `verify_replacement` (on by default) ACTIVE is not enough: the replacement's probe must report with
its GPU sources OK and the replacement pass the gate a fix must pass (workflows/fix_gate.py) within the same
`replacement_ready_timeout`; with `verify_replacement = "on_host"` also the gate's part on the host (DCGM's diagnostic,
`gate_command`) through SSM Run Command, within `gate_timeout`. ReplacementReady carries the gate's checks, and a
failure abandons it like a replacement that never became ACTIVE.

Each step takes the repair's RepairContext (workflows/repair_context.py): its record, its events, its phases.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception
from temporalio.exceptions import TimeoutError as ActivityTimeoutError

from contract import event_types as ev
from contract.config import format_seconds
from contract.groups import CapacityGroup
from contract.repair import RepairPhase
from workflows import repair_patches, repair_zones
from workflows.activity_errors import capacity_error, describe_error, permanent_error
from workflows.options import CALL_RETRY, CALL_TIMEOUT, HEARTBEAT_TIMEOUT_MAX
from workflows.repair_context import RepairContext
from workflows.repair_verify import verify_replacement

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from activities.models import DrainResult, LaunchRequest, ReplacementRef, ReplacementWait

LAUNCH_BACKOFF_FIRST = timedelta(seconds=5)
LAUNCH_BACKOFF_MAX = timedelta(minutes=10)
# The wait's activity gives up by itself at the deadline, with a message that says why; Temporal's own timeout, this
# much later, only ends a wait whose worker was lost at the deadline.
READY_TIMEOUT_MARGIN = timedelta(minutes=1)
# A lost worker delays the wait by up to its heartbeat timeout, and each heartbeat that reaches the server is a billed
# action (the SDK sends one per 80% of the timeout): a quarter of the wait, within these bounds. At the default 20
# minutes a 10-minute boot costs 4 heartbeats (it was 11 at a tenth, 76 at 10 s); a worker lost in the middle of the
# wait hands it on after at most 5 minutes, while the replacement boots on regardless.
READY_HEARTBEAT_MIN = timedelta(seconds=10)
READY_HEARTBEAT_MAX = HEARTBEAT_TIMEOUT_MAX
# Within the schedule-to-close timeout: a lost worker or a throttled ECS API must not end the wait early.
READY_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), maximum_interval=timedelta(seconds=30))
CLIENT_TOKEN_MAX = 64  # RunInstances' limit


class ReplacementsExhausted(Exception):
    """Raised out of replace(): no attempt's replacement became ACTIVE; each one was terminated."""


def client_token(instance_id: str, attempt: int, repair_attempt: int = 0) -> str:
    """One replacement attempt's RunInstances token: the same on every retry of the attempt, another for the next
    attempt and for every attempt of a later repair of the instance (contract/ids.py), whose first replacement would
    otherwise get a failed repair's dead one back. Repair attempt 0 (a repair started before repairs had attempts)
    keeps the token it began with."""
    suffix = f"-{repair_attempt}.{attempt}" if repair_attempt else f"-{attempt}"
    return f"autorepair-{instance_id}"[: CLIENT_TOKEN_MAX - len(suffix)] + suffix


async def replace(repair: RepairContext, group: CapacityGroup, drained: DrainResult) -> str:
    """Launch replacements until one is ACTIVE in ECS, at most `max_replacement_attempts`; returns its id. An earlier
    attempt's replacement that still serves is adopted instead: a retried repair never launches a second one."""
    record = repair.record
    adopted = await _adopt(repair)
    if adopted is not None:
        return adopted
    limit = group.max_replacement_attempts
    given_up: list[str] = []
    for attempt in range(1, limit + 1):
        await repair.enter(RepairPhase.LAUNCHING_REPLACEMENT)
        replacement = await _launch(repair, group, drained, attempt, limit)
        launched_at = workflow.now()
        record.replacement = replacement
        record.notes[RepairPhase.LAUNCHING_REPLACEMENT] = replacement + _of(attempt, limit)
        await repair.event(ev.ReplacementLaunched(replacement_instance_id=replacement, attempt=attempt))

        # Shown from the next step on: which replacement is awaited, and those given up on before it.
        record.notes[RepairPhase.WAITING_FOR_REPLACEMENT] = "; ".join([replacement + _of(attempt, limit), *given_up])
        await repair.enter(RepairPhase.WAITING_FOR_REPLACEMENT)
        failure = await _wait_until_active(repair, group, replacement, attempt, limit)
        gate: list[ev.GateResult] | None = None
        if failure is None and group.verify_replacement and repair_patches.patched(repair_patches.VERIFY_REPLACEMENT):
            checks, failed = await verify_replacement(repair, group, replacement, launched_at)
            gate = [ev.GateResult.model_validate(c.model_dump()) for c in checks]
            failure = None if failed is None else (failed, failed)
        if failure is None:
            await repair.event(ev.ReplacementReady(replacement_instance_id=replacement, attempt=attempt, checks=gate))
            return replacement
        why, error = failure
        await _abandon(repair, replacement, attempt, limit, why, error)
        given_up.append(f"attempt {attempt}: {replacement} {why}, terminated")
        record.notes[RepairPhase.WAITING_FOR_REPLACEMENT] = "; ".join(given_up)
    raise ReplacementsExhausted(
        f"no replacement became ACTIVE in ECS in {limit} attempt{'s' if limit > 1 else ''} "
        f"(max_replacement_attempts of capacity group {group.name}): {'; '.join(given_up)}. "
        f"{record.instance_id} is left DRAINING and running, not terminated: a repair never terminates an "
        "instance without a ready replacement"
    )


async def _adopt(repair: RepairContext) -> str | None:
    record = repair.record
    earlier, input = record.input.earlier_replacement, record.input
    if earlier is None:
        return None
    await repair.enter(RepairPhase.WAITING_FOR_REPLACEMENT)
    check = await workflow.execute_activity_method(
        FleetActivities.check_replacement,
        ReplacementRef(group=input.group, instance_id=earlier, impaired_instance_id=input.instance_id),
        summary=f"does {earlier}, launched by an earlier attempt, still serve? then it is this repair's replacement",
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )
    if not check.serving:
        record.notes[RepairPhase.WAITING_FOR_REPLACEMENT] = f"{earlier} of an earlier attempt not adopted: {check.why}"
        return None
    record.replacement = earlier
    record.notes[RepairPhase.LAUNCHING_REPLACEMENT] = f"{earlier}, launched by an earlier attempt: adopted"
    record.notes[RepairPhase.WAITING_FOR_REPLACEMENT] = f"{earlier} ACTIVE"
    await repair.event(ev.ReplacementReady(replacement_instance_id=earlier, attempt=0, adopted=True))
    return earlier


def _of(attempt: int, limit: int) -> str:
    return f" (attempt {attempt} of {limit})" if limit > 1 else ""


async def _launch(repair: RepairContext, group: CapacityGroup, drained: DrainResult, attempt: int, limit: int) -> str:
    record = repair.record
    instance_id = record.instance_id
    zones = await repair_zones.plan(record, group, drained)
    reported = repair_patches.patched(repair_patches.LAUNCH_OUTCOMES)
    backoff = LAUNCH_BACKOFF_FIRST
    tries = 1
    while True:
        token = client_token(instance_id, attempt, record.input.attempt)
        request = LaunchRequest(
            group=record.group,
            impaired_instance_id=instance_id,
            availability_zone=zones.here.availability_zone,
            subnet_id=zones.here.subnet_id,
            client_token=f"{token}-z{zones.moves}" if zones.moves else token,
            first_try=tries == 1,
        )
        summary = f"launch replacement for {instance_id} in {zones.here.availability_zone}"
        if attempt > 1:
            summary += f", replacement {attempt} of {limit}"
        try:
            with repair.quick_step():
                launched = await workflow.execute_activity_method(
                    FleetActivities.launch_replacement,
                    request,
                    summary=summary + (f" (attempt {tries})" if tries > 1 else ""),
                    start_to_close_timeout=timedelta(seconds=60),
                    retry_policy=RetryPolicy(
                        initial_interval=timedelta(seconds=2),
                        maximum_interval=timedelta(seconds=30),
                        maximum_attempts=3,
                    ),
                )
            if reported and (tries > 1 or zones.here.availability_zone in record.avoid_azs):
                await repair_zones.tell_semaphore(record, zones.here.availability_zone, capacity_error=False)
            return launched.replacement_instance_id
        except ActivityError as err:
            if permanent_error(err) or is_cancelled_exception(err):
                raise
            # Capacity shortages last minutes to hours: keep the instance draining, keep trying, and say so.
            record.error = describe_error(err)
            zone = zones.here.availability_zone
            next_try = ""
            if capacity_error(err):
                if reported:
                    await repair_zones.tell_semaphore(record, zone, capacity_error=True)
                next_try = zones.capacity_error()
                record.error += f"; {next_try}"
            record.notes[RepairPhase.LAUNCHING_REPLACEMENT] = f"attempt {tries} failed: {record.error}"
            await repair.notify_health()
            await repair.event(
                ev.ReplacementLaunchFailed(
                    error=record.error or "",
                    attempt=tries,
                    retry_in_seconds=int(backoff.total_seconds()),
                    availability_zone=zone if next_try else None,
                    next_try=next_try or None,
                )
            )
            await workflow.sleep(backoff, summary=f"back off before launch attempt {tries + 1}")
            backoff = min(backoff * 2, LAUNCH_BACKOFF_MAX)
            tries += 1
            record.error = None


def ready_heartbeat_timeout(ready_timeout: timedelta) -> timedelta:
    return min(max(ready_timeout / 4, READY_HEARTBEAT_MIN), READY_HEARTBEAT_MAX)


async def _wait_until_active(
    repair: RepairContext, group: CapacityGroup, replacement: str, attempt: int, limit: int
) -> tuple[str, str] | None:
    """None once the replacement is ACTIVE; else why it never will be, in short and in the activity's words. Any
    other failure fails the repair: another replacement would meet it too."""
    timeout = group.replacement_ready_timeout
    wait = ReplacementWait(group=repair.record.group, instance_id=replacement, ready_by=workflow.now() + timeout)
    try:
        active = await workflow.execute_activity_method(
            FleetActivities.await_container_instance_active,
            wait,
            summary=f"wait for replacement {replacement} to be ACTIVE in ECS" + _of(attempt, limit),
            schedule_to_close_timeout=timeout + READY_TIMEOUT_MARGIN,
            heartbeat_timeout=ready_heartbeat_timeout(timeout),
            retry_policy=READY_RETRY,
        )
        repair.record.replacement_container_instance_arn = active.container_instance_arn
        return None
    except ActivityError as err:
        cause = err.cause
        if isinstance(cause, ApplicationError) and cause.type == "InstanceTerminated":
            return "left EC2 before it was ACTIVE", describe_error(err)
        if (isinstance(cause, ApplicationError) and cause.type == "ReplacementNotReady") or isinstance(
            cause, ActivityTimeoutError
        ):
            return f"not ACTIVE in ECS within {format_seconds(timeout)}", describe_error(err)
        raise


async def _abandon(repair: RepairContext, replacement: str, attempt: int, limit: int, why: str, error: str) -> None:
    """Terminate the replacement before the next is launched: a late one must never serve next to its successor."""
    record = repair.record
    await workflow.execute_activity_method(
        FleetActivities.terminate_replacement,
        ReplacementRef(group=record.group, instance_id=replacement, impaired_instance_id=record.instance_id),
        summary=f"terminate replacement {replacement}: {why}",
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )
    record.replacement = record.replacement_container_instance_arn = None
    await repair.event(
        ev.ReplacementAbandoned(
            attempt=attempt, replacement_instance_id=replacement, why=why, error=error, attempts_left=limit - attempt
        )
    )
