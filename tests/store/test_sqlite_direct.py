"""SQLite's per-task write transactions (enqueue, claim, ack, take, renew) run straight through
sqlite3 (sqlease._db.sqlite.direct) and behave as SQLAlchemy's transactions did: atomic, the write
lock taken up front, errors as SQLAlchemy's (a locked database is an OperationalError the store
retries; a read-only file a DatabaseReadOnly), nothing left open. Every store test on SQLite
runs through it too."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy import exc as sa_exc

from conftest import unique_prefix
from sqlease._db.engine import get_engine
from sqlease._db.spares import SPARES_PER_ENGINE
from sqlease._db.sqlite.direct import DirectTransactions, Result, Row
from sqlease.store import Store


def _store(tmp_path: Path) -> Store:
    return Store(f"sqlite:///{tmp_path / 'app.db'}", table_prefix=unique_prefix())


def test_the_per_task_operations_keep_one_connection_out_of_the_pool(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.driver.direct is not None
    checkouts: list[int] = []

    def on_checkout(*args: Any) -> None:
        checkouts.append(1)

    event.listen(store.engine, "checkout", on_checkout)
    try:
        for i in range(5):
            store.enqueue("q", f"p{i}", task_id=f"t{i}", run_id="r" if i < 2 else None)
        claimed = store.claim(["q"], "w", lease_ms=60_000, limit=3)
        assert store.renew([m.fence for m in claimed], lease_ms=60_000)
        acked, more = store.ack_and_claim([claimed[0].fence], ["q"], "w", lease_ms=60_000, limit=2)
        assert acked == {claimed[0].id}
        assert store.ack([m.fence for m in claimed[1:] + more]) == {
            m.id for m in claimed[1:] + more
        }
        store.enqueue("noack", "x")
        assert [m.payload for m in store.take(["noack"])] == ["x"]
    finally:
        event.remove(store.engine, "checkout", on_checkout)
    assert len(checkouts) <= 1  # one connection kept between transactions, none per operation
    assert store.driver.direct.spares_kept() == 1
    # Every event of those operations was written with them.
    kinds = [e.kind for e in store.events(task_id="t0")]
    assert kinds[:3] == ["enqueued", "claimed", "acked"]
    assert store.size("q") == 0


def test_a_failed_statement_rolls_the_whole_transaction_back(tmp_path: Path) -> None:
    store = _store(tmp_path)
    fast = store.driver.direct
    assert fast is not None
    table = store.tables.messages.name
    insert = text(
        f"INSERT INTO {table} (queue, payload, priority, available_at_ms, created_at_ms, "
        "state, attempt, max_attempts) VALUES (:q, 'p', 0, 0, 0, 'ready', 0, 3)"
    )
    broken = text(f"INSERT INTO {table} (no_such_column) VALUES (1)")
    with pytest.raises(sa_exc.OperationalError, match="no_such_column"), fast.begin() as tx:
        tx.execute(insert, {"q": "a"})
        tx.execute(broken, {})
    with pytest.raises(ValueError), fast.begin() as tx:  # the caller's own error too
        tx.execute(insert, {"q": "b"})
        raise ValueError("the caller changed its mind")
    assert store.size("a") == 0 and store.size("b") == 0
    # The kept connection is not left inside a transaction.
    [fairy] = list(fast._spares)
    assert not fairy.driver_connection.in_transaction
    with fast.begin() as tx:
        tx.execute(insert, {"q": "c"})
    assert store.size("c") == 1


def test_a_locked_database_is_an_operational_error_the_store_retries(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    Store(f"sqlite:///{path}", table_prefix="p_")  # the schema
    engine = get_engine(f"sqlite:///{path}", busy_timeout_ms=50)
    fast = DirectTransactions(engine)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        with pytest.raises(sa_exc.OperationalError, match="locked"), fast.begin() as tx:
            tx.execute(text("SELECT 1"), {})
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with fast.begin() as tx:  # the lock is free again: the same kept connection works
        assert tx.execute(text("SELECT 41 + :one AS n"), {"one": 1}).scalar_one() == 42


def test_a_read_only_database_is_refused_with_sqleases_error(tmp_path: Path) -> None:
    from sqlease.errors import DatabaseReadOnly

    path = tmp_path / "app.db"
    Store(f"sqlite:///{path}").enqueue("q", "kept")
    read_only = Store(f"sqlite:///file:{path}?mode=ro&uri=true", auto_migrate=False)
    assert read_only.driver.direct is not None
    with pytest.raises(DatabaseReadOnly, match="refuses writes"):
        read_only.enqueue("q", "refused")
    with pytest.raises(DatabaseReadOnly):
        read_only.ack_and_claim([], ["q"], "w", lease_ms=1000, limit=1)
    assert read_only.driver.direct.spares_kept() == 1  # rolled back and kept, not broken
    assert Store(f"sqlite:///{path}").size("q") == 1


def test_spares_are_bounded_and_never_used_by_a_forked_child(tmp_path: Path) -> None:
    store = _store(tmp_path)
    fast = store.driver.direct
    assert fast is not None
    # Three transactions at once: the first holds the write lock, the others wait for it in
    # BEGIN IMMEDIATE, each on a connection of its own.
    release = threading.Event()

    def transaction() -> None:
        with fast.begin():
            release.wait(10)

    threads = [threading.Thread(target=transaction) for _ in range(3)]
    for thread in threads:
        thread.start()
    for _ in range(1000):
        if store.engine.pool.checkedout() == 3:  # type: ignore[attr-defined]
            break
        threading.Event().wait(0.005)
    assert store.engine.pool.checkedout() == 3  # type: ignore[attr-defined]
    release.set()
    for thread in threads:
        thread.join(30)
    assert fast.spares_kept() == SPARES_PER_ENGINE
    assert store.engine.pool.checkedout() == SPARES_PER_ENGINE  # type: ignore[attr-defined]
    child = os.fork()
    if child == 0:
        code = 1
        try:
            code = 0 if fast.spares_kept() == 0 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fast.spares_kept() == SPARES_PER_ENGINE


def test_rows_and_results_answer_as_sqlalchemys_do() -> None:
    row = Row(("id", "queue"), (7, "q"))
    assert (row[0], row.queue, row._mapping["id"], row._fields, list(row)) == (
        7,
        "q",
        7,
        ("id", "queue"),
        [7, "q"],
    )
    with pytest.raises(AttributeError):
        row.missing  # noqa: B018
    assert Result([row], 1).scalar_one() == 7 and Result([], 0).scalar() is None
    with pytest.raises(sa_exc.NoResultFound):
        Result([], 0).scalar_one()
    with pytest.raises(sa_exc.MultipleResultsFound):
        Result([row, row], 2).scalar_one()
