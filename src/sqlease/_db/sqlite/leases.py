"""SQLite: claim, renew, ack and transition. The engine opens every transaction with BEGIN
IMMEDIATE, so a statement and the run locks and events its caller writes after it run under
the database's single write lock: no other writer can interleave."""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db import sql_common as c
from sqlease._db.sqlite.dialect import FENCES, GREATEST, NOW, QUEUES_IN, ROW_PREFIX
from sqlease._db.tables import Tables

_EXHAUSTED = "attempt >= max_attempts"


def _fenced_ids(t: Tables) -> str:
    """The ids of the messages still held under the fences ``:fences``."""
    return f"SELECT m.id FROM {t.messages.name} m JOIN ({FENCES}) f ON {c.fenced_join(NOW)}"


def claim(t: Tables, *, single_queue: bool) -> TextClause:
    """Lease up to ``:limit`` messages of ``:queue`` (``single_queue``) or ``:queues`` to
    ``:owner``: the UPDATE picks and leases in one statement; an exhausted message goes dead
    instead."""
    m, x = t.messages.name, _EXHAUSTED
    ready = c.ready(t, NOW, c.QUEUE_EQ if single_queue else QUEUES_IN)
    return text(
        f"UPDATE {m} AS m SET "
        f"lease_owner = CASE WHEN {x} THEN NULL ELSE :owner END, "
        f"lease_expires_at_ms = CASE WHEN {x} THEN NULL "
        f"ELSE {NOW} + :lease_ms END, "
        f"state = CASE WHEN {x} THEN 'dead' ELSE 'ready' END, "
        f"reason = CASE WHEN {x} THEN 'attempts_exhausted' ELSE reason END, "
        f"attempt = CASE WHEN {x} THEN attempt ELSE attempt + 1 END "
        f"WHERE m.id IN (SELECT m.id FROM {m} m WHERE {ready} "
        f"AND (m.run_id IS NULL OR {c.run_free(t, NOW)}) {c.ORDER} LIMIT :limit) "
        f"{c.returning(ROW_PREFIX)}"
    )


def claim_runs(t: Tables) -> TextClause:
    """The run lock of a claimed message of a run (one executemany per claim)."""
    return text(
        f"INSERT INTO {t.runs.name} (run_id, message_id, attempt, lease_owner, "
        "lease_expires_at_ms) VALUES (:run_id, :message_id, :attempt, :owner, "
        ":lease_expires_at_ms) ON CONFLICT (run_id) DO UPDATE SET "
        "message_id = excluded.message_id, attempt = excluded.attempt, "
        "lease_owner = excluded.lease_owner, "
        "lease_expires_at_ms = excluded.lease_expires_at_ms"
    )


def renew(t: Tables) -> TextClause:
    """The new expiry is max(old, now + lease): based on now, never on the old expiry, and
    never shortened. An expired lease is not renewed."""
    return text(
        f"UPDATE {t.messages.name} AS m SET lease_expires_at_ms = "
        f"{GREATEST}(lease_expires_at_ms, {NOW} + :lease_ms) "
        f"WHERE m.id IN ({_fenced_ids(t)}) RETURNING id, run_id, lease_expires_at_ms"
    )


def ack(t: Tables) -> TextClause:
    return text(
        f"DELETE FROM {t.messages.name} WHERE id IN ({_fenced_ids(t)}) "
        "RETURNING id, task_id, attempt, run_id"
    )


def transition(t: Tables) -> TextClause:
    """Release, park or fail fenced deliveries."""
    return text(
        f"UPDATE {t.messages.name} AS m SET {c.transition_set(NOW)} "
        f"WHERE m.id IN ({_fenced_ids(t)}) RETURNING id, task_id, attempt, run_id"
    )
