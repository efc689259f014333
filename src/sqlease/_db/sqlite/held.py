"""SQLite: the messages parked behind their run (sqlease._db.held_tables). One writer holds
the whole file from a transaction's first write, so an enqueue and the statement that
finishes a run's head never run at once: each sees the other's commit, and the run order
rows only keep one schema with PostgreSQL's."""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db.tables import Tables

#: The runs of a promotion, as ``json_each(:runs)``'s ``value``.
RUNS = "SELECT DISTINCT value FROM json_each(:runs)"


def parks(t: Tables) -> str:
    """The new message waits for its run: it has one, and an earlier message of it is
    unfinished."""
    return (
        f"(:run_id IS NOT NULL AND EXISTS (SELECT 1 FROM {t.messages.name} h "
        "WHERE h.run_id = :run_id AND h.state IN ('ready', 'parked')))"
    )


def bump_runs(t: Tables) -> TextClause:
    ro = t.run_order.name
    return text(
        f"INSERT INTO {ro} (run_id, version) SELECT value, 1 FROM ({RUNS}) WHERE true "
        "ON CONFLICT (run_id) DO UPDATE SET version = version + 1"
    )


def promote_runs(t: Tables) -> TextClause:
    """Each run's head, made ready if it waits parked behind its run."""
    m = t.messages.name
    return text(
        f"UPDATE {m} SET state = 'ready', reason = NULL WHERE state = 'parked' "
        "AND reason = 'run' AND id IN (SELECT (SELECT h.id FROM "
        f"{m} h WHERE h.run_id = u.value AND h.state IN ('ready', 'parked') "
        f"ORDER BY h.id LIMIT 1) FROM ({RUNS}) u) RETURNING id"
    )
