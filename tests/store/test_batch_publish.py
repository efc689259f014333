"""A batch publish (``enqueue_many`` of several messages): statements of many rows in one
transaction, all or nothing, every message's own semantics kept (priority, delay, events,
task rows, runs and their parking, unique keys, concurrency keys), ids in the order given."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from conftest import FakeClock
from sqlease import ConfigurationError, Fence, NewMessage, PayloadTooLarge, Store
from sqlease._db import ops


def _claim_all(store: Store, queue: str = "q", limit: int = 10_000) -> list[str]:
    return [m.payload for m in store.claim([queue], "w", limit=limit, lease_ms=60_000)]


def _count(store: Store, table: str) -> int:
    with store.driver.reading() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


def test_a_batch_keeps_order_priority_delay_events_and_task_rows(
    store: Store, clock: FakeClock
) -> None:
    messages = [
        NewMessage("q", f"p{i}", task_id=f"t{i}", task_name="app.add", group_id="g1")
        for i in range(50)
    ]
    messages[10] = NewMessage("q", "urgent", priority=5, task_id="t10", task_name="app.add")
    messages[20] = NewMessage("q", "later", delay_ms=5_000, task_id="t20")
    messages[30] = NewMessage("q", "silent", task_id="t30", record=False)
    ids = store.enqueue_many(messages)
    assert len(ids) == 50 and ids == sorted(ids) and len(set(ids)) == 50
    got = _claim_all(store)
    plain = [f"p{i}" for i in range(50) if i not in (10, 20, 30)]
    assert got == ["urgent", *plain[:28], "silent", *plain[28:]]
    assert [e.kind for e in store.events(task_id="t1")] == ["enqueued", "claimed"]
    assert [e.kind for e in store.events(task_id="t30")] == ["claimed"]
    assert store.get_message(ids[20]).available_at_ms == clock() + 5_000
    with store.driver.reading() as conn:
        row = conn.execute(
            text(
                f"SELECT task_name, queue, group_id FROM {store.tables.tasks.name} "
                "WHERE task_id = 't3'"
            )
        ).one()
    assert tuple(row) == ("app.add", "q", "g1")
    clock.advance(5_000)
    assert _claim_all(store) == ["later"]


def test_a_batch_larger_than_a_statement_is_several_statements_in_one_transaction(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ops, "BATCH_ROWS", 7)
    statements: list[int] = []
    real = store.driver.publish_bulk

    def counted(conn: Any, rows: Any, now: Any) -> list[int]:
        statements.append(len(rows))
        return real(conn, rows, now)

    monkeypatch.setattr(store.driver, "publish_bulk", counted)
    ids = store.enqueue_many([NewMessage("q", f"p{i}") for i in range(30)])
    assert statements == [7, 7, 7, 7, 2]
    assert ids == sorted(ids)
    assert _claim_all(store) == [f"p{i}" for i in range(30)]

    # A statement that fails after others ran takes them all back.
    statements.clear()
    calls = iter(range(100))

    def fails_third(conn: Any, rows: Any, now: Any) -> list[int]:
        if next(calls) == 2:
            raise RuntimeError("the database refused the third statement")
        return real(conn, rows, now)

    monkeypatch.setattr(store.driver, "publish_bulk", fails_third)
    with pytest.raises(RuntimeError):
        store.enqueue_many([NewMessage("r", f"p{i}") for i in range(30)])
    assert store.size("r") == 0


def test_a_batch_over_the_bind_parameter_limits_is_published_whole(store: Store) -> None:
    # 70,000 messages: as one multi-row VALUES they would bind over a million parameters
    # (SQLite allows 32,766, PostgreSQL 65,535).
    count = 70_000
    ids = store.enqueue_many([NewMessage("big", "x", task_id=f"b{i}") for i in range(count)])
    assert len(set(ids)) == count and ids == sorted(ids)
    assert store.size("big") == count
    assert _count(store, store.tables.tasks.name) == count


def test_a_refused_member_is_named_and_nothing_is_published(store: Store) -> None:
    good = [NewMessage("q", f"p{i}", task_id=f"t{i}", task_name="app.add") for i in range(5)]
    bad = NewMessage("q", "p", task_id="tbad", task_name="app.add", priority=99_999)
    with pytest.raises(ConfigurationError) as refused:
        store.enqueue_many([*good, bad, *good])
    assert "message 6 of 11 in the batch" in str(refused.value)
    assert "app.add[tbad]" in str(refused.value)
    assert "nothing of the batch was enqueued" in str(refused.value)
    big = NewMessage("q", "x" * 2_000, task_id="huge")
    small = make_small_store(store)
    with pytest.raises(PayloadTooLarge, match="message 2 of 2 in the batch"):
        small.enqueue_many([good[0], big])
    assert store.size("q") == 0
    assert _count(store, store.tables.events.name) == 0


def make_small_store(store: Store) -> Store:
    return Store(store.engine, table_prefix=store.tables.prefix, max_payload_bytes=1_000)


def test_a_batch_in_the_callers_transaction_rolls_back_with_it(store: Store) -> None:
    with pytest.raises(RuntimeError), store.engine.begin() as conn:
        store.enqueue_many([NewMessage("q", f"p{i}") for i in range(10)], connection=conn)
        raise RuntimeError("the caller's work failed")
    assert store.size("q") == 0
    with store.engine.begin() as conn:
        store.enqueue_many([NewMessage("q", f"p{i}") for i in range(10)], connection=conn)
    assert store.size("q") == 10


def test_run_members_keep_their_order_and_parking_among_plain_messages(store: Store) -> None:
    messages = []
    for i in range(6):
        messages.append(NewMessage("q", f"plain{i}"))
        messages.append(NewMessage("q", f"run{i}", run_id="r1", task_id=f"r{i}"))
    ids = store.enqueue_many(messages)
    assert ids == sorted(ids)
    with store.driver.reading() as conn:
        states = dict(
            conn.execute(
                text(f"SELECT payload, state FROM {store.tables.messages.name} WHERE run_id = 'r1'")
            ).all()
        )
    # The run's head is ready, the rest wait parked behind it (sqlease._db.*.held).
    assert states == {"run0": "ready", **{f"run{i}": "parked" for i in range(1, 6)}}
    first = store.claim(["q"], "w", limit=100, lease_ms=60_000)
    assert [m.payload for m in first] == ["plain0", "run0", *(f"plain{i}" for i in range(1, 6))]
    head = next(m for m in first if m.payload == "run0")
    for i in range(1, 6):
        assert store.claim(["q"], "w", limit=10, lease_ms=60_000) == []
        store.ack([Fence(head.id, "w", head.attempt)])
        (head,) = store.claim(["q"], "w", limit=10, lease_ms=60_000)
        assert head.payload == f"run{i}"


def test_unique_duplicates_inside_a_batch_are_skipped_the_rest_published(store: Store) -> None:
    ids = store.enqueue_many(
        [
            NewMessage("q", "a", task_id="a", unique_key="report"),
            NewMessage("q", "plain1", task_id="p1"),
            NewMessage("q", "b", task_id="b", unique_key="report"),
            NewMessage("q", "plain2", task_id="p2"),
        ]
    )
    assert ids[2] == ids[0]  # the duplicate's id is its original's
    assert _claim_all(store) == ["a", "plain1", "plain2"]
    assert store.originals_of(["b"]) == {"b": "a"}


def test_concurrency_keyed_members_keep_their_gate(store: Store) -> None:
    messages = [
        NewMessage("q", f"g{i}", concurrency_key="api", concurrency_limit=2) for i in range(5)
    ]
    store.enqueue_many([NewMessage("q", "p0"), *messages, NewMessage("q", "p1")])
    got = _claim_all(store)
    assert got == ["p0", "g0", "g1", "p1"]
