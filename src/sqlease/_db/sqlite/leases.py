"""SQLite: claim, renew, ack and transition. The engine opens every transaction with BEGIN
IMMEDIATE, so a statement and the run locks and events its caller writes after it run under
the database's single write lock: no other writer can interleave."""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db import sql_common as c
from sqlease._db.sqlite.dialect import FENCES, GREATEST, NOW, ROW_PREFIX
from sqlease._db.tables import Tables

_EXHAUSTED = "attempt >= max_attempts"


def _fenced_ids(t: Tables) -> str:
    """The ids of the messages still held under the fences ``:fences``."""
    return f"SELECT m.id FROM {t.messages.name} m JOIN ({FENCES}) f ON {c.fenced_join(NOW)}"


def _running(t: Tables, gate: str) -> str:
    """The live leases claimed under the gate ``gate`` (one writer at a time: exact). Read
    from the gate index alone: a live lease implies a ready message (every transition out of
    ready clears the lease)."""
    return (
        f"(SELECT count(*) FROM {t.messages.name} h WHERE h.gate = {gate} "
        f"AND h.lease_expires_at_ms > {NOW})"
    )


#: A claim over several queues reads the first ``QUEUE_SCANS`` of them each in its own
#: index scan; any further ones share one scan whose rows are sorted.
QUEUE_SCANS = 4


def _one_queue(t: Tables, queue: str) -> str:
    """``m`` is in ``queue``, at one of its priorities. With the priority an equality (``IN``
    a list, which SQLite walks in index order), the claim index reads each priority's due
    rows and stops at the first one not yet due; without it, a claim that found fewer due
    rows than it asked for read every delayed row of the queue (9.4 ms per claim with
    100,000 delayed messages, against 0.3 ms: benchmarks/claim_scans.py)."""
    return f"m.queue = {queue} AND m.priority IN {c.ready_priorities(t, queue)}"


def _first(t: Tables, queue: str) -> str:
    """The first ``:limit`` claimable rows of ``queue`` (a predicate on ``m.queue``) in
    delivery order, each with its gate and limit; a full gate's rows are skipped, so they
    never block the rows behind them."""
    rows = (
        f"SELECT m.id, m.priority, m.available_at_ms, ({_EXHAUSTED}) AS exh, "
        f"{c.GATE} AS gate, {c.GATE_LIMIT} AS lim, {c.RATE} AS rate, "
        f"{c.RATE_INTERVAL} AS ivl, {c.RATE_TAU} AS tau, {c.RATE_TAT} AS tat "
        # Named, not chosen: with statistics (ANALYZE) and a row in the limits table the
        # planner scanned every message instead (tests/store/test_sqlite_plans.py).
        f"FROM {t.messages.name} m INDEXED BY {t.messages.name}_claim_ix {c.gate_joins(t)} "
        f"WHERE {c.ready(t, NOW, queue)} AND (m.run_id IS NULL OR {c.run_free(t, NOW)})"
    )
    return (
        f"SELECT g.* FROM ({rows}) g WHERE {c.gate_open(_running(t, 'g.gate'))} "
        f"AND {c.rate_open(NOW)} "
        "ORDER BY g.priority DESC, g.available_at_ms, g.id LIMIT :limit"
    )


def _candidates(t: Tables, *, single_queue: bool) -> str:
    """The first ``:limit`` claimable rows of the claim's queues. Several queues: the first
    ``:limit`` of each queue, each read in its own index scan, then the best ``:limit`` of
    those. One scan over ``queue IN (...)`` returned the queues' rows in index order, queue
    by queue, so SQLite sorted every due row of them: 191 ms per claim over two queues with
    200,000 due, against 2.7 ms now (benchmarks/claim_scans.py)."""
    if single_queue:
        return _first(t, _one_queue(t, ":queue"))
    nth = [f"json_extract(:queues, '$[{i}]')" for i in range(QUEUE_SCANS)]
    scans = [f"SELECT * FROM ({_first(t, _one_queue(t, queue))})" for queue in nth]
    rest = f"m.queue IN (SELECT value FROM json_each(:queues) WHERE key >= {QUEUE_SCANS})"
    scans.append(f"SELECT * FROM ({_first(t, rest)})")
    return (
        f"SELECT u.* FROM ({' UNION ALL '.join(scans)}) u "
        "ORDER BY u.priority DESC, u.available_at_ms, u.id LIMIT :limit"
    )


def _picked(t: Tables, *, single_queue: bool) -> str:
    """The candidates, then, per gate, only as many as it has free places (``rk``: rank
    within the gate)."""
    ranked = (
        "SELECT p.*, row_number() OVER (PARTITION BY p.gate, p.exh "
        "ORDER BY p.priority DESC, p.available_at_ms, p.id) AS rk, "
        "row_number() OVER (PARTITION BY p.rate, p.exh "
        f"ORDER BY p.priority DESC, p.available_at_ms, p.id) AS rrk "
        f"FROM ({_candidates(t, single_queue=single_queue)}) p"
    )
    return (
        f"SELECT y.id AS cid, y.gate AS cgate, y.rate AS crate FROM ({ranked}) y "
        f"WHERE y.exh OR ((y.gate IS NULL OR y.rk <= y.lim - {_running(t, 'y.gate')}) "
        f"AND (y.rate IS NULL OR y.rrk <= {c.rate_allowed(NOW, 'y.', GREATEST)}))"
    )


def claim(t: Tables, *, single_queue: bool) -> TextClause:
    """Lease up to ``:limit`` messages of ``:queue`` (``single_queue``) or ``:queues`` to
    ``:owner``: the UPDATE picks and leases in one statement; an exhausted message goes dead
    instead."""
    m, x = t.messages.name, _EXHAUSTED
    return text(
        f"UPDATE {m} AS m SET "
        f"lease_owner = CASE WHEN {x} THEN NULL ELSE :owner END, "
        f"lease_expires_at_ms = CASE WHEN {x} THEN NULL "
        f"ELSE {NOW} + :lease_ms END, "
        f"state = CASE WHEN {x} THEN 'dead' ELSE 'ready' END, "
        f"reason = CASE WHEN {x} THEN 'attempts_exhausted' ELSE NULLIF(reason, 'rate') END, "
        f"gate = CASE WHEN {x} THEN gate ELSE y.cgate END, "
        f"rate_gate = CASE WHEN {x} THEN rate_gate ELSE y.crate END, "
        f"attempt = CASE WHEN {x} THEN attempt ELSE attempt + 1 END "
        f"FROM ({_picked(t, single_queue=single_queue)}) AS y WHERE m.id = y.cid "
        f"{c.returning(ROW_PREFIX)}, rate_gate"
    )


def rate_take(t: Tables) -> TextClause:
    """After a claim, in its transaction: each rate limit's theoretical arrival time moves on
    by the deliveries it let through (one executemany per claim that had any)."""
    return text(
        f"UPDATE {t.flow_limits.name} SET tat_ms = "
        f"{GREATEST}(COALESCE(tat_ms, 0), {NOW}) + :n * interval_ms WHERE name = :name"
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
        "RETURNING id, task_id, attempt, run_id, gate"
    )


def transition(t: Tables) -> TextClause:
    """Release, park or fail fenced deliveries."""
    return text(
        f"UPDATE {t.messages.name} AS m SET {c.transition_set(NOW)} "
        f"WHERE m.id IN ({_fenced_ids(t)}) RETURNING id, task_id, attempt, run_id, gate"
    )
