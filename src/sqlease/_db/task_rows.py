"""The task row's name, queue and latest attempt (migration 9) and its Celery group (migration
10), written by the hot statements.

A finished task's message is deleted by its ack, so what a listing shows of it afterwards
(its Celery task name, its queue, how many deliveries it took) must live in the tasks table.
It is written where the message is, without a round trip of its own:

- publish: an upsert of the task row. On PostgreSQL a CTE of the publish statement (``k``,
  reading the inserted row ``ins``); on SQLite one more statement in the publish's
  transaction, beside the ``enqueued`` event the caller writes there already.
- claim: the delivered messages' attempts. On PostgreSQL a CTE of the claim statement (and so
  of ack + claim); on SQLite one executemany in the claim's transaction. The attempt is not an
  indexed column, so on PostgreSQL the update is a HOT update of the task row.

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


def claim_cte(t: Tables) -> str:
    """PostgreSQL: CTE ``ka``, the attempts of the deliveries ``claimed`` (not of the
    messages the claim found exhausted: their attempt did not change)."""
    return (
        f"ka AS (UPDATE {t.tasks.name} k SET attempt = m.attempt FROM claimed m "
        "WHERE k.task_id = m.task_id AND m.state = 'ready')"
    )


def publish(t: Tables, now: str) -> TextClause:
    """SQLite: the task row of a message just published (caller's transaction)."""
    return text(
        f"INSERT INTO {t.tasks.name} ({_COLS}) VALUES (:task_id, :task_name, :queue, 0, "
        f"CAST(:run_id AS TEXT), NULL, '{{}}', 0, {now}, {now}, CAST(:group_id AS TEXT)) "
        f"{on_conflict(t)}"
    )


def attempts(t: Tables) -> TextClause:
    """SQLite: the attempts of a claim's deliveries (one executemany)."""
    return text(f"UPDATE {t.tasks.name} SET attempt = :attempt WHERE task_id = :task_id")
