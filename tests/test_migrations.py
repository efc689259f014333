"""Migrations are safe when several processes start on an empty database at once."""

from __future__ import annotations

import multiprocessing

import pytest

from conftest import unique_prefix
from sqlease import Store
from sqlease.schema import CURRENT_VERSION, read_version


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
    table. A database made by version 1 is brought to the current version at the next
    start, messages and all."""
    from sqlalchemy import inspect, text, update

    prefix = unique_prefix()
    old = Store(db_url, table_prefix=prefix)
    old.enqueue("q", '{"n": 1}', task_id="t-old")
    messages, events = old.tables.messages.name, old.tables.events.name
    with old.engine.begin() as conn:  # as version 1 left it
        if old.is_postgresql:
            conn.execute(text(f"ALTER TABLE {messages} RESET (fillfactor)"))
            conn.execute(text(f"DROP INDEX {events}_batch_ix"))
        for column in ("task_ids", "message_ids", "attempts"):
            conn.execute(text(f"ALTER TABLE {events} DROP COLUMN {column}"))
        conn.execute(text(f"DROP TABLE {old.tables.offers.name}"))
        conn.execute(update(old.tables.schema_version).values(version=1))
    with pytest.raises(Exception, match="older"):
        Store(db_url, table_prefix=prefix, auto_migrate=False)
    new = Store(db_url, table_prefix=prefix)
    with new._reading() as conn:
        assert read_version(conn, new.tables) == CURRENT_VERSION == 4
        columns = {c["name"] for c in inspect(conn).get_columns(events)}
        assert {"task_ids", "message_ids", "attempts"} <= columns
        offers = new.tables.offers.name
        assert {c["name"] for c in inspect(conn).get_columns(offers)} == {
            "owner",
            "queue",
            "lease_ms",
            "lock_key",
            "expires_at_ms",
        }
        assert f"{offers}_queue_ix" in {i["name"] for i in inspect(conn).get_indexes(offers)}
        if new.is_postgresql:
            options = conn.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = :name"),
                {"name": messages},
            ).scalar()
            assert options == ["fillfactor=50"]
            options = conn.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = :name"),
                {"name": f"{events}_batch_ix"},
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
