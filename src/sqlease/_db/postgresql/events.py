"""PostgreSQL: reading a task's or a message's events, batch rows expanded."""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db import sql_common as c
from sqlease._db.schema_indexes import task_key
from sqlease._db.tables import Tables


def _expanded(t: Tables) -> str:
    """The batch rows (one per claim or ack statement, ``batch_event``) as one row per
    message."""
    return (
        "SELECT e.id, u.task_id, u.message_id, u.attempt, e.kind, e.data, e.at_ms "
        f"FROM {t.events.name} e CROSS JOIN LATERAL "
        "unnest(e.task_ids, e.message_ids, e.attempts) AS u(task_id, message_id, attempt) "
    )


def events_for_task(t: Tables) -> TextClause:
    """A task's own rows and, expanded, the batch rows that list it (found by its task key
    through the GIN index, then by its id)."""
    key = task_key("CAST(:task_id AS TEXT)")
    return text(
        f"SELECT {c.EVENT_COLS} FROM {t.events.name} WHERE task_id = :task_id UNION ALL "
        f"{_expanded(t)} WHERE e.task_keys @> ARRAY[{key}] "
        "AND e.task_ids @> ARRAY[CAST(:task_id AS TEXT)] "
        "AND u.task_id = :task_id ORDER BY id, message_id"
    )


def events_for_message(t: Tables) -> TextClause:
    """A message's batch rows are searched without an index (a diagnostic query: a delivery
    is known by its task)."""
    return text(
        f"SELECT {c.EVENT_COLS} FROM {t.events.name} WHERE message_id = :message_id "
        f"UNION ALL {_expanded(t)} WHERE e.message_ids @> ARRAY[CAST(:message_id AS BIGINT)] "
        "AND u.message_id = :message_id ORDER BY id"
    )


def deliveries_of_tasks(t: Tables) -> TextClause:
    """The ``claimed``, ``acked`` and ``purged`` events of the tasks ``:task_ids`` (a JSON
    array of text; a page of a listing): their own rows, and the batch rows that list them,
    found by their task keys through the GIN index, then by their ids."""
    ids = "ARRAY(SELECT jsonb_array_elements_text(CAST(:task_ids AS JSONB)))"
    keys = f"ARRAY(SELECT {task_key('x')} FROM unnest({ids}) x)"
    return text(
        f"SELECT task_id, attempt, kind, id FROM {t.events.name} "
        f"WHERE task_id = ANY({ids}) AND kind IN ('claimed', 'acked', 'purged') UNION ALL "
        "SELECT u.task_id, u.attempt, e.kind, e.id "
        f"FROM {t.events.name} e CROSS JOIN LATERAL "
        "unnest(e.task_ids, e.attempts) AS u(task_id, attempt) "
        f"WHERE e.task_keys && {keys} AND e.task_ids && {ids} "
        f"AND e.kind IN ('claimed', 'acked') AND u.task_id = ANY({ids})"
    )
