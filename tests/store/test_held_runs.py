"""A run's later messages wait parked behind its head, outside the claim index, and every way
the head leaves the run makes the next one ready (docs/explanation/held-work.md), on both
databases."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import select, text, update

from sqlease import Admin, Store
from sqlease._core.maintenance import run_pass
from sqlease._db.migrations import run_migration

LEASE = 10_000


def states(store: Store, run_id: str = "R") -> list[tuple[str, str | None]]:
    """(state, reason) of the run's messages in id order."""
    m = store.tables.messages
    with store.driver.reading() as conn:
        rows = conn.execute(
            select(m.c.state, m.c.reason).where(m.c.run_id == run_id).order_by(m.c.id)
        ).all()
    return [(r.state, r.reason) for r in rows]


def run_of(store: Store, n: int, run_id: str = "R", queue: str = "q") -> list[int]:
    return [
        store.enqueue(queue, f"{run_id}{i}", task_id=f"{run_id}{i}", run_id=run_id)
        for i in range(n)
    ]


READY, WAITS = ("ready", None), ("parked", "run")


def test_later_messages_wait_parked_and_each_ack_makes_the_next_ready(store: Store) -> None:
    run_of(store, 3)
    store.enqueue("q", "alone", task_id="alone")
    assert states(store) == [READY, WAITS, WAITS]
    claimed = store.claim(["q"], "w", lease_ms=LEASE, limit=10)
    assert sorted(m.task_id or "" for m in claimed) == ["R0", "alone"]
    head = next(m for m in claimed if m.run_id == "R")
    assert store.ack([head.fence]) == {head.id}
    assert states(store) == [READY, WAITS]
    [second] = store.claim(["q"], "w", lease_ms=LEASE, limit=10)
    assert second.task_id == "R1"
    # A message published while its run's head is leased waits too.
    run_of(store, 1, run_id="R")  # task id R0 again, another message
    assert states(store) == [READY, WAITS, WAITS]


def test_a_failed_head_lets_its_run_go_on(store: Store) -> None:
    run_of(store, 2)
    [head] = store.claim(["q"], "w", lease_ms=LEASE)
    assert store.fail(head.fence, "rejected")
    assert states(store) == [("dead", "rejected"), READY]


def test_a_released_or_parked_head_keeps_its_run_waiting(store: Store) -> None:
    run_of(store, 2)
    [head] = store.claim(["q"], "w", lease_ms=LEASE)
    assert store.release([head.fence]) == {head.id}
    assert states(store) == [READY, WAITS]
    [head] = store.claim(["q"], "w", lease_ms=LEASE)
    assert store.park(head.fence, "waiting_input")
    assert states(store) == [("parked", "waiting_input"), WAITS]


def test_an_exhausted_head_gives_way_within_the_same_claim(store: Store) -> None:
    store.enqueue("q", "first", task_id="first", run_id="R", max_attempts=1)
    store.enqueue("q", "second", task_id="second", run_id="R")
    [head] = store.claim(["q"], "w", lease_ms=LEASE)
    assert store.release([head.fence]) == {head.id}  # its one attempt spent
    [second] = store.claim(["q"], "w", lease_ms=LEASE)
    assert second.task_id == "second"
    assert states(store) == [("dead", "attempts_exhausted"), READY]


def test_cancel_purge_and_queue_deletion_let_the_run_go_on(store: Store) -> None:
    admin = Admin("unused", store=store)
    run_of(store, 3)
    assert admin.cancel("R0") == 1
    assert states(store) == [("dead", "cancelled"), READY, WAITS]
    # A run across queues: its head purged from one, the next waits in another.
    store.enqueue("a", "x", task_id="x", run_id="S")
    store.enqueue("b", "y", task_id="y", run_id="S")
    assert states(store, "S") == [READY, WAITS]
    assert store.purge("a") == 1
    assert states(store, "S") == [READY]
    store.enqueue("b", "z", task_id="z", run_id="S")
    store.enqueue("c", "w", task_id="w", run_id="T")
    store.enqueue("b", "v", task_id="v", run_id="T")
    store.delete_queue("c")
    assert states(store, "T") == [READY]


def test_pausing_a_run_pauses_what_waits_behind_it(store: Store) -> None:
    admin = Admin("unused", store=store)
    run_of(store, 3)
    assert admin.pause(run_id="R") == 3
    assert store.claim(["q"], "w", lease_ms=LEASE) == []
    assert admin.resume(run_id="R") == 3
    # Resumed, all are ready; the claim's own head check keeps the run in order.
    assert [m.task_id for m in store.claim(["q"], "w", lease_ms=LEASE, limit=5)] == ["R0"]


def test_admin_shows_a_waiting_message_as_queued_with_its_reason(store: Store) -> None:
    admin = Admin("unused", store=store)
    run_of(store, 2)
    snap = admin.task("R1")
    assert (snap.state, snap.reason) == ("queued", "run")
    assert {t.task_id for t in admin.tasks(state="queued")} == {"R0", "R1"}
    stats = admin.stats()["q"]
    assert (stats["queued"], stats["held_by_run"], stats["paused"]) == (2, 1, 0)


