"""The task row's name, queue and attempt at publish (migration 9) and its Celery group
(migration 10), written by the publish statements.

A finished task's message is deleted by its ack, so what a listing shows of it afterwards
(its Celery task name, its queue) must live in the tasks table. It is written where the
message is, without a round trip of its own: on PostgreSQL a CTE of the publish statement
(``k``, reading the inserted row ``ins``); on SQLite one more statement in the publish's
transaction, beside the ``enqueued`` event the caller writes there already.

The row's ``attempt`` is the message's at publish: 0, or 1 when a handoff leased it to an
idle worker. The claims leave the row alone: their deliveries' attempts are in the message
row while it lives and in the ``claimed`` and ``acked`` events (one batch row per statement)
after, where a listing reads them (``Timeline.delivered_on``). Updating the row at each claim
cost a claim of 32 about a third of its executor time (docs/performance.md, section 3).

A republished task id (Celery's ``retry``) keeps its row: the name stays, the queue and the
attempt follow the newest message.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db.tables import Tables

#: The columns of a task row's upsert (the publish's, and the beat's batch of fires).
COLS = (
    "task_id, task_name, queue, attempt, run_id, state, checkpoint, revision, "
    "created_at_ms, updated_at_ms, group_id"
)
_COLS = COLS


def on_conflict(t: Tables) -> str:
    """A republished task id keeps its row (see above)."""
    return (
        "ON CONFLICT (task_id) DO UPDATE SET "
        f"task_name = COALESCE(excluded.task_name, {t.tasks.name}.task_name), "
        "queue = excluded.queue, attempt = excluded.attempt, "
        f"run_id = COALESCE(excluded.run_id, {t.tasks.name}.run_id), "
        f"group_id = COALESCE(excluded.group_id, {t.tasks.name}.group_id), "
        "updated_at_ms = excluded.updated_at_ms"
    )


def publish_cte(t: Tables, now: str) -> str:
    """PostgreSQL: CTE ``k``, the task row of the message ``ins`` inserted (its attempt is 1
    when a handoff leased it)."""
    return (
        f"k AS (INSERT INTO {t.tasks.name} ({_COLS}) "
        "SELECT task_id, CAST(:task_name AS TEXT), queue, attempt, run_id, NULL, '{}', 0, "
        f"{now}, {now}, CAST(:group_id AS TEXT) FROM ins WHERE task_id IS NOT NULL "
        f"{on_conflict(t)})"
    )


def publish_batch_cte(t: Tables, now: str, source: str) -> str:
    """PostgreSQL: CTE ``k``, the task rows of a batch's messages ``source`` (a CTE with
    ``id``, ``task_id``, ``task_name``, ``queue`` and ``group_id``; no run). A task id
    published twice in one batch (a topic routed to two queues) is one row, as if published
    one after the other: the newest message's queue (one statement cannot update a row
    twice)."""
    return (
        f"k AS (INSERT INTO {t.tasks.name} ({_COLS}) "
        "SELECT DISTINCT ON (task_id) task_id, task_name, queue, 0, CAST(NULL AS TEXT), NULL, "
        f"'{{}}', 0, {now}, {now}, group_id FROM {source} WHERE task_id IS NOT NULL "
        f"ORDER BY task_id, id DESC {on_conflict(t)})"
    )


def publish(t: Tables, now: str) -> TextClause:
    """SQLite: the task row of a message just published (caller's transaction)."""
    return text(
        f"INSERT INTO {t.tasks.name} ({_COLS}) VALUES (:task_id, :task_name, :queue, 0, "
        f"CAST(:run_id AS TEXT), NULL, '{{}}', 0, {now}, {now}, CAST(:group_id AS TEXT)) "
        f"{on_conflict(t)}"
    )
