"""SQLite: publishing, taking, and the next due time."""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db import sql_common as c
from sqlease._db.ops import BATCH_FIELDS
from sqlease._db.sqlite import held
from sqlease._db.sqlite.dialect import NOW, QUEUES_IN
from sqlease._db.tables import Tables


def enqueue(t: Tables) -> TextClause:
    """Publish one message (its ``enqueued`` event is the caller's, in the same
    transaction); a message of a run whose earlier messages are unfinished is inserted
    parked behind its run (sqlease._db.sqlite.held)."""
    # The run's probe once, for both the state and the reason.
    state = "CASE WHEN p.waits THEN 'parked' ELSE 'ready' END"
    return text(
        f"INSERT INTO {t.messages.name} ({c.INSERT_COLS}, reason) "
        f"SELECT {c.insert_values(NOW, state)}, CASE WHEN p.waits THEN 'run' END "
        f"FROM (SELECT {held.parks(t)} AS waits) p WHERE true RETURNING id"
    )


def enqueue_batch(t: Tables) -> TextClause:
    """Publish many messages (no run, no uniqueness or concurrency key: ``ops.batch_row``)
    in one statement, from one JSON array of rows (``ops.batch_json``), in the order
    given: under the one write lock their ids grow in that order. Their events and task rows
    are the caller's, in the same transaction."""
    fields = ", ".join(
        f"json_extract(value, '$[{i}]') AS {name}" for i, name in enumerate(BATCH_FIELDS[:7])
    )
    return text(
        f"INSERT INTO {t.messages.name} ({c.INSERT_COLS}) "
        f"SELECT queue, payload, priority, {NOW} + max(delay_ms, 0), {NOW}, NULL, task_id, "
        "'ready', 0, max_attempts, task_name, NULL, NULL "
        f"FROM (SELECT {fields}, key FROM json_each(:rows)) ORDER BY key RETURNING id"
    )


def take(t: Tables) -> TextClause:
    return c.take(
        t,
        f"id IN (SELECT m.id FROM {t.messages.name} m WHERE {c.take_ready(NOW, QUEUES_IN)} "
        f"{c.ORDER} LIMIT :limit)",
    )


def next_due(t: Tables) -> TextClause:
    """When the next delayed message of ``:queues`` is due, in milliseconds from now (lets an
    idle worker sleep until exactly then instead of polling); a closed rate limit's
    reopening counts as a due time."""
    due = c.next_due_at(t, "SELECT DISTINCT value AS q FROM json_each(:queues)", NOW)
    rate = c.rate_due(t, NOW)
    # SQLite's two-argument min is NULL if either is: each falls back on the other.
    return text(f"SELECT min(COALESCE({due}, {rate}), COALESCE({rate}, {due})) - {NOW}")
