"""A redelivered task whose final result is already stored never runs again
(sqlease.transport._completion.settle_redelivered): its new delivery is acked with a
``completed_from_stored_outcome`` event, and when that ack is not confirmed (an earlier try
committed and its answer was lost, as across a server restart, or another worker holds the
delivery now) it is still not run: the chaos run caught a task run twice that way."""

from __future__ import annotations

from sqlease import Admin, Store
from sqlease._core.results import ResultStore
from sqlease.testing import FakeClock
from sqlease.transport._completion import settle_redelivered
from sqlease.types import Message

LEASE_MS = 1_000


def _finished_then_redelivered(store: Store, clock: FakeClock) -> Message:
    """The first delivery stored its SUCCESS and died before its ack; the second one."""
    store.enqueue("q", "{}", task_id="t")
    [first] = store.claim(["q"], "w1", lease_ms=LEASE_MS)
    stored = ResultStore(store).put(
        "celery-task-meta-t", b"{}", state="SUCCESS", task_id="t", fence=first.fence
    )
    assert stored
    clock.advance(LEASE_MS + 1)
    [again] = store.claim(["q"], "w2", lease_ms=LEASE_MS)
    assert again.id == first.id and again.attempt == 2
    return again


def test_a_redelivery_of_a_finished_task_is_acked_without_running(
    store: Store, clock: FakeClock
) -> None:
    again = _finished_then_redelivered(store, clock)
    done, revoked = settle_redelivered(store, ResultStore(store), [again])
    assert done == {again.id} and revoked == set()
    snap = Admin("x", store=store).task("t")
    assert snap.state == "succeeded"
    assert [e["kind"] for e in snap.events].count("completed_from_stored_outcome") == 1


def test_one_whose_ack_is_not_confirmed_is_not_run_either(store: Store, clock: FakeClock) -> None:
    again = _finished_then_redelivered(store, clock)
    # The ack went through once already, and its answer was lost: the retry finds nothing.
    assert store.ack([again.fence]) == {again.id}
    done, _ = settle_redelivered(store, ResultStore(store), [again])
    assert done == {again.id}
    kinds = [e["kind"] for e in Admin("x", store=store).task("t").events]
    assert "completed_from_stored_outcome" not in kinds  # not known to be this ack's doing


def test_one_taken_over_meanwhile_is_left_to_its_new_holder(store: Store, clock: FakeClock) -> None:
    again = _finished_then_redelivered(store, clock)
    clock.advance(LEASE_MS + 1)
    [third] = store.claim(["q"], "w3", lease_ms=LEASE_MS)
    assert third.attempt == 3
    done, _ = settle_redelivered(store, ResultStore(store), [again])
    assert done == {again.id}  # not run by the stale holder
    assert store.ack([third.fence]) == {third.id}  # the new holder's to settle
