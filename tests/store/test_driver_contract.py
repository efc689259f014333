"""The driver contract, run against every dialect (as huey's StorageTests and River's driver
tests are): what the lease core may rely on from ``store.driver``, whatever the database.

Each test states one promise of ``sqlease._db.driver.Driver`` and checks it through the
driver's own methods, on a SQLite file and on PostgreSQL (the ``store`` fixture).
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from sqlease._db.driver import Driver, Lane, Op
from sqlease.store import Fence, Store
from sqlease.testing import FakeClock

LEASE = 30_000


def _rows(store: Store, queue: str = "q") -> list[Any]:
    m = store.tables.messages
    with store.driver.reading() as conn:
        return list(conn.execute(select(m.c.id, m.c.payload).where(m.c.queue == queue)))


def test_the_capabilities_match_the_lanes(store: Store) -> None:
    driver: Driver = store.driver
    for lane in Lane:
        fast = driver.lane(lane)
        if not driver.caps.one_statement:
            assert fast is None, lane  # every op is a transaction there
        elif lane is not Lane.PUBLISH:
            assert fast is not None, lane
    # Offers and batch events are PostgreSQL's data-modifying statements; they come together.
    assert driver.caps.offers == driver.caps.one_statement == driver.caps.batch_events


def test_a_body_op_commits_its_transaction(store: Store) -> None:
    m = store.tables.messages
    op: Op[int] = Op(
        Lane.LEASES,
        body=lambda conn: conn.execute(store.sql.enqueue_plain, _new("q", "one")).scalar_one(),
        finish=lambda message_id: int(message_id) * 10,
    )
    ten_times = store.driver.execute(op)
    [(message_id, payload)] = _rows(store)
    assert (ten_times, payload) == (message_id * 10, "one")
    assert m.name.startswith(store.tables.prefix)


def test_a_body_op_that_raises_writes_nothing(store: Store) -> None:
    def body(conn: Any) -> None:
        conn.execute(store.sql.enqueue_plain, _new("q", "lost"))
        raise RuntimeError("the caller's failure")

    with pytest.raises(RuntimeError, match="caller's failure"):
        store.driver.execute(Op(Lane.LEASES, body=body))
    assert _rows(store) == []


def test_a_hot_op_is_sendable_where_it_is_one_statement(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "a")
    op = store.claim_op(["q"], "w", LEASE, 1, clock())
    assert op.lane is Lane.LEASES
    assert op.sendable == store.driver.caps.one_statement
    [message] = store.driver.execute(op)
    assert (message.payload, message.lease_owner, message.attempt) == ("a", "w", 1)


def test_fence_and_queue_parameters_bind_a_batch(store: Store, clock: FakeClock) -> None:
    for payload in ("a", "b", "c"):
        store.enqueue("q1", payload)
    store.enqueue("q2", "d")
    claimed = store.claim(["q1", "q2"], "w", lease_ms=LEASE, limit=10)
    assert sorted(m.payload for m in claimed) == ["a", "b", "c", "d"]
    keep, *done = claimed
    # A stale attempt in the batch is refused while the others are acked.
    stale = Fence(keep.id, "w", keep.attempt + 1)
    assert store.ack([*(m.fence for m in done), stale]) == {m.id for m in done}
    assert store.ack([keep.fence]) == {keep.id}


def test_the_timeline_is_the_same_on_every_dialect(store: Store, clock: FakeClock) -> None:
    """PostgreSQL writes run locks and events inside its statements, SQLite beside them
    (``after_claim``, ``after_transitions``): the store reads back the same timeline."""
    store.enqueue("q", "a", task_id="t1", run_id="r1")
    store.enqueue("q", "b", task_id="t2", run_id="r1")
    [first] = store.claim(["q"], "w", lease_ms=LEASE, limit=5)
    assert first.task_id == "t1"  # its run's next message waits behind it
    assert store.claim(["q"], "w", lease_ms=LEASE, limit=5) == []
    assert store.renew([first.fence], lease_ms=LEASE) == {first.id: clock() + LEASE}
    assert store.ack([first.fence]) == {first.id}
    [second] = store.claim(["q"], "w", lease_ms=LEASE, limit=5)
    assert second.task_id == "t2"
    kinds = [(e.kind, e.attempt) for e in store.events(task_id="t1")]
    assert kinds == [("enqueued", 0), ("claimed", 1), ("acked", 1)]
    [claimed] = [e for e in store.events(task_id="t2") if e.kind == "claimed"]
    assert claimed.data == {"owner": "w"}


def test_insert_upserts_on_every_dialect(store: Store) -> None:
    locks = store.tables.locks
    for owner in ("a", "b"):
        stmt = store.driver.insert(locks).values(name="x", owner=owner, expires_at_ms=1)
        upsert = stmt.on_conflict_do_update(
            index_elements=[locks.c.name], set_={"owner": stmt.excluded.owner}
        )
        with store.driver.writing() as conn:
            conn.execute(upsert)
    with store.driver.reading() as conn:
        assert conn.execute(select(locks.c.owner).where(locks.c.name == "x")).scalar() == "b"


@pytest.mark.timeout(30)
def test_a_commit_wakes_the_driver_s_waker(store: Store) -> None:
    """After a write that notifies ``channel`` commits, a waker of that channel wakes
    (LISTEN/NOTIFY on PostgreSQL; the file's data_version on SQLite)."""
    channel = f"{store.tables.prefix}contract"
    waker = store.driver.waker(channel)
    try:
        waker.ready()  # connect (PostgreSQL: LISTEN) and take what is pending
        with store.driver.writing() as conn:
            conn.execute(store.sql.enqueue_plain, _new("q", "wake"))
            store.driver.notify(conn, channel, "hello")
        assert waker.wait(10.0)
    finally:
        waker.close()


def test_a_fork_section_is_a_context_manager(store: Store) -> None:
    with store.driver.fork_section():
        store.enqueue("q", "inside")
    assert [p for _, p in _rows(store)] == ["inside"]


def _new(queue: str, payload: str) -> dict[str, Any]:
    return {
        "queue": queue,
        "payload": payload,
        "priority": 0,
        "delay_ms": 0,
        "run_id": None,
        "task_id": None,
        "max_attempts": 3,
        "record": False,
        "task_name": None,
        "gate_key": None,
        "gate_limit": None,
        "group_id": None,
        "now": None,
        "channel": "unused",
    }
