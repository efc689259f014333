"""Migrations are safe when several processes start on an empty database at once; a table
prefix is used in lower case."""

from __future__ import annotations

import multiprocessing

import pytest

from conftest import unique_prefix
from sqlease import Store
from sqlease._db.migrations import CURRENT_VERSION, read_version


def _open(url: str, prefix: str) -> int:
    store = Store(url, table_prefix=prefix)
    store.enqueue("q", "{}")
    with store.driver.reading() as conn:
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
    schedules and leaders tables; version 15 the exchanges' types. A database made by version 1 is
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
        conn.execute(text(f"DROP TABLE {old.tables.exchanges.name}"))
        conn.execute(update(old.tables.schema_version).values(version=1))
    with pytest.raises(Exception, match="older"):
        Store(db_url, table_prefix=prefix, auto_migrate=False)
    new = Store(db_url, table_prefix=prefix)
    with new.driver.reading() as conn:
        assert read_version(conn, new.tables) == CURRENT_VERSION
        assert inspect(conn).has_table(new.tables.schedules.name)
        assert inspect(conn).has_table(new.tables.leaders.name)
        assert inspect(conn).has_table(new.tables.exchanges.name)
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
    with new.driver.reading() as conn:
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
    with new.driver.reading() as conn:
        assert read_version(conn, new.tables) == CURRENT_VERSION
        indexes = {i["name"] for i in inspect(conn).get_indexes(events)}
        assert f"{events}_batch_key_ix" in indexes and f"{events}_batch_ix" not in indexes
        keys = conn.execute(
            text(f"SELECT task_keys FROM {events} WHERE task_ids IS NOT NULL")
        ).scalars()
        assert all(k is not None and len(k) == 1 for k in keys)
    kinds = [(e.kind, e.attempt) for e in new.events(task_id="t-10")]
    assert kinds == [("enqueued", 0), ("claimed", 1), ("acked", 1)]


def _schema(conn: object, prefix: str, dialect: str) -> set[tuple[object, ...]]:
    """Every catalog entry of the tables, indexes, constraints and sequences under
    ``prefix``, with the prefix written as ``P_``."""
    from sqlalchemy import text

    def norm(value: object) -> object:
        return value.replace(prefix, "P_") if isinstance(value, str) else value

    if dialect == "sqlite":
        queries = [
            "SELECT type, name, tbl_name, sql FROM sqlite_master "
            "WHERE substr(name, 1, length(:p)) = :p"
        ]
    else:
        mine = "n.nspname = current_schema() AND left(c.relname, length(:p)) = :p"
        queries = [
            "SELECT c.relname, c.relkind, array_to_string(c.reloptions, ',') FROM pg_class c "
            f"JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {mine}",
            "SELECT table_name, column_name, data_type, is_nullable, column_default "
            "FROM information_schema.columns WHERE table_schema = current_schema() "
            "AND left(table_name, length(:p)) = :p",
            "SELECT tablename, indexdef FROM pg_indexes WHERE schemaname = current_schema() "
            "AND left(tablename, length(:p)) = :p",
            "SELECT c.relname, k.conname, pg_get_constraintdef(k.oid) FROM pg_constraint k "
            f"JOIN pg_class c ON c.oid = k.conrelid JOIN pg_namespace n "
            f"ON n.oid = c.relnamespace WHERE {mine}",
        ]
    found: set[tuple[object, ...]] = set()
    for n, query in enumerate(queries):
        for row in conn.execute(text(query), {"p": prefix}):  # type: ignore[attr-defined]
            found.add((n, *(norm(v) for v in row)))
    return found


def test_a_new_schema_is_the_one_the_migrations_build_one_by_one(db_url: str) -> None:
    """A schema made from nothing skips the later migrations' catalog reads (what migration 1
    made is not looked for again); it must come out exactly as running every migration in
    turn, with those reads, makes it: tables, columns, indexes, constraints, sequences and
    table settings."""
    from sqlease._db.migrations import MIGRATIONS, run_migration
    from sqlease._db.tables import build_tables

    fresh = Store(db_url, table_prefix=unique_prefix())
    one_by_one = build_tables(unique_prefix())
    with fresh.engine.begin() as conn:
        for version in range(1, len(MIGRATIONS) + 1):
            run_migration(version, conn, one_by_one)
        conn.execute(one_by_one.schema_version.insert().values(id=1, version=CURRENT_VERSION))
    dialect = fresh.engine.dialect.name
    with fresh.engine.connect() as conn:
        built = _schema(conn, fresh.tables.prefix, dialect)
        stepped = _schema(conn, one_by_one.prefix, dialect)
    assert len(built) > 40  # it saw the schema
    assert built == stepped, (sorted(built - stepped, key=str), sorted(stepped - built, key=str))
    reopened = Store(db_url, table_prefix=one_by_one.prefix, auto_migrate=False)
    reopened.enqueue("q", "{}")
    assert reopened.size("q") == 1


def test_a_mixed_case_prefix_names_its_tables_in_lower_case(db_url: str) -> None:
    """PostgreSQL folds unquoted names to lower case, and a statement may name a table either
    way: a prefix with a capital letter failed there at the first start."""
    from kombu import Connection

    mixed = "Mixed_" + unique_prefix()
    store = Store(db_url, table_prefix=mixed)
    assert store.tables.prefix == mixed.lower()
    assert store.tables.messages.name == f"{mixed.lower()}messages"
    store.enqueue("q", '{"n": 1}')
    assert Store(db_url, table_prefix=mixed.lower(), auto_migrate=False).size("q") == 1
    with Connection("sqlease+" + db_url, transport_options={"table_prefix": mixed}) as conn:
        queue = conn.SimpleQueue("kq")
        queue.put({"n": 2})
        message = queue.get(timeout=5)
        assert message.payload == {"n": 2}
        message.ack()
        queue.close()
