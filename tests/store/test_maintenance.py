"""The maintenance pass on both databases (fake clock)."""

from __future__ import annotations

from typing import Any

import pytest

from sqlease import Store
from sqlease._core.maintenance import (
    BROADCAST_TTL_MS,
    MaintenanceThread,
    acquire,
    release,
    run_pass,
)
from sqlease._core.results import ResultStore
from sqlease._core.steps import StepStore
from sqlease.task_context import TaskContext
from sqlease.testing import FakeClock

DAY = 86_400_000


def test_one_worker_at_a_time(store: Store, clock: FakeClock) -> None:
    assert acquire(store, "w1", 60_000, clock())
    assert not acquire(store, "w2", 60_000, clock())
    assert acquire(store, "w1", 60_000, clock())  # the holder renews
    clock.advance(60_000)
    assert acquire(store, "w2", 60_000, clock())


def test_pass_recovers_interrupted_steps_and_expires_old_data(
    store: Store, clock: FakeClock
) -> None:
    store.enqueue("q", "{}", task_id="t")
    [msg] = store.claim(["q"], "w", lease_ms=10_000)
    ctx = TaskContext(store, msg.fence, task_id="t", lease_ms=10_000)
    StepStore(store).start(ctx.fence, "t", "charge")
    ctx.checkpoint({"n": 1})
    ResultStore(store).put("old", b"x", expires_ms=1_000)
    store.declare_queue("w1.celery.pidbox")  # as Kombu declares (and binds) it
    store.enqueue("w1.celery.pidbox", "{}", record=False)
    clock.advance(20_000)  # the worker died mid-step; its lease expired
    summary = run_pass(store, event_retention_ms=DAY)
    assert summary["steps_outcome_unknown"] == 1
    assert summary["results_expired"] == 1
    assert StepStore(store).get("t", "charge").status == "outcome_unknown"  # type: ignore[union-attr]
    assert summary["broadcasts_dropped"] == 0
    clock.advance(BROADCAST_TTL_MS)
    assert run_pass(store, event_retention_ms=DAY)["broadcasts_dropped"] == 1
    # Events and checkpoints of an active task are kept however old; of a finished one not.
    clock.advance(2 * DAY)
    assert run_pass(store, event_retention_ms=DAY)["events_expired"] == 0
    [again] = store.claim(["q"], "w", lease_ms=10_000)
    store.ack([again.fence])
    clock.advance(2 * DAY)
    summary = run_pass(store, event_retention_ms=DAY)
    assert summary["events_expired"] >= 5 and summary["task_records_expired"] == 1
    assert store.events(task_id="t") == [] and store.get_task("t") is None


def test_pass_prunes_dead_run_locks(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "{}", task_id="t", run_id="R", max_attempts=1)
    store.claim(["q"], "w", lease_ms=1_000)
    clock.advance(1_000)
    assert store.claim(["q"], "w", lease_ms=1_000) == []  # exhausted: dead
    assert run_pass(store, event_retention_ms=0)["run_locks_pruned"] == 1


@pytest.mark.pg
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_pass_drops_the_handoff_offers_of_killed_workers_only(
    store: Store, clock: FakeClock
) -> None:
    """A killed worker never withdraws its offers (used ones included). Once long expired and
    with the worker's listening connection gone (its advisory lock free), they are dropped;
    a live worker's are kept however old."""
    from sqlease._core.handoff import lock_key_for
    from sqlease._db.postgresql.dialect import DEAD_OFFER_AFTER_MS
    from sqlease._db.postgresql.listener import PostgresListener

    live = PostgresListener(store.engine.url, store.notify_channel, lock_key=lock_key_for("live"))
    assert live.fileno() is not None
    try:
        for owner in ("live", "dead"):
            store.offer(["q"], owner, lease_ms=1_000, lock_key=lock_key_for(owner), ttl_ms=1_000)
        clock.advance(1_000 + DEAD_OFFER_AFTER_MS)
        assert run_pass(store, event_retention_ms=0)["dead_offers_dropped"] == 0  # not yet
        clock.advance(1)
        assert run_pass(store, event_retention_ms=0)["dead_offers_dropped"] == 1
        offers = store.tables.offers
        with store.engine.connect() as conn:
            owners = conn.execute(offers.select().with_only_columns(offers.c.owner)).scalars()
            assert list(owners) == ["live"]
    finally:
        live.close()


