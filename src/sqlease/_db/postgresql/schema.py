"""What PostgreSQL's schema needs besides the shared tables: table settings, the offers'
sequence, the batch events' index, the messages' indexes that keep claims HOT, and a lock that
serializes concurrent migrators."""

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


def _hot_claims(conn: Connection, tables: Tables) -> None:
    # A claim writes the lease's owner and expiry and the attempt, a renewal the expiry: no
    # index of the messages may name those columns (not even in its WHERE), or PostgreSQL
    # adds a new entry to every index for each of them instead of a HOT update on the same
    # page. The leases left on rows that are not ready are cleared (the maintenance pass did
    # it through the index dropped here; parking at a gate now clears them as it parks), and
    # the gate index that held the lease's expiry gives way to one of a gate's ready rows.
    m = tables.messages.name
    conn.execute(
        text(
            f"UPDATE {m} SET lease_owner = NULL, lease_expires_at_ms = NULL "
            "WHERE state <> 'ready' AND lease_owner IS NOT NULL"
        )
    )
    conn.execute(text(f"DROP INDEX IF EXISTS {m}_stray_ix"))
    conn.execute(text(f"DROP INDEX IF EXISTS {m}_gate_ix"))
    for index in tables.messages.indexes:
        if index.name == f"{m}_gate_ready_ix":
            ensure_index(conn, index)


#: Per migration version, what PostgreSQL does after the shared part.
STEPS = {
    2: _fillfactor,
    5: _offers_sequence,
    7: storage.apply,
    11: _batch_event_keys,
    14: _hot_claims,
}


def step(version: int, conn: Connection, tables: Tables) -> None:
    run = STEPS.get(version)
    if run is not None:
        run(conn, tables)
