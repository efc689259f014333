"""Transactional enqueue: a task published inside the caller's transaction exists iff that
transaction commits (SQLite and PostgreSQL, Connection and ORM Session)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

import sqlease
from conftest import unique_prefix
from sqlease import ConfigurationError, Store


@pytest.fixture
def setup(db_url: str) -> Iterator[tuple[Celery, Store, Engine, Table]]:
    prefix = unique_prefix()
    app = Celery("outbox_tests", broker=f"sqlease+{db_url}", set_as_current=False)
    app.conf.broker_transport_options = {"table_prefix": prefix}

    @app.task(name="orders.ship", shared=False)
    def ship(order_id: int) -> int:
        return order_id

    app.finalize()
    store = Store(db_url, table_prefix=prefix)
    url = db_url.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = create_engine(url)
    orders = Table(
        f"{prefix}orders",
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("item", String(50)),
    )
    orders.create(engine)
    yield app, store, engine, orders
    engine.dispose()
    app.close()


def queued(store: Store) -> int:
    return store.size("celery") + store.size("priority")


def test_commit_publishes_rollback_does_not(setup: tuple[Celery, Store, Engine, Table]) -> None:
    app, store, engine, orders = setup
    ship = app.tasks["orders.ship"]
    with pytest.raises(RuntimeError), engine.begin() as conn, sqlease.transaction(conn):
        conn.execute(insert(orders).values(id=1, item="lost"))
        ship.delay(1)
        raise RuntimeError("the order could not be saved")
    assert queued(store) == 0
    with engine.begin() as conn, sqlease.transaction(conn):
        conn.execute(insert(orders).values(id=2, item="book"))
        ship.delay(2)
        ship.apply_async((3,), countdown=30)  # options still apply
        ship.s(4).apply_async(priority=7)  # and signatures
    assert queued(store) == 2  # the countdown one is scheduled, not ready
    with engine.connect() as conn:
        assert conn.execute(select(orders.c.item)).scalars().all() == ["book"]


def test_with_an_orm_session(setup: tuple[Celery, Store, Engine, Table]) -> None:
    app, store, engine, orders = setup
    ship = app.tasks["orders.ship"]
    with Session(engine) as session:
        with sqlease.transaction(session):
            session.execute(insert(orders).values(id=5, item="pen"))
            ship.delay(5)
        session.rollback()
    assert queued(store) == 0
    with Session(engine) as session:
        with sqlease.transaction(session):
            session.execute(insert(orders).values(id=6, item="ink"))
            ship.delay(6)
        assert queued(store) == 0  # not visible before commit
        session.commit()
    assert queued(store) == 1


def test_other_database_is_refused(
    setup: tuple[Celery, Store, Engine, Table], tmp_path: object
) -> None:
    app, store, _, _ = setup
    other = create_engine(f"sqlite:///{tmp_path}/other.db")
    try:
        with (
            other.begin() as conn,
            sqlease.transaction(conn),
            pytest.raises(ConfigurationError, match="different database"),
        ):
            app.tasks["orders.ship"].delay(1)
    finally:
        other.dispose()
    assert queued(store) == 0


def test_an_autocommit_connection_outside_a_transaction_is_refused(
    setup: tuple[Celery, Store, Engine, Table],
) -> None:
    """Each statement of an autocommit connection commits on its own: the enqueue could not
    be all or nothing with the caller's writes, so it is refused, not silently done apart.
    The same connection with a transaction begun by hand is taken."""
    app, store, engine, orders = setup
    ship = app.tasks["orders.ship"]
    auto = engine.execution_options(isolation_level="AUTOCOMMIT")
    with auto.connect() as conn:
        with (
            pytest.raises(ConfigurationError, match="autocommit mode") as refused,
            sqlease.transaction(conn),
        ):
            conn.execute(insert(orders).values(id=1, item="apart"))
            ship.delay(1)
        assert "conn.begin()" in str(refused.value)
        assert queued(store) == 0
        conn.exec_driver_sql("BEGIN")  # by hand: now inside a transaction
        with sqlease.transaction(conn):
            conn.execute(insert(orders).values(id=2, item="rolled back"))
            ship.delay(2)
        conn.exec_driver_sql("ROLLBACK")
        assert queued(store) == 0
        conn.exec_driver_sql("BEGIN")
        with sqlease.transaction(conn):
            ship.delay(3)
        conn.exec_driver_sql("COMMIT")
    assert queued(store) == 1
    with engine.connect() as conn, sqlease.transaction(conn):  # a transaction begins at once
        ship.delay(4)
        conn.commit()
    assert queued(store) == 2


def test_transaction_needs_a_connection_or_session() -> None:
    with pytest.raises(TypeError, match="Connection or Session"), sqlease.transaction("nope"):
        pass


def test_fresh_sqlite_database_gets_a_clear_error_not_a_hang(tmp_path: object) -> None:
    import time

    url = f"sqlite:///{tmp_path}/fresh.db"
    app = Celery("fresh", broker=f"sqlease+{url}", set_as_current=False)

    @app.task(name="fresh.t", shared=False)
    def t() -> None:
        pass

    engine = create_engine(url)
    orders = Table("orders", MetaData(), Column("id", Integer, primary_key=True))
    orders.create(engine)
    started = time.monotonic()
    with (
        pytest.raises(ConfigurationError, match="sqlease migrate"),
        engine.begin() as conn,
        sqlease.transaction(conn),
    ):
        conn.execute(insert(orders).values(id=1))
        t.delay()
    assert time.monotonic() - started < 5
    with engine.connect() as conn:
        assert conn.execute(select(orders.c.id)).all() == []  # the order rolled back too
    engine.dispose()
    app.close()
