"""PostgreSQL: claim, renew, ack and transition, each one statement that also writes the run
locks and the events (data-modifying CTEs)."""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db import sql_common as c
from sqlease._db import task_rows
from sqlease._db.postgresql.dialect import (
    FENCES,
    GREATEST,
    JSON_OWNER,
    NOW,
    ROW_PREFIX,
    batch_event,
    each_queue,
)
from sqlease._db.tables import Tables


def _candidates(t: Tables, queue: str) -> str:
    """The claimable rows of ``queue`` (a predicate on ``m.queue``), locked with SKIP LOCKED
    so claimers do not convoy on the head row."""
    return (
        "SELECT m.id, m.run_id, m.attempt, (m.attempt >= m.max_attempts) AS exhausted, "
        f"m.priority, m.available_at_ms FROM {t.messages.name} m "
        f"WHERE {c.ready(t, NOW, queue)} AND (m.run_id IS NULL OR {c.run_free(t, NOW)}) "
        f"{c.ORDER} LIMIT :limit FOR UPDATE OF m SKIP LOCKED"
    )


def _cand(t: Tables, *, single_queue: bool) -> str:
    """Several queues: the first ``:limit`` of each queue, read in index order (a queue
    equality per queue), then the best ``:limit`` of those. A single scan with
    ``queue = ANY(...)`` sorted every ready row of the queues: 40 ms per claim at 20,000
    queued, 170-250 ms at 100,000. Rows locked here and not kept are released at the
    statement's commit; meanwhile other claimers skip them."""
    if single_queue:
        return f"SELECT * FROM ({_candidates(t, c.QUEUE_EQ)}) c"
    return (
        f"SELECT x.* FROM {each_queue(_candidates(t, 'm.queue = qn.name'))} "
        "ORDER BY x.priority DESC, x.available_at_ms, x.id LIMIT :limit"
    )


def _claim_ctes(t: Tables, *, single_queue: bool) -> str:
    """The per-run upsert takes the run's row lock (it waits, then re-checks the run's lease
    on the newest row version), so two claimers can never both lease messages of one run; the
    UPDATE re-checks the lease predicate (READ COMMITTED). An exhausted message goes dead
    instead, with its event; the deliveries' ``claimed`` event is one batch row listing
    them."""
    claimed_batch = batch_event(t, "claimed", JSON_OWNER, "claimed", "m.state = 'ready'")
    return (
        f"cand AS ({_cand(t, single_queue=single_queue)}), "
        "run_locks AS ("
        f"INSERT INTO {t.runs.name} AS r (run_id, message_id, attempt, lease_owner, "
        "lease_expires_at_ms) "
        f"SELECT c.run_id, c.id, c.attempt + 1, CAST(:owner AS TEXT), {NOW} + :lease_ms "
        "FROM cand c "
        "WHERE c.run_id IS NOT NULL AND NOT c.exhausted "
        "ON CONFLICT (run_id) DO UPDATE SET message_id = excluded.message_id, "
        "attempt = excluded.attempt, lease_owner = excluded.lease_owner, "
        "lease_expires_at_ms = excluded.lease_expires_at_ms "
        f"WHERE r.lease_expires_at_ms <= {NOW} OR r.message_id = excluded.message_id "
        "RETURNING r.run_id), "
        f"claimed AS (UPDATE {t.messages.name} m SET "
        "attempt = CASE WHEN c.exhausted THEN m.attempt ELSE m.attempt + 1 END, "
        "lease_owner = CASE WHEN c.exhausted THEN NULL ELSE CAST(:owner AS TEXT) END, "
        f"lease_expires_at_ms = CASE WHEN c.exhausted THEN NULL ELSE {NOW} + :lease_ms "
        "END, "
        "state = CASE WHEN c.exhausted THEN 'dead' ELSE 'ready' END, "
        "reason = CASE WHEN c.exhausted THEN 'attempts_exhausted' ELSE m.reason END "
        "FROM cand c WHERE m.id = c.id AND m.state = 'ready' "
        f"AND (m.lease_expires_at_ms IS NULL OR m.lease_expires_at_ms <= {NOW}) "
        "AND (c.exhausted OR c.run_id IS NULL "
        "OR c.run_id IN (SELECT run_id FROM run_locks)) "
        f"{c.returning(ROW_PREFIX)}), "
        f"e AS (INSERT INTO {t.events.name} (task_id, message_id, attempt, kind, data, at_ms) "
        f"SELECT m.task_id, m.id, m.attempt, 'attempts_exhausted', NULL, {NOW} "
        "FROM claimed m WHERE m.state = 'dead'), "
        f"eb AS ({claimed_batch}), "
        f"{task_rows.claim_cte(t)}"  # the task rows' attempts (migration 9)
    )


