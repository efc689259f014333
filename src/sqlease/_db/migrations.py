"""Schema versions and migrations.

``migrate()`` applies the numbered migrations under a lock, so two processes starting at once
never both create a table, and refuses a database that a newer sqlease has migrated.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

from sqlalchemy import Connection, Index, Table, inspect, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.schema import CreateIndex

from sqlease._db.schema_indexes import batch_events_index, retention_indexes, task_key
from sqlease._db.tables import MESSAGES_FILLFACTOR, Tables, offers_sequence
from sqlease.errors import SchemaError, SchemaMissing, SchemaVersionMismatch

#: Set while ``migrate`` builds a schema from nothing: migration 1 then creates every table,
#: column and index of this code's metadata, so the later migrations need not look for what
#: it made (their catalog reads were a third of the time a new schema took, about 50 ms on
#: PostgreSQL) and do only what the metadata does not say: sequences, table settings and
#: the indexes kept outside it.
_FRESH: ContextVar[bool] = ContextVar("sqlease_fresh_schema", default=False)


def _columns(conn: Connection, table: Table) -> set[str]:
    """The names of ``table``'s columns in the database."""
    if _FRESH.get():
        return {column.name for column in table.columns}
    return {c["name"] for c in inspect(conn).get_columns(table.name)}


def _create_table(conn: Connection, table: Table) -> None:
    """Create ``table`` and its indexes unless they exist."""
    if _FRESH.get():
        return  # migration 1 made them
    table.create(conn, checkfirst=True)
    for index in table.indexes:
        _ensure_index(conn, index)


def _ensure_index(conn: Connection, index: Index) -> None:
    """Create ``index`` unless it exists, in one statement: SQLAlchemy's ``checkfirst``
    reflects the table's indexes first, which on a PostgreSQL catalog holding many prefixes'
    tables took seconds per index. An index made only on some dialect keeps that check."""
    if _FRESH.get():
        return  # every index is in the metadata: migration 1 made it
    if getattr(index, "_ddl_if", None) is not None:
        index.create(conn, checkfirst=True)
    else:
        conn.execute(CreateIndex(index, if_not_exists=True))


def _migration_1(conn: Connection, tables: Tables) -> None:
    # From nothing, no table can be there to skip (a name taken by a table of someone
    # else's is then an error that says so, not a table silently used).
    tables.metadata.create_all(conn, checkfirst=not _FRESH.get())


def _migration_2(conn: Connection, tables: Tables) -> None:
    # PostgreSQL: leave room on messages pages for HOT claims (pages written from now on; a
    # VACUUM FULL or the table draining applies it to the rest). SQLite has no such setting.
    if conn.dialect.name == "postgresql":
        conn.execute(
            text(f"ALTER TABLE {tables.messages.name} SET (fillfactor = {MESSAGES_FILLFACTOR})")
        )


def _migration_3(conn: Connection, tables: Tables) -> None:
    # Batch events: columns listing the messages of one claim or ack (written on PostgreSQL,
    # NULL on SQLite) and, on PostgreSQL, their GIN index. Only what is missing is added:
    # a database made by migration 1 of this code already has them.
    events = tables.events
    present = _columns(conn, events)
    for name in ("task_ids", "message_ids", "attempts"):
        if name not in present:
            kind = events.c[name].type.compile(dialect=conn.dialect)
            conn.execute(text(f"ALTER TABLE {events.name} ADD COLUMN {name} {kind}"))
    # (Its GIN index over the task ids is replaced by migration 11's over their keys.)


def _migration_4(conn: Connection, tables: Tables) -> None:
    # Handoff offers (a table and its index; unused on SQLite, created for one schema).
    _create_table(conn, tables.offers)