def test_dead_messages_and_unexpiring_results_leave_after_the_retention(
    store: Store, clock: FakeClock
) -> None:
    from sqlalchemy import func, select

    from sqlease.admin import Admin

    admin = Admin(store.engine.url, store=store)
    store.enqueue("q", "{}", task_id="cancelled")
    admin.cancel("cancelled")  # a dead message and a REVOKED result without an expiry
    store.enqueue("q", "{}", task_id="kept")
    ResultStore(store).put("user-result", b"x")  # no expiry, not one sqlease wrote: kept
    clock.advance(2 * DAY)
    summary = run_pass(store, event_retention_ms=DAY)
    assert summary["dead_messages_expired"] == 1
    assert summary["unexpiring_results_expired"] == 1
    assert admin.reads.result_state("cancelled") is None
    assert store.events(task_id="cancelled") == []  # its timeline went with it
    with store.driver.reading() as conn:
        left = conn.execute(select(func.count()).select_from(store.tables.messages)).scalar()
    assert left == 1 and ResultStore(store).get("user-result") == b"x"


def test_a_pass_writes_the_failure_a_killed_worker_left_out(make_store: Any) -> None:
    """The claim that marks a message dead commits before its worker writes the FAILURE
    result; a worker killed in between leaves none, and the next pass writes it."""
    from sqlease._core.maintenance import run_pass
    from sqlease._core.results import ResultStore

    store = make_store(max_attempts=1)
    store.enqueue("q", "poison", task_id="t-poison")
    [first] = store.claim(["q"], "w", lease_ms=1000)
    store.release([first.fence])
    exhausted: list[Any] = []
    assert store.claim(["q"], "w", lease_ms=1000, on_exhausted=exhausted.extend) == []
    assert [m.task_id for m in exhausted] == ["t-poison"]  # ... and the worker dies here
    results = ResultStore(store)
    assert results.get("celery-task-meta-t-poison") is None
    summary = run_pass(store, event_retention_ms=0)
    assert summary["exhausted_results_written"] == 1
    assert results.get("celery-task-meta-t-poison") is not None
    assert run_pass(store, event_retention_ms=0)["exhausted_results_written"] == 0


def test_a_stopped_maintenance_thread_gives_the_lock_up(store: Store, clock: FakeClock) -> None:
    thread = MaintenanceThread(store, "w1", interval=30, event_retention_ms=DAY)
    assert thread.run_once() is not None  # a pass: w1 holds the lock for 60 s
    assert not acquire(store, "w2", 60_000, clock())
    assert not release(store, "w2")  # only the holder gives it up
    thread.stop()
    assert acquire(store, "w2", 60_000, clock())  # at once, not after w1's lease
    assert thread.run_once() is None  # a stopped thread runs no more passes
    assert not acquire(store, "w1", 60_000, clock())


def test_a_pass_under_way_at_stop_gives_the_lock_up_when_it_ends(
    store: Store, clock: FakeClock
) -> None:
    thread = MaintenanceThread(store, "w1", interval=30, event_retention_ms=DAY)
    assert thread.run_once() is not None
    with thread._pass_lock:  # as if the thread were in a pass
        thread.stop()
    assert not acquire(store, "w2", 60_000, clock())  # stop() left it to the thread
    thread._run()  # the thread's way out: stop is set, so no pass, then the release
    assert acquire(store, "w2", 60_000, clock())
