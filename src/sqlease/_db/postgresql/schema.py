"""What PostgreSQL's schema needs besides the shared tables: table settings, the offers'
sequence, the batch events' index, and a lock that serializes concurrent migrators."""

from __future__ import annotations

from sqlalchemy import Connection, text

from sqlease._db.postgresql import storage
from sqlease._db.schema_helpers import ensure_index
from sqlease._db.schema_indexes import batch_events_index, task_key
from sqlease._db.tables import MESSAGES_FILLFACTOR, Tables, offers_sequence


def lock(conn: Connection, tables: Tables) -> None:
    """Serializes concurrent migrators of one prefix; released at commit."""
    conn.execute(
        text("SELECT pg_advisory_xact_lock(hashtext(:key))"),
        {"key": f"sqlease-migrate:{tables.prefix}"},
    )


def _fillfactor(conn: Connection, tables: Tables) -> None:
    # Leave room on messages pages for HOT claims (pages written from now on; a VACUUM FULL
    # or the table draining applies it to the rest).
    conn.execute(
        text(f"ALTER TABLE {tables.messages.name} SET (fillfactor = {MESSAGES_FILLFACTOR})")
    )


def _offers_sequence(conn: Connection, tables: Tables) -> None:
    conn.execute(text(f"CREATE SEQUENCE IF NOT EXISTS {offers_sequence(tables)}"))


def _batch_event_keys(conn: Connection, tables: Tables) -> None:
    # The batch rows there are get their task keys, then the index over them replaces the
    # GIN index over the ids themselves (which kept every id ever seen).
    events = tables.events
    conn.execute(
        text(
            f"UPDATE {events.name} e SET task_keys = (SELECT array_agg(DISTINCT "
            f"{task_key('u.id')}) FILTER (WHERE u.id IS NOT NULL) FROM unnest(e.task_ids) "
            "AS u(id)) WHERE e.task_ids IS NOT NULL AND e.task_keys IS NULL"
        )
    )
    ensure_index(conn, batch_events_index(events))
    conn.execute(text(f"DROP INDEX IF EXISTS {events.name}_batch_ix"))


#: Per migration version, what PostgreSQL does after the shared part.
STEPS = {2: _fillfactor, 5: _offers_sequence, 7: storage.apply, 11: _batch_event_keys}


def step(version: int, conn: Connection, tables: Tables) -> None:
    run = STEPS.get(version)
    if run is not None:
        run(conn, tables)