def claim(t: Tables, *, single_queue: bool) -> TextClause:
    """Lease up to ``:limit`` messages of ``:queue`` (``single_queue``) or ``:queues`` to
    ``:owner``, in one statement."""
    return text(f"WITH {_claim_ctes(t, single_queue=single_queue)} SELECT * FROM claimed")


def ack_ctes(t: Tables) -> str:
    """The fenced delete of ``:owner``'s acks (CTE ``del``), their run locks and their batch
    event."""
    return (
        f"f AS ({FENCES}), "
        f"del AS (DELETE FROM {t.messages.name} m USING f WHERE {c.fenced_join(NOW)} "
        "RETURNING m.id, m.task_id, m.attempt, m.run_id), "
        f"r AS (DELETE FROM {t.runs.name} r USING del WHERE r.run_id = del.run_id "
        "AND r.message_id = del.id), "
        f"ea AS ({batch_event(t, 'acked', 'NULL', 'del', 'true')})"
    )


def ack(t: Tables) -> TextClause:
    return text(f"WITH {ack_ctes(t)} SELECT id FROM del")


def ack_claim(t: Tables, *, single_queue: bool) -> TextClause:
    """A busy worker's acks and its refill claim in one statement: one round trip and one
    commit instead of two. Every claimed row comes back with the ids the acks removed (one row
    of NULLs and those ids when nothing was claimed). The claim does not see the acks'
    effects (one snapshot): a run's next message waits for the next claim, and the acked rows
    are leased, so the claim never takes them."""
    return text(
        f"WITH {ack_ctes(t)}, {_claim_ctes(t, single_queue=single_queue)} "
        "SELECT c.*, (SELECT array_agg(id) FROM del) AS acked_ids "
        "FROM (SELECT 1) one LEFT JOIN claimed c ON true"
    )


def renew(t: Tables) -> TextClause:
    """The new expiry is max(old, now + lease): based on now, never on the old expiry, and
    never shortened. An expired lease is not renewed. The run locks follow."""
    return text(
        f"WITH f AS ({FENCES}), "
        f"up AS (UPDATE {t.messages.name} m SET lease_expires_at_ms = "
        f"{GREATEST}(m.lease_expires_at_ms, {NOW} + :lease_ms) FROM f "
        f"WHERE {c.fenced_join(NOW)} RETURNING m.id, m.run_id, m.lease_expires_at_ms), "
        f"r AS (UPDATE {t.runs.name} r SET lease_expires_at_ms = up.lease_expires_at_ms "
        "FROM up WHERE r.run_id = up.run_id AND r.message_id = up.id) "
        "SELECT id, lease_expires_at_ms FROM up"
    )


def transition(t: Tables) -> TextClause:
    """Release, park or fail fenced deliveries, with their run locks and events. A message
    released to be claimed now (warm shutdown, a requeue) wakes the idle workers of its queue
    at commit, as a publish does."""
    return text(
        f"WITH f AS ({FENCES}), "
        f"up AS (UPDATE {t.messages.name} m SET {c.transition_set(NOW)} FROM f "
        f"WHERE {c.fenced_join(NOW)} "
        "RETURNING m.id, m.task_id, m.attempt, m.run_id, m.queue), "
        f"r AS (DELETE FROM {t.runs.name} r USING up WHERE r.run_id = up.run_id "
        "AND r.message_id = up.id), "
        f"e AS (INSERT INTO {t.events.name} (task_id, message_id, attempt, kind, data, at_ms) "
        f"SELECT task_id, id, attempt, CAST(:kind AS TEXT), CAST(:data AS TEXT), {NOW} "
        "FROM up), "
        "n AS (SELECT pg_notify(CAST(:channel AS TEXT), q.queue) FROM "
        "(SELECT DISTINCT queue FROM up WHERE CAST(:new_state AS TEXT) = 'ready' "
        "AND :delay_ms <= 0) q) "
        "SELECT id FROM up WHERE (SELECT count(*) FROM n) >= 0"
    )