def test_the_maintenance_pass_repairs_a_run_whose_head_waits(store: Store) -> None:
    run_of(store, 3)
    m = store.tables.messages
    with store.driver.writing() as conn:  # a promotion lost (as a worker of old code would)
        conn.execute(update(m).where(m.c.task_id == "R0").values(state="dead", reason="lost"))
    assert states(store) == [("dead", "lost"), WAITS, WAITS]
    summary = run_pass(store, event_retention_ms=60_000)
    assert summary["runs_promoted"] == 1
    assert states(store) == [("dead", "lost"), READY, WAITS]
    assert run_pass(store, event_retention_ms=60_000)["runs_promoted"] == 0


def test_the_pass_removes_the_order_rows_of_runs_with_nothing_left(store: Store) -> None:
    run_of(store, 2)
    for _ in range(2):
        [m] = store.claim(["q"], "w", lease_ms=LEASE)
        store.ack([m.fence])
    ro = store.tables.run_order
    with store.driver.reading() as conn:
        assert conn.execute(select(ro.c.run_id)).scalars().all() == ["R"]
    assert run_pass(store, event_retention_ms=60_000)["run_order_rows_removed"] == 1
    with store.driver.reading() as conn:
        assert conn.execute(select(ro.c.run_id)).scalars().all() == []


def test_the_migration_parks_what_waits_behind_its_run_today(store: Store) -> None:
    run_of(store, 3)
    [head] = store.claim(["q"], "w", lease_ms=LEASE)
    m = store.tables.messages
    with store.driver.writing() as conn:  # a database from before held work: all ready
        conn.execute(update(m).values(state="ready", reason=None).where(m.c.reason == "run"))
    assert states(store) == [READY, READY, READY]
    with store.driver.writing() as conn:
        run_migration(12, conn, store.tables)
    assert states(store) == [READY, WAITS, WAITS]
    store.ack([head.fence])
    assert states(store) == [READY, WAITS]


def test_a_claim_does_not_read_what_waits_behind_runs(store: Store, db_url: Any) -> None:
    """The claim index holds no waiting message: 200 runs of 10 leave 200 rows in it."""
    for r in range(200):
        run_of(store, 10, run_id=f"run{r}")
    m = store.tables.messages
    with store.driver.reading() as conn:
        in_index = conn.execute(select(m.c.id).where(m.c.state == "ready")).all()
    assert len(in_index) == 200
    claimed = store.claim(["q"], "w", lease_ms=LEASE, limit=50)
    assert len(claimed) == 50 and len({c.run_id for c in claimed}) == 50


def _blocked(store: Store, started: threading.Thread) -> None:
    """Until the other session waits for a row lock (its statement's snapshot is taken)."""
    deadline = time.monotonic() + 10
    query = text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database()"
    )
    while time.monotonic() < deadline:
        with store.engine.connect() as conn:
            if conn.execute(query).scalar_one():
                return
        assert started.is_alive()
        time.sleep(0.01)
    raise AssertionError("the other statement never waited for the run's row")


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.pg
@pytest.mark.timeout(30)
def test_an_enqueue_whose_snapshot_missed_the_head_leaving_does_not_park(store: Store) -> None:
    """PostgreSQL: the ack of a run's head is open (its row lock on the run held) when an
    enqueue into the run starts: the enqueue's snapshot still shows the head. Once the ack
    commits, the enqueue sees that its snapshot is stale and inserts its message ready, not
    parked behind a head that is gone (it would wait for the maintenance pass)."""
    run_of(store, 1)
    [head] = store.claim(["q"], "w", lease_ms=LEASE)
    ack = store.driver.message_ack([head.fence], store.now_ms())
    assert ack.statement is not None
    with store.engine.connect() as finisher:
        finisher.begin()
        finisher.execute(ack.statement, ack.params)  # head gone, run row locked, uncommitted
        enqueue = threading.Thread(target=run_of, args=(store, 1))
        enqueue.start()
        _blocked(store, enqueue)
        finisher.commit()
    enqueue.join(10)
    assert states(store) == [READY]


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.pg
@pytest.mark.timeout(30)
def test_an_ack_whose_snapshot_missed_an_enqueue_owes_its_promotion(store: Store) -> None:
    """PostgreSQL: an enqueue into a run is open (parked behind the head, the run's row
    locked) when the head's ack starts: the ack's snapshot cannot see the new message. The
    ack names the run as owed and the store promotes it in a statement of its own, so the
    message never waits with its run empty ahead of it."""
    run_of(store, 1)
    [head] = store.claim(["q"], "w", lease_ms=LEASE)
    result: dict[str, Any] = {}
    with store.engine.connect() as publisher:
        publisher.begin()
        store.enqueue("q", "late", task_id="late", run_id="R", connection=publisher)
        ack = threading.Thread(target=lambda: result.update(acked=store.ack([head.fence])))
        ack.start()
        _blocked(store, ack)
        publisher.commit()
    ack.join(10)
    assert result["acked"] == {head.id} and result["acked"].owed_runs == ("R",)
    assert states(store) == [READY]
