"""Publishes inside ``transaction.atomic()`` join Django's transaction on Django's connection:
the task exists iff the block commits, the call returns the real task id, nothing is visible
before the commit, a refused publish rolls back to its savepoint and the block goes on, and a
block open on another database makes the publish fail instead of escaping it."""

from __future__ import annotations

import pytest
from celery import Celery, chain, group

from sqlease import ConfigurationError, Store
from sqlease.admin import Admin
from sqlease.contrib.django.conf import url_of_alias


def store_of(alias: str, prefix: str) -> Store:
    return Store(url_of_alias(alias), table_prefix=prefix)


def make_orders(alias: str, prefix: str) -> str:
    from django.db import connections

    table = f"{prefix}orders"
    with connections[alias].cursor() as cursor:
        cursor.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, item VARCHAR(50))")
    return table


def order(alias: str, table: str, order_id: int, item: str) -> None:
    from django.db import connections

    with connections[alias].cursor() as cursor:
        cursor.execute(f"INSERT INTO {table} (id, item) VALUES (%s, %s)", [order_id, item])


def orders_of(alias: str, table: str) -> list[int]:
    from django.db import connections

    with connections[alias].cursor() as cursor:
        cursor.execute(f"SELECT id FROM {table} ORDER BY id")
        return [row[0] for row in cursor.fetchall()]


def test_commit_publishes_rollback_leaves_nothing(
    alias: str, prefix: str, celery_app: Celery
) -> None:
    from django.db import transaction

    table = make_orders(alias, prefix)
    store, admin = store_of(alias, prefix), Admin(url_of_alias(alias), table_prefix=prefix)
    ship = celery_app.tasks["orders.ship"]
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        order(alias, table, 1, "lost")
        lost = ship.delay(1)
        raise RuntimeError("payment declined")
    assert store.size("celery") == 0
    with pytest.raises(Exception, match="no task"):
        admin.task(lost.id)
    with transaction.atomic(using=alias):
        order(alias, table, 2, "book")
        kept = ship.delay(2)
        later = ship.apply_async((3,), countdown=60)
        sent = celery_app.send_task("orders.ship", (4,))
        # another connection (a worker's) sees nothing before the commit
        assert store.size("celery") == 0
    assert orders_of(alias, table) == [2]
    assert store.size("celery") == 2  # the countdown one is scheduled
    assert admin.task(kept.id).state == "queued"
    assert admin.task(sent.id).state == "queued"
    assert admin.task(later.id).state == "scheduled"


def test_canvas_publishes_join_too(alias: str, prefix: str, celery_app: Celery) -> None:
    from django.db import transaction

    ship = celery_app.tasks["orders.ship"]
    store = store_of(alias, prefix)
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        group(ship.s(i) for i in range(3)).apply_async()
        chain(ship.s(7), ship.si(8)).apply_async()
        raise RuntimeError
    assert store.size("celery") == 0
    with transaction.atomic(using=alias):
        group(ship.s(i) for i in range(3)).apply_async()
        chain(ship.s(7), ship.si(8)).apply_async()  # the chain's head only, for now
        assert store.size("celery") == 0
    assert store.size("celery") == 4


def test_a_refused_publish_rolls_back_to_its_savepoint(
    alias: str, prefix: str, celery_app: Celery
) -> None:
    """The database refuses one publish (a trigger here; a constraint or a lost privilege in
    life): on PostgreSQL that error would abort the caller's whole transaction, but it is
    rolled back to the publish's savepoint and the block commits the rest."""
    from django.db import connections, transaction

    table = make_orders(alias, prefix)
    messages = f"{prefix}messages"
    with connections[alias].cursor() as cursor:
        if alias == "pg":
            cursor.execute(
                f"CREATE FUNCTION {prefix}refuse() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'queue refused'; END $$"
            )
            cursor.execute(
                f"CREATE TRIGGER {prefix}refuse BEFORE INSERT ON {messages} FOR EACH ROW "
                f"WHEN (NEW.queue = 'refused') EXECUTE FUNCTION {prefix}refuse()"
            )
        else:
            cursor.execute(
                f"CREATE TRIGGER {prefix}refuse BEFORE INSERT ON {messages} "
                "WHEN NEW.queue = 'refused' BEGIN SELECT RAISE(ABORT, 'queue refused'); END"
            )
    ship = celery_app.tasks["orders.ship"]
    with transaction.atomic(using=alias):
        order(alias, table, 1, "book")
        with pytest.raises(Exception, match="queue refused"):
            ship.apply_async((1,), queue="refused")
        order(alias, table, 2, "pen")  # the transaction is still usable
        ship.delay(2)
    assert orders_of(alias, table) == [1, 2]
    store = store_of(alias, prefix)
    assert store.size("celery") == 1
    assert store.size("refused") == 0