def _migration_5(conn: Connection, tables: Tables) -> None:
    # Offers are marked handed instead of deleted, with the number of the write that made
    # them live (see the offers table). Only what is missing is added: a database made by
    # migration 1 of this code already has the columns.
    offers = tables.offers
    present = _columns(conn, offers)
    for name in ("offer_seq", "handed"):
        if name not in present:
            column = offers.c[name]
            kind = column.type.compile(dialect=conn.dialect)
            default = "0" if name == "offer_seq" else "false"
            conn.execute(
                text(
                    f"ALTER TABLE {offers.name} ADD COLUMN {name} {kind} NOT NULL DEFAULT {default}"
                )
            )
    if conn.dialect.name == "postgresql":
        conn.execute(text(f"CREATE SEQUENCE IF NOT EXISTS {offers_sequence(tables)}"))


def _migration_6(conn: Connection, tables: Tables) -> None:
    # Periodic tasks: the entries, their indexes and the beat's leader lease.
    for table in (tables.schedules, tables.leaders):
        _create_table(conn, table)


def _migration_7(conn: Connection, tables: Tables) -> None:
    # Bounded tables: the idle expiry of auto-delete queues (two columns), the indexes the
    # retention deletes use, and (PostgreSQL) autovacuum and fillfactor on the hot tables.
    # Only what is missing is added: a database made by migration 1 of this code has it.
    from sqlease._db.dialects import dialect_for

    queues = tables.queues
    present = _columns(conn, queues)
    for name in ("expires_ms", "expires_at_ms"):
        if name not in present:
            kind = queues.c[name].type.compile(dialect=conn.dialect)
            conn.execute(text(f"ALTER TABLE {queues.name} ADD COLUMN {name} {kind}"))
    for index in retention_indexes(tables):
        _ensure_index(conn, index)
    dialect_for(conn.dialect.name).tune_tables(conn, tables)


def _migration_flow_control(conn: Connection, tables: Tables) -> None:
    # Flow control: the messages' gate columns and index, the slots and the limits.
    messages = tables.messages
    present = _columns(conn, messages)
    for name in ("task_name", "gate_key", "gate_limit", "gate", "rate_gate"):
        if name not in present:
            kind = messages.c[name].type.compile(dialect=conn.dialect)
            conn.execute(text(f"ALTER TABLE {messages.name} ADD COLUMN {name} {kind}"))
    for index in messages.indexes:
        if index.name == f"{tables.prefix}messages_gate_ix":
            _ensure_index(conn, index)
    for table in (tables.slots, tables.flow_limits):
        _create_table(conn, table)


def _migration_9(conn: Connection, tables: Tables) -> None:
    # The tasks table keeps each task's name, queue and latest attempt (sqlease._db.task_rows).
    # Only what is missing is added (a database made by migration 1 of this code already has
    # the columns), so it does not matter which of the migrations numbered before it ran first.
    tasks = tables.tasks
    present = _columns(conn, tasks)
    for name, extra in (("task_name", ""), ("queue", ""), ("attempt", " NOT NULL DEFAULT 0")):
        if name not in present:
            kind = tasks.c[name].type.compile(dialect=conn.dialect)
            conn.execute(text(f"ALTER TABLE {tasks.name} ADD COLUMN {name} {kind}{extra}"))


def _migration_10(conn: Connection, tables: Tables) -> None:
    # Unique tasks (their keys and the duplicates turned away) and the task rows' group, by
    # which a Celery group's members are found. Only what is missing is added.
    tasks = tables.tasks
    present = _columns(conn, tasks)
    if "group_id" not in present:
        conn.execute(text(f"ALTER TABLE {tasks.name} ADD COLUMN group_id TEXT"))
    for index in tasks.indexes:
        if index.name == f"{tables.prefix}tasks_group_ix":
            _ensure_index(conn, index)
    for table in (tables.uniques, tables.duplicates):
        _create_table(conn, table)


