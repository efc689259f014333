"""Schema versions and migrations.

``migrate()`` applies the numbered migrations under a lock, so two processes starting at once
never both create a table, and refuses a database that a newer sqlease has migrated.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import Connection, Index, inspect, select, text
from sqlalchemy.engine import Engine

from sqlease._db.dialects import dialect_for
from sqlease._db.schema_helpers import FRESH, columns, create_table, ensure_index
from sqlease._db.schema_indexes import RETENTION_INDEXES
from sqlease._db.tables import Tables
from sqlease.errors import SchemaError, SchemaMissing, SchemaVersionMismatch


def retention_indexes(tables: Tables) -> list[Index]:
    """The indexes of RETENTION_INDEXES, as built for ``tables``."""
    wanted = {tables.name(n) for names in RETENTION_INDEXES.values() for n in names}
    return [
        index
        for table in tables.metadata.sorted_tables
        for index in table.indexes
        if index.name in wanted
    ]


def _migration_1(conn: Connection, tables: Tables) -> None:
    # From nothing, no table can be there to skip (a name taken by a table of someone
    # else's is then an error that says so, not a table silently used).
    tables.metadata.create_all(conn, checkfirst=not FRESH.get())


def _migration_2(conn: Connection, tables: Tables) -> None:
    # The messages table's fillfactor: a storage setting, the dialect's step alone.
    pass


def _migration_3(conn: Connection, tables: Tables) -> None:
    # Batch events: columns listing the messages of one claim or ack (written on PostgreSQL,
    # NULL on SQLite) and, on PostgreSQL, their GIN index. Only what is missing is added:
    # a database made by migration 1 of this code already has them.
    events = tables.events
    present = columns(conn, events)
    for name in ("task_ids", "message_ids", "attempts"):
        if name not in present:
            kind = events.c[name].type.compile(dialect=conn.dialect)
            conn.execute(text(f"ALTER TABLE {events.name} ADD COLUMN {name} {kind}"))
    # (Its GIN index over the task ids is replaced by migration 11's over their keys.)


def _migration_4(conn: Connection, tables: Tables) -> None:
    # Handoff offers (a table and its index; unused on SQLite, created for one schema).
    create_table(conn, tables.offers)


def _migration_5(conn: Connection, tables: Tables) -> None:
    # Offers are marked handed instead of deleted, with the number of the write that made
    # them live (see the offers table). Only what is missing is added: a database made by
    # migration 1 of this code already has the columns.
    offers = tables.offers
    present = columns(conn, offers)
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
    # (The offers' sequence, where the dialect has sequences, is its own step.)


def _migration_6(conn: Connection, tables: Tables) -> None:
    # Periodic tasks: the entries, their indexes and the beat's leader lease.
    for table in (tables.schedules, tables.leaders):
        create_table(conn, table)


def _migration_7(conn: Connection, tables: Tables) -> None:
    # Bounded tables: the idle expiry of auto-delete queues (two columns), the indexes the
    # retention deletes use (the dialect's step: its table settings, such as autovacuum and
    # fillfactor). Only what is missing is added: a database made by migration 1 of this code
    # has it.
    queues = tables.queues
    present = columns(conn, queues)
    for name in ("expires_ms", "expires_at_ms"):
        if name not in present:
            kind = queues.c[name].type.compile(dialect=conn.dialect)
            conn.execute(text(f"ALTER TABLE {queues.name} ADD COLUMN {name} {kind}"))
    for index in retention_indexes(tables):
        ensure_index(conn, index)


def _migration_flow_control(conn: Connection, tables: Tables) -> None:
    # Flow control: the messages' gate columns and index, the slots and the limits.
    messages = tables.messages
    present = columns(conn, messages)
    for name in ("task_name", "gate_key", "gate_limit", "gate", "rate_gate"):
        if name not in present:
            kind = messages.c[name].type.compile(dialect=conn.dialect)
            conn.execute(text(f"ALTER TABLE {messages.name} ADD COLUMN {name} {kind}"))
    for index in messages.indexes:
        if index.name == f"{tables.prefix}messages_gate_ix":
            ensure_index(conn, index)
    for table in (tables.slots, tables.flow_limits):
        create_table(conn, table)


def _migration_9(conn: Connection, tables: Tables) -> None:
    # The tasks table keeps each task's name, queue and attempt at publish (sqlease._db.task_rows).
    # Only what is missing is added (a database made by migration 1 of this code already has
    # the columns), so it does not matter which of the migrations numbered before it ran first.
    tasks = tables.tasks
    present = columns(conn, tasks)
    for name, extra in (("task_name", ""), ("queue", ""), ("attempt", " NOT NULL DEFAULT 0")):
        if name not in present:
            kind = tasks.c[name].type.compile(dialect=conn.dialect)
            conn.execute(text(f"ALTER TABLE {tasks.name} ADD COLUMN {name} {kind}{extra}"))


def _migration_10(conn: Connection, tables: Tables) -> None:
    # Unique tasks (their keys and the duplicates turned away) and the task rows' group, by
    # which a Celery group's members are found. Only what is missing is added.
    tasks = tables.tasks
    present = columns(conn, tasks)
    if "group_id" not in present:
        conn.execute(text(f"ALTER TABLE {tasks.name} ADD COLUMN group_id TEXT"))
    for index in tasks.indexes:
        if index.name == f"{tables.prefix}tasks_group_ix":
            ensure_index(conn, index)
    for table in (tables.uniques, tables.duplicates):
        create_table(conn, table)


def _migration_11(conn: Connection, tables: Tables) -> None:
    # Batch events are indexed by their task ids' hashes (``TASK_KEY_MASK``): a GIN index
    # over the ids themselves kept every id ever seen. The column is added and filled for
    # the rows there are, the new index made and the old one dropped (PostgreSQL; SQLite
    # writes no batch rows and gets the column only).
    events = tables.events
    present = columns(conn, events)
    if "task_keys" not in present:
        kind = events.c.task_keys.type.compile(dialect=conn.dialect)
        conn.execute(text(f"ALTER TABLE {events.name} ADD COLUMN task_keys {kind}"))
    # (Filling it, and the index over it, are the step of a dialect that writes batch rows.)


def _migration_12(conn: Connection, tables: Tables) -> None:
    # Held work: the run order rows and the index of the messages parked behind their run
    # (sqlease._db.held_tables). The messages of runs that wait today are parked by the
    # maintenance pass's repair, which every worker runs.
    create_table(conn, tables.run_order)
    for index in tables.messages.indexes:
        if index.name == f"{tables.prefix}messages_run_wait_ix":
            ensure_index(conn, index)
    # The messages that wait behind an unfinished earlier one of their run today (in the
    # claim index until now) are parked; a head finished meanwhile by a worker of the
    # version before is repaired by the maintenance pass.
    m = tables.messages.name
    conn.execute(
        text(
            f"UPDATE {m} SET state = 'parked', reason = 'run' WHERE state = 'ready' "
            "AND run_id IS NOT NULL AND lease_owner IS NULL "
            f"AND EXISTS (SELECT 1 FROM {m} h WHERE h.run_id = {m}.run_id AND h.id < {m}.id "
            "AND h.state IN ('ready', 'parked'))"
        )
    )


def _migration_13(conn: Connection, tables: Tables) -> None:
    # Held work at a full gate and behind a rate limit: the indexes of the messages parked
    # at a gate and of those given their rate's due time. The messages that
    # wait at a full gate today stay ready until a worker's sweep parks them.
    for index in tables.messages.indexes:
        if index.name in (
            f"{tables.prefix}messages_gate_wait_ix",
            f"{tables.prefix}messages_rate_wait_ix",
        ):
            ensure_index(conn, index)


def _migration_14(conn: Connection, tables: Tables) -> None:
    # Claims and renewals as HOT updates on PostgreSQL: its step drops the indexes that named
    # the lease's columns (sqlease._db.postgresql.schema). Nothing shared: SQLite keeps them.
    pass


def _migration_15(conn: Connection, tables: Tables) -> None:
    # The declared exchanges' types (sqlease._db.topology_tables). An exchange declared by
    # an earlier version is recorded at its next declaration.
    create_table(conn, tables.exchanges)


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
    _migration_12,
    _migration_13,
    _migration_14,
    _migration_15,
]
CURRENT_VERSION = len(MIGRATIONS)


def run_migration(version: int, conn: Connection, tables: Tables) -> None:
    """Migration ``version`` (from 1): the part every dialect shares, then the dialect's own
    (its table settings, sequences and indexes)."""
    MIGRATIONS[version - 1](conn, tables)
    dialect_for(conn.dialect.name).schema_step(version, conn, tables)


def read_version(conn: Connection, tables: Tables) -> int | None:
    """The version recorded in the database, or None when sqlease's tables are absent."""
    if not inspect(conn).has_table(tables.schema_version.name):
        return None
    return _stored_version(conn, tables)


def _stored_version(conn: Connection, tables: Tables) -> int | None:
    row = conn.execute(select(tables.schema_version.c.version)).first()
    return None if row is None else int(row[0])


def migrate(engine: Engine, tables: Tables) -> int:
    """Bring the schema to CURRENT_VERSION; safe to call from many processes at once."""
    with engine.begin() as conn:
        dialect_for(conn.dialect.name).lock_schema(conn, tables)
        fresh = not inspect(conn).has_table(tables.schema_version.name)
        found = 0 if fresh else _stored_version(conn, tables) or 0
        if found > CURRENT_VERSION:
            raise SchemaVersionMismatch(found, CURRENT_VERSION)
        token = FRESH.set(fresh)
        try:
            for version in range(found + 1, CURRENT_VERSION + 1):
                run_migration(version, conn, tables)
        finally:
            FRESH.reset(token)
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
