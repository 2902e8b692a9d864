"""The drain semaphore's state as a plain model: room under the cap, who is granted first, holders leaving, the
group's count, and where launches met capacity errors. The workflow tests (test_drain_semaphore.py and others) keep
what only a server shows: signals, grants on the wire, reclaiming closed holders, continue-as-new."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from contract.groups import CapacityGroup, GroupConfigState
from contract.semaphore import LaunchOutcome, PermitRequest
from workflows.models import SemaphoreRun
from workflows.semaphore_state import MAX_ZONES, SemaphoreState

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


def request(instance: str, token: str = "t") -> PermitRequest:
    return PermitRequest(holder_workflow_id=f"repair/{instance}/1", instance_id=instance, token=token)


def state(capacity: int = 2, **fields: object) -> SemaphoreState:
    made = SemaphoreState.from_run(SemaphoreRun(group="g"))
    made.capacity = capacity
    for name, value in fields.items():
        setattr(made, name, value)
    return made


def test_the_cap_counts_holders_and_instances_out_of_service() -> None:
    semaphore = state(capacity=3, out_of_service=1, unheld_draining={"i-draining"})
    assert semaphore.room() == 2
    semaphore.hold(request("i-1"), NOW)
    assert semaphore.room() == 1 and semaphore.max_holders_seen == 1
    # A repair of an instance already DRAINING takes its place, not more room.
    semaphore.hold(request("i-draining"), NOW)
    assert semaphore.room() == 1 and semaphore.out_of_service == 0 and semaphore.unheld_draining == set()
    assert len(semaphore.breaker.grants) == 2


def test_those_already_draining_go_first_then_as_many_as_fit() -> None:
    semaphore = state(capacity=2, out_of_service=1, unheld_draining={"i-d"})
    waiting = [request("i-1"), request("i-2"), request("i-d")]
    assert [r.instance_id for r in semaphore.fitting(waiting)] == ["i-d", "i-1"]
    full = state(capacity=1, out_of_service=1, unheld_draining={"i-d"})
    assert full.fits(request("i-d")) and not full.fits(request("i-1"))
    assert [r.instance_id for r in full.fitting(waiting)] == ["i-d"]


def test_a_holder_that_leaves_frees_its_room_and_asks_for_a_count() -> None:
    semaphore = state(capacity=1, measured_at=NOW)
    semaphore.hold(request("i-1"), NOW)
    semaphore.waiters.append(request("i-2"))
    semaphore.changed = False
    assert not semaphore.count_due(NOW + timedelta(seconds=1), timedelta(minutes=1))
    semaphore.remove("repair/i-1/1")
    assert semaphore.holders == [] and semaphore.changed and semaphore.holder_left
    assert semaphore.count_due(NOW + timedelta(seconds=1), timedelta(minutes=1))
    semaphore.changed = False
    semaphore.remove("repair/nobody/1")
    assert not semaphore.changed


def test_a_count_older_than_the_reclaim_interval_is_due() -> None:
    semaphore = state(measured_at=NOW)
    assert not semaphore.count_due(NOW + timedelta(seconds=59), timedelta(minutes=1))
    assert semaphore.count_due(NOW + timedelta(minutes=1), timedelta(minutes=1))
    assert state().count_due(NOW, timedelta(minutes=1))  # never counted


def test_only_a_holder_with_its_token_tells_how_a_launch_went() -> None:
    semaphore = state()
    semaphore.hold(request("i-1", token="secret"), NOW)
    failed = LaunchOutcome(
        holder_workflow_id="repair/i-1/1", token="secret", availability_zone="az-a", capacity_error=True
    )
    assert semaphore.launch_outcome(failed, NOW) is None and semaphore.launch_failures == {"az-a": NOW}
    forged = failed.model_copy(update={"token": "guess", "availability_zone": "az-b"})
    assert semaphore.launch_outcome(forged, NOW) == "launch outcome for repair/i-1/1, not a permit holder's"
    launched = failed.model_copy(update={"capacity_error": False})
    assert semaphore.launch_outcome(launched, NOW) is None and semaphore.launch_failures == {}


def test_the_launch_record_is_bounded() -> None:
    semaphore = state()
    semaphore.hold(request("i-1"), NOW)
    for n in range(MAX_ZONES + 5):
        outcome = LaunchOutcome(
            holder_workflow_id="repair/i-1/1", token="t", availability_zone=f"az-{n}", capacity_error=True
        )
        semaphore.launch_outcome(outcome, NOW)
    assert len(semaphore.launch_failures) == MAX_ZONES


def test_a_grant_names_the_azs_to_avoid_while_their_failures_are_recent() -> None:
    group = CapacityGroup(name="g", cluster="c", allow_other_azs=True, az_avoid_for=timedelta(minutes=30))
    semaphore = state(
        config=GroupConfigState(group="g", effective=group),
        launch_failures={"az-a": NOW, "az-b": NOW - timedelta(hours=1)},
    )
    assert semaphore.avoid_azs(NOW) == ["az-a"]
    assert semaphore.launch_failures == {"az-a": NOW}  # the old one forgotten
    staying = state(config=GroupConfigState(group="g", effective=group.model_copy(update={"allow_other_azs": False})))
    staying.launch_failures = {"az-a": NOW}
    assert staying.avoid_azs(NOW) == []


def test_what_the_next_run_takes_over() -> None:
    semaphore = state(rejected=2, forged=1, dropped_requests=3)
    semaphore.hold(request("i-1"), NOW)
    semaphore.waiters.append(request("i-2"))
    carried = semaphore.carried()
    again = SemaphoreState.from_run(carried)
    assert (again.holders, again.waiters, again.rejected, again.forged, again.dropped_requests) == (
        semaphore.holders,
        semaphore.waiters,
        2,
        1,
        3,
    )
    assert again.breaker == semaphore.breaker and again.max_holders_seen == 1
    assert again.capacity == 1 and again.group_size == 0  # counted afresh