def _migration_11(conn: Connection, tables: Tables) -> None:
    # Batch events are indexed by their task ids' hashes (``TASK_KEY_MASK``): a GIN index
    # over the ids themselves kept every id ever seen. The column is added and filled for
    # the rows there are, the new index made and the old one dropped (PostgreSQL; SQLite
    # writes no batch rows and gets the column only).
    events = tables.events
    present = _columns(conn, events)
    if "task_keys" not in present:
        kind = events.c.task_keys.type.compile(dialect=conn.dialect)
        conn.execute(text(f"ALTER TABLE {events.name} ADD COLUMN task_keys {kind}"))
    if conn.dialect.name == "postgresql":
        conn.execute(
            text(
                f"UPDATE {events.name} e SET task_keys = (SELECT array_agg(DISTINCT "
                f"{task_key('u.id')}) FILTER (WHERE u.id IS NOT NULL) FROM unnest(e.task_ids) "
                "AS u(id)) WHERE e.task_ids IS NOT NULL AND e.task_keys IS NULL"
            )
        )
        _ensure_index(conn, batch_events_index(events))
        conn.execute(text(f"DROP INDEX IF EXISTS {events.name}_batch_ix"))


# Each entry moves the schema from version N-1 to N. Append; never edit a released one.
MIGRATIONS: list[Callable[[Connection, Tables], None]] = [
    _migration_1,
    _migration_2,
    _migration_3,
    _migration_4,
    _migration_5,
    _migration_6,
    _migration_7,
    _migration_flow_control,
    _migration_9,
    _migration_10,
    _migration_11,
]
CURRENT_VERSION = len(MIGRATIONS)


def read_version(conn: Connection, tables: Tables) -> int | None:
    """The version recorded in the database, or None when sqlease's tables are absent."""
    if not inspect(conn).has_table(tables.schema_version.name):
        return None
    return _stored_version(conn, tables)


def _stored_version(conn: Connection, tables: Tables) -> int | None:
    row = conn.execute(select(tables.schema_version.c.version)).first()
    return None if row is None else int(row[0])


def _lock_for_migration(conn: Connection, tables: Tables) -> None:
    if conn.dialect.name == "postgresql":
        # Serialises concurrent migrators; released at commit. (SQLite: BEGIN IMMEDIATE
        # already holds the database's write lock.)
        conn.execute(
            text("SELECT pg_advisory_xact_lock(hashtext(:key))"),
            {"key": f"sqlease-migrate:{tables.prefix}"},
        )


def migrate(engine: Engine, tables: Tables) -> int:
    """Bring the schema to CURRENT_VERSION; safe to call from many processes at once."""
    with engine.begin() as conn:
        _lock_for_migration(conn, tables)
        fresh = not inspect(conn).has_table(tables.schema_version.name)
        found = 0 if fresh else _stored_version(conn, tables) or 0
        if found > CURRENT_VERSION:
            raise SchemaVersionMismatch(found, CURRENT_VERSION)
        token = _FRESH.set(fresh)
        try:
            for version in range(found + 1, CURRENT_VERSION + 1):
                MIGRATIONS[version - 1](conn, tables)
        finally:
            _FRESH.reset(token)
        if found == 0:
            conn.execute(tables.schema_version.insert().values(id=1, version=CURRENT_VERSION))
        elif found < CURRENT_VERSION:
            conn.execute(tables.schema_version.update().values(version=CURRENT_VERSION))
    return CURRENT_VERSION


def check(engine: Engine, tables: Tables) -> None:
    """Raise unless the database holds exactly the schema this code expects."""
    with engine.connect() as conn:
        conn.execution_options(sqlease_read_only=True)  # no write lock just to look
        found = read_version(conn, tables)
        conn.rollback()
    if found is None:
        raise SchemaMissing(
            f"sqlease tables with prefix {tables.prefix!r} are missing; run "
            "'sqlease migrate --url …' or enable auto_migrate"
        )
    if found > CURRENT_VERSION:
        raise SchemaVersionMismatch(found, CURRENT_VERSION)
    if found < CURRENT_VERSION:
        raise SchemaError(
            f"database schema version {found} is older than {CURRENT_VERSION}; run "
            "'sqlease migrate --url …' or enable auto_migrate"
        )


def ensure_schema(engine: Engine, tables: Tables, *, auto_migrate: bool) -> None:
    if auto_migrate:
        with engine.connect() as conn:
            conn.execution_options(sqlease_read_only=True)  # no write lock just to look
            found = read_version(conn, tables)
            conn.rollback()
        if found == CURRENT_VERSION:
            return
        migrate(engine, tables)
    else:
        check(engine, tables)
