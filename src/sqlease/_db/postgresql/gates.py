"""PostgreSQL: the messages parked at a full gate (reason ``gate``), parked by a worker's
sweep and made ready again by the statement that follows whatever freed a place of the gate.

A claim steps over every ready message of a full gate at the front of its queue; with
thousands of them each claim paid for all of them. The sweep (``park``) moves the ones at
the front of a queue out of the claim index, keeping their ids, priorities and due times, so
they come back in their order.

No promotion is lost between a sweep and a statement that frees a place, though each runs in
a snapshot that may miss the other:

- the sweep locks the rows it parks (SKIP LOCKED, as a claim does) and then the gate's live
  slots (FOR SHARE), and parks only where the slots it holds still fill the gate: a slot
  deleted by a commit after its snapshot is not among them;
- an ack, a failure or a release deletes the slot, which waits for the sweep's share lock:
  it commits after the sweep, and names the gate in its answer (``owed_gates``), so that its
  caller promotes in a statement of its own (``promote``), whose snapshot sees what the
  sweep parked.

A gate's place also frees when a lease expires; the expired message is ready again and a
claim takes it (a place for a place), or, if its attempts are spent, goes dead and its
gate is promoted by the claim's caller. The maintenance pass promotes any gate that has
room and messages parked (none, unless a process died between an ack and its promotion).
The claim's own checks remain the final word: a message promoted too many is stepped over
and parked again by the next sweep.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db import sql_common as c
from sqlease._db.postgresql.dialect import NOW, one_of_ids
from sqlease._db.tables import Tables

#: A sweep looks at this many of a queue's first ready messages.
SCAN = 2000


def _live_slots(t: Tables) -> str:
    return f"FROM {t.slots.name} s WHERE s.lease_expires_at_ms > {NOW}"


def park(t: Tables) -> TextClause:
    """Park the first ``:scan`` ready messages of ``:queue`` whose gate is full; the ids."""
    m = t.messages.name
    first = (
        f"SELECT y.id, y.state, y.gate FROM {c.ready_priorities(t, ':queue')} pp "
        "CROSS JOIN LATERAL "
        f"(SELECT m.id, m.state, {c.GATE} AS gate, m.priority, m.available_at_ms FROM {m} m "
        f"{c.gate_joins(t)} WHERE m.state = 'ready' AND m.queue = :queue "
        f"AND m.priority = pp.pr AND m.available_at_ms <= {NOW} "
        f"AND (m.lease_expires_at_ms IS NULL OR m.lease_expires_at_ms <= {NOW}) "
        "ORDER BY m.available_at_ms, m.id LIMIT :scan) y "
        # No gate full, no scan: a worker sweeps every second, whatever its queues hold.
        "WHERE EXISTS (SELECT 1 FROM full_gates) "
        "ORDER BY y.priority DESC, y.available_at_ms, y.id LIMIT :scan"
    )
    return text(
        f"WITH full_gates AS MATERIALIZED (SELECT s.gate {_live_slots(t)} GROUP BY s.gate "
        "HAVING count(*) >= min(s.lim)), "
        f"front AS ({first}), "
        "held AS MATERIALIZED (SELECT f.id, f.state, f.gate FROM front f "
        "WHERE f.gate IN (SELECT gate FROM full_gates)), "
        # The rows first (a claim's order of locks: messages, then slots), then the slots.
        f"mine AS MATERIALIZED (SELECT m.id FROM {m} m JOIN held h ON h.id = m.id "
        f"WHERE {one_of_ids('m.id', 'SELECT id FROM held')} "
        f"AND m.state = h.state AND (m.lease_expires_at_ms IS NULL "
        f"OR m.lease_expires_at_ms <= {NOW}) FOR UPDATE OF m SKIP LOCKED), "
        f"locked AS (SELECT s.gate, s.lim {_live_slots(t)} AND s.gate IN "
        "(SELECT DISTINCT h.gate FROM held h JOIN mine USING (id)) "
        "ORDER BY s.gate, s.slot FOR SHARE OF s), "
        "still AS (SELECT gate FROM locked GROUP BY gate HAVING count(*) >= min(lim)), "
        # Parked without the lease that ran out on it: no row but a ready one holds a lease.
        f"pk AS (UPDATE {m} m SET state = 'parked', reason = 'gate', gate = h.gate, "
        "lease_owner = NULL, lease_expires_at_ms = NULL "
        f"FROM held h WHERE m.id = h.id AND {one_of_ids('m.id', 'SELECT id FROM mine')} "
        "AND h.gate IN (SELECT gate FROM still) RETURNING m.id) "
        "SELECT id FROM pk"
    )


def release_rates(t: Tables) -> TextClause:
    """The messages a sweep gave a due time for the rates ``:rates``, due now again (a rate
    changed or removed: the next sweep gives them the new rate's times)."""
    m = t.messages.name
    return text(
        f"UPDATE {m} m SET available_at_ms = LEAST(m.available_at_ms, {NOW}), reason = NULL "
        "WHERE m.state = 'ready' AND m.reason = 'rate' "
        "AND m.rate_gate = ANY(CAST(:rates AS TEXT[])) RETURNING m.id"
    )


def gates_of(t: Tables) -> TextClause:
    """The gates the messages ``:ids`` (a JSON array) hold or held a place of: their slots
    (a slot stays with its message until another claim takes it)."""
    return text(
        f"SELECT DISTINCT s.gate FROM {t.slots.name} s WHERE s.message_id IN "
        "(SELECT CAST(jsonb_array_elements_text(CAST(:ids AS JSONB)) AS BIGINT))"
    )


def promote(t: Tables) -> TextClause:
    """Of each gate of ``:gates``, as many parked messages made ready as it has room for
    (its limit, less its live slots and its ready messages not yet claimed), best first;
    all of a task's or queue's gate whose limit is gone. Their queues are notified."""
    m, fl = t.messages.name, t.flow_limits.name
    lim = (
        "CASE WHEN u.g LIKE 'key:%' THEN (SELECT p.gate_limit FROM "
        f"{m} p WHERE p.state = 'parked' AND p.reason = 'gate' AND p.gate = u.g "
        "ORDER BY p.priority DESC, p.available_at_ms, p.id LIMIT 1) "
        f"ELSE (SELECT l.concurrency FROM {fl} l WHERE l.name = u.g) END"
    )
    waiting = (
        f"(SELECT count(*) FROM {m} r WHERE r.gate = k.gate AND r.state = 'ready' "
        f"AND r.available_at_ms <= {NOW} "
        f"AND (r.lease_expires_at_ms IS NULL OR r.lease_expires_at_ms <= {NOW}))"
    )
    return text(
        "WITH u AS (SELECT DISTINCT g FROM unnest(CAST(:gates AS TEXT[])) AS u(g)), "
        f"k AS (SELECT u.g AS gate, {lim} AS lim FROM u), "
        "room AS MATERIALIZED (SELECT k.gate, CASE WHEN k.lim IS NULL THEN NULL "
        "ELSE GREATEST(0, k.lim - "
        f"(SELECT count(*) {_live_slots(t)} AND s.gate = k.gate) - {waiting}) END AS n "
        "FROM k), "
        "pick AS MATERIALIZED (SELECT x.* FROM room CROSS JOIN LATERAL (SELECT p.id, p.state, "
        f"p.reason FROM {m} p WHERE p.state = 'parked' AND p.reason = 'gate' "
        "AND p.gate = room.gate ORDER BY p.priority DESC, p.available_at_ms, p.id "
        "LIMIT room.n) x), "
        # The picked rows by id, their state re-checked against the pick's own, not against
        # constants that would match the parked index and scan all of it (as the claim's
        # UPDATE does, sqlease._db.postgresql.leases).
        f"up AS (UPDATE {m} p SET state = 'ready', reason = NULL FROM pick "
        f"WHERE p.id = pick.id AND {one_of_ids('p.id', 'SELECT id FROM pick')} "
        "AND p.state = pick.state AND p.reason = pick.reason "
        "RETURNING p.id, p.queue), "
        "n AS (SELECT pg_notify(CAST(:channel AS TEXT), q.queue) "
        "FROM (SELECT DISTINCT queue FROM up) q) "
        "SELECT id FROM up WHERE (SELECT count(*) FROM n) >= 0"
    )


def project_rates(t: Tables) -> TextClause:
    """Of the first ``:scan`` ready messages of ``:queue``, each held by a rate limit gets the
    time its rate will let it through (the GCRA's next openings, one interval apart, in
    delivery order) as its due time, with reason ``rate``, when that is more than
    ``:horizon`` ms away: a claim reads only due messages, so it no longer steps over them,
    and a worker wakes for them as for a countdown. The ids."""
    m = t.messages.name
    first = (
        f"SELECT y.* FROM {c.ready_priorities(t, ':queue')} pp CROSS JOIN LATERAL "
        f"(SELECT m.id, m.state, m.priority, m.available_at_ms, {c.RATE} AS rate, "
        f"{c.RATE_INTERVAL} AS ivl, {c.RATE_TAU} AS tau, {c.RATE_TAT} AS tat FROM {m} m "
        f"{c.gate_joins(t)} WHERE m.state = 'ready' AND m.queue = :queue "
        f"AND m.priority = pp.pr AND m.available_at_ms <= {NOW} "
        f"AND (m.lease_expires_at_ms IS NULL OR m.lease_expires_at_ms <= {NOW}) "
        "ORDER BY m.available_at_ms, m.id LIMIT :scan) y "
        # No rate limit anywhere, no scan.
        f"WHERE EXISTS (SELECT 1 FROM {t.flow_limits.name} r WHERE r.interval_ms IS NOT NULL) "
        "ORDER BY y.priority DESC, y.available_at_ms, y.id LIMIT :scan"
    )
    return text(
        f"WITH front AS MATERIALIZED ({first}), "
        # Behind the ones a sweep gave a due time before (their last, by the index of them).
        "last AS MATERIALIZED (SELECT r.rate, (SELECT max(w.available_at_ms) FROM "
        f"{m} w WHERE w.state = 'ready' AND w.reason = 'rate' AND w.rate_gate = r.rate) AS due "
        "FROM (SELECT DISTINCT rate FROM front WHERE rate IS NOT NULL) r), "
        # Each one's turn as the rate's arrival times go, from its next opening on.
        f"turns AS MATERIALIZED (SELECT f.id, f.state, f.rate, f.ivl, "
        f"GREATEST(COALESCE(f.tat, 0), "
        f"{NOW}) - f.tau + (row_number() OVER (PARTITION BY f.rate ORDER BY f.priority DESC, "
        "f.available_at_ms, f.id) - 1) * f.ivl AS turn FROM front f WHERE f.rate IS NOT NULL), "
        # Those beyond the horizon, behind the turns given before (a sweep's earlier ones).
        "later AS MATERIALIZED (SELECT x.id, x.state, x.rate, GREATEST(x.turn, COALESCE(l.due + "
        "row_number() OVER (PARTITION BY x.rate ORDER BY x.turn) * x.ivl, 0)) AS due "
        f"FROM turns x JOIN last l ON l.rate = x.rate WHERE x.turn > {NOW} + :horizon), "
        f"pk AS (UPDATE {m} m SET available_at_ms = GREATEST(m.available_at_ms, l.due), "
        "reason = 'rate', rate_gate = l.rate FROM later l WHERE m.id = l.id "
        f"AND {one_of_ids('m.id', 'SELECT id FROM later')} AND m.state = l.state "
        f"AND (m.lease_expires_at_ms IS NULL OR m.lease_expires_at_ms <= {NOW}) "
        "RETURNING m.id) "
        "SELECT id FROM pk"
    )


#: A sweep gives up on a lock rather than make a claim or an ack wait for it.
LOCK_TIMEOUT = "SET LOCAL lock_timeout = '200ms'"
