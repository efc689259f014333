"""Migrations are safe when several processes start on an empty database at once."""

from __future__ import annotations

import multiprocessing

import pytest

from conftest import unique_prefix
from sqlease import Store
from sqlease._db.migrations import CURRENT_VERSION, read_version


def _open(url: str, prefix: str) -> int:
    store = Store(url, table_prefix=prefix)
    store.enqueue("q", "{}")
    with store._reading() as conn:
        return int(read_version(conn, store.tables) or 0)


@pytest.mark.timeout(120)
def test_concurrent_first_connects_migrate_once(db_url: str) -> None:
    prefix = unique_prefix()
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        versions = pool.starmap(_open, [(db_url, prefix)] * 4)
    assert versions == [CURRENT_VERSION] * 4
    assert Store(db_url, table_prefix=prefix, auto_migrate=False).size("q") == 4


def test_a_version_1_database_is_migrated_and_keeps_its_messages(db_url: str) -> None:
    """Version 2 leaves room on PostgreSQL's messages pages for HOT claims; version 3 adds
    the batch-event columns (and their index on PostgreSQL); version 4 the handoff offers
    table; version 5 the offers' number and handed mark; version 6 the periodic tasks'
    schedules and leaders tables. A database made by version 1 is
    brought to the current version at the next start, messages and all."""
    from sqlalchemy import inspect, text, update

    prefix = unique_prefix()
    old = Store(db_url, table_prefix=prefix)
    old.enqueue("q", '{"n": 1}', task_id="t-old")
    messages, events = old.tables.messages.name, old.tables.events.name
    with old.engine.begin() as conn:  # as version 1 left it
        if old.is_postgresql:
            conn.execute(text(f"ALTER TABLE {messages} RESET (fillfactor)"))
            conn.execute(text(f"DROP INDEX {events}_batch_key_ix"))
        for column in ("task_ids", "message_ids", "attempts", "task_keys"):
            conn.execute(text(f"ALTER TABLE {events} DROP COLUMN {column}"))
        conn.execute(text(f"DROP TABLE {old.tables.offers.name}"))
        conn.execute(text(f"DROP TABLE {old.tables.schedules.name}"))
        conn.execute(text(f"DROP TABLE {old.tables.leaders.name}"))
        conn.execute(update(old.tables.schema_version).values(version=1))
    with pytest.raises(Exception, match="older"):
        Store(db_url, table_prefix=prefix, auto_migrate=False)
    new = Store(db_url, table_prefix=prefix)
    with new._reading() as conn:
        assert read_version(conn, new.tables) == CURRENT_VERSION
        assert inspect(conn).has_table(new.tables.schedules.name)
        assert inspect(conn).has_table(new.tables.leaders.name)
        columns = {c["name"] for c in inspect(conn).get_columns(events)}
        assert {"task_ids", "message_ids", "attempts"} <= columns
        offers = new.tables.offers.name
        assert {c["name"] for c in inspect(conn).get_columns(offers)} == {
            "owner",
            "queue",
            "lease_ms",
            "lock_key",
            "expires_at_ms",
            "offer_seq",
            "handed",
        }
        assert f"{offers}_queue_ix" in {i["name"] for i in inspect(conn).get_indexes(offers)}
        if new.is_postgresql:
            options = conn.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = :name"),
                {"name": messages},
            ).scalar()
            assert "fillfactor=50" in options
            options = conn.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = :name"),
                {"name": f"{events}_batch_key_ix"},
            ).scalar()
            assert options == ["gin_pending_list_limit=1024"]  # the index exists, as made
    [claimed] = new.claim(["q"], "w", lease_ms=1000)
    assert claimed.payload == '{"n": 1}'
    assert new.ack([claimed.fence]) == {claimed.id}
    kinds = [(e.kind, e.message_id, e.attempt) for e in new.events(task_id="t-old")]
    assert kinds == [
        ("enqueued", claimed.id, 0),
        ("claimed", claimed.id, 1),
        ("acked", claimed.id, 1),
    ]


def test_a_version_4_database_gets_the_offers_number_and_handed_mark(db_url: str) -> None:
    """Version 5 keeps used handoff offers (marked handed, with the number of the write that
    made them live) instead of deleting them; a version 4 database, offers and all, gets the
    columns and, on PostgreSQL, the sequence at the next start."""
    from sqlalchemy import inspect, text, update

    from sqlease._db.tables import offers_sequence

    prefix = unique_prefix()
    old = Store(db_url, table_prefix=prefix)
    offers = old.tables.offers.name
    with old.engine.begin() as conn:  # as version 4 left it, with one offer standing
        for column in ("offer_seq", "handed"):
            conn.execute(text(f"ALTER TABLE {offers} DROP COLUMN {column}"))
        if old.is_postgresql:
            conn.execute(text(f"DROP SEQUENCE {offers_sequence(old.tables)}"))
        conn.execute(
            text(
                f"INSERT INTO {offers} (owner, queue, lease_ms, lock_key, expires_at_ms) "
                "VALUES ('w', 'q', 1000, 7, 0)"
            )
        )
        conn.execute(update(old.tables.schema_version).values(version=4))
    new = Store(db_url, table_prefix=prefix)
    with new._reading() as conn:
        assert read_version(conn, new.tables) == CURRENT_VERSION
        columns = {c["name"] for c in inspect(conn).get_columns(offers)}
        assert {"offer_seq", "handed"} <= columns
        row = conn.execute(text(f"SELECT owner, offer_seq, handed FROM {offers}")).one()
        assert (row.owner, row.offer_seq, bool(row.handed)) == ("w", 0, False)
        if new.is_postgresql:
            seq = offers_sequence(new.tables)
            assert conn.execute(text(f"SELECT nextval('{seq}')")).scalar() == 1


@pytest.mark.pg
def test_a_version_10_database_gets_its_batch_events_keyed(pg_database_url: str) -> None:
    """Version 11 indexes batch events by their task ids' hashes: a version 10 database's
    batch rows (indexed by the ids themselves) get their keys, the old index is dropped, and
    a task's timeline still lists its claim and ack."""
    from sqlalchemy import inspect, text, update

    prefix = unique_prefix()
    old = Store(pg_database_url, table_prefix=prefix)
    old.enqueue("q", "x", task_id="t-10")
    [msg] = old.claim(["q"], "w", lease_ms=1000)
    old.ack([msg.fence])
    events = old.tables.events.name
    with old.engine.begin() as conn:  # as version 10 left it
        conn.execute(text(f"DROP INDEX {events}_batch_key_ix"))
        conn.execute(text(f"ALTER TABLE {events} DROP COLUMN task_keys"))
        conn.execute(
            text(
                f"CREATE INDEX {events}_batch_ix ON {events} USING gin (task_ids) "
                "WHERE task_ids IS NOT NULL"
            )
        )
        conn.execute(update(old.tables.schema_version).values(version=10))
    new = Store(pg_database_url, table_prefix=prefix)
    with new._reading() as conn:
        assert read_version(conn, new.tables) == CURRENT_VERSION
        indexes = {i["name"] for i in inspect(conn).get_indexes(events)}
        assert f"{events}_batch_key_ix" in indexes and f"{events}_batch_ix" not in indexes
        keys = conn.execute(
            text(f"SELECT task_keys FROM {events} WHERE task_ids IS NOT NULL")
        ).scalars()
        assert all(k is not None and len(k) == 1 for k in keys)
    kinds = [(e.kind, e.attempt) for e in new.events(task_id="t-10")]
    assert kinds == [("enqueued", 0), ("claimed", 1), ("acked", 1)]