def test_an_inner_block_rolled_back_takes_its_tasks_only(
    alias: str, prefix: str, celery_app: Celery
) -> None:
    from django.db import transaction

    ship = celery_app.tasks["orders.ship"]
    admin = Admin(url_of_alias(alias), table_prefix=prefix)
    with transaction.atomic(using=alias):
        kept = ship.delay(1)
        with pytest.raises(RuntimeError), transaction.atomic(using=alias):
            gone = ship.delay(2)
            raise RuntimeError
    assert admin.task(kept.id).state == "queued"
    with pytest.raises(Exception, match="no task"):
        admin.task(gone.id)


def test_outside_a_block_publishes_commit_at_once(
    alias: str, prefix: str, celery_app: Celery
) -> None:
    celery_app.tasks["orders.ship"].delay(1)
    assert store_of(alias, prefix).size("celery") == 1


def test_a_block_on_another_database_refuses_the_publish(
    alias: str, prefix: str, celery_app: Celery
) -> None:
    """The broker is on ``alias``; an atomic block open only on another database cannot hold
    the task: the publish fails with the aliases named instead of escaping the block."""
    from django.db import connections, transaction

    other = "pg" if alias == "sqlite" else "sqlite"
    if other not in connections.settings:
        pytest.skip("needs both databases")
    ship = celery_app.tasks["orders.ship"]
    refused = pytest.raises(ConfigurationError, match=f"alias '{other}'.*another database")
    with transaction.atomic(using=other), refused:
        ship.delay(1)
    assert store_of(alias, prefix).size("celery") == 0
    with transaction.atomic(using=other), transaction.atomic(using=alias):
        ship.delay(2)  # a block on the broker's database too: the publish joins that one
    assert store_of(alias, prefix).size("celery") == 1


def test_the_wake_up_is_sent_at_commit(prefix: str, alias: str, celery_app: Celery) -> None:
    if alias != "pg":
        pytest.skip("SQLite workers poll: there is no notification")
    import psycopg
    from django.db import transaction

    store = store_of(alias, prefix)
    url = url_of_alias(alias).set(drivername="postgresql")
    with psycopg.connect(url.render_as_string(hide_password=False), autocommit=True) as listener:
        listener.execute(f'LISTEN "{store.notify_channel}"')
        with transaction.atomic(using=alias):
            celery_app.tasks["orders.ship"].delay(1)
            assert list(listener.notifies(timeout=0.3, stop_after=1)) == []
        heard = list(listener.notifies(timeout=5, stop_after=1))
    assert len(heard) == 1


def test_a_batch_inside_a_block_joins_it(alias: str, prefix: str, celery_app: Celery) -> None:
    """A batch (a group, or ``sqlease.batch()``) opened inside ``atomic()`` is written in
    Django's transaction when it ends; one opened outside a block cannot hold a publish made
    inside it (the batch would escape the block)."""
    from django.db import transaction

    import sqlease

    ship = celery_app.tasks["orders.ship"]
    store = store_of(alias, prefix)
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        group(ship.s(i) for i in range(50)).apply_async()
        raise RuntimeError
    assert store.size("celery") == 0
    with transaction.atomic(using=alias):
        with sqlease.batch():
            for i in range(10):
                ship.delay(i)
        group(ship.s(i) for i in range(50)).apply_async()
        assert store.size("celery") == 0
    assert store.size("celery") == 60
    with (
        pytest.raises(ConfigurationError, match="opened or closed inside"),
        sqlease.batch(),
        transaction.atomic(using=alias),
    ):
        ship.delay(1)
    assert store.size("celery") == 60
