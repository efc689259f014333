"""The statements of a unique task's publish (sqlease._core.uniques), in the SQL both
dialects share, built once per store."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import TextClause, text

from sqlease._db.tables import Tables


@dataclass(frozen=True)
class UniqueStatements:
    #: the newest live message of the key's holder (``:holder``), scope ``active``
    holding_active: TextClause
    #: the same, scope ``queued``: only while it is not running (no live lease, or parked)
    holding_queued: TextClause
    #: take a new key (returns the key, or nothing when it exists)
    take_new: TextClause
    #: the key's row, locked until the publish's transaction ends
    lock: TextClause
    #: a key that no longer holds goes to the new task
    take_over: TextClause
    #: one more publish turned away
    count: TextClause
    #: the duplicate's task id and its original
    record: TextClause


def unique_statements(t: Tables, *, row_locks: bool) -> UniqueStatements:
    """``row_locks``: the lock is a ``FOR UPDATE`` (PostgreSQL); a single-writer database
    (SQLite) is already locked whole by the publish's first write."""
    m, u, d = t.messages.name, t.uniques.name, t.duplicates.name
    newest = f"SELECT id FROM {m} WHERE task_id = :holder AND state <> 'dead'"
    not_running = (
        "(state = 'parked' OR lease_owner IS NULL OR lease_expires_at_ms IS NULL "
        "OR lease_expires_at_ms <= :now)"
    )
    terms = "task_id = :task_id, scope = :scope, until_ms = :until_ms, created_at_ms = :now"
    return UniqueStatements(
        holding_active=text(f"{newest} ORDER BY id DESC LIMIT 1"),
        holding_queued=text(f"{newest} AND {not_running} ORDER BY id DESC LIMIT 1"),
        take_new=text(
            f"INSERT INTO {u} (key, task_id, scope, until_ms, created_at_ms, duplicates) "
            "VALUES (:key, :task_id, :scope, :until_ms, :now, 0) "
            "ON CONFLICT (key) DO NOTHING RETURNING key"
        ),
        lock=text(
            f"SELECT task_id, scope, until_ms FROM {u} WHERE key = :key"
            + (" FOR UPDATE" if row_locks else "")
        ),
        take_over=text(f"UPDATE {u} SET {terms}, duplicates = 0 WHERE key = :key"),
        count=text(f"UPDATE {u} SET duplicates = duplicates + 1 WHERE key = :key"),
        record=text(
            f"INSERT INTO {d} (task_id, original_id, unique_key, created_at_ms) "
            "VALUES (:task_id, :holder, :key, :now) ON CONFLICT (task_id) DO NOTHING"
        ),
    )
