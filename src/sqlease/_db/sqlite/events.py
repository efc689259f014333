"""SQLite: reading a task's or a message's events (one row per message and event)."""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db import sql_common as c
from sqlease._db.tables import Tables


def events_for_task(t: Tables) -> TextClause:
    return text(f"SELECT {c.EVENT_COLS} FROM {t.events.name} WHERE task_id = :task_id ORDER BY id")


def events_for_message(t: Tables) -> TextClause:
    return text(
        f"SELECT {c.EVENT_COLS} FROM {t.events.name} WHERE message_id = :message_id ORDER BY id"
    )


def deliveries_of_tasks(t: Tables) -> TextClause:
    """The ``claimed``, ``acked`` and ``purged`` events of the tasks ``:task_ids`` (a JSON
    array of text)."""
    return text(
        f"SELECT task_id, attempt, kind, id FROM {t.events.name} "
        "WHERE task_id IN (SELECT value FROM json_each(:task_ids)) "
        "AND kind IN ('claimed', 'acked', 'purged')"
    )
