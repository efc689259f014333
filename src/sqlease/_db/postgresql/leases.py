"""PostgreSQL: claim, renew, ack and transition, each one statement that also writes the run
locks and the events (data-modifying CTEs)."""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db import sql_common as c
from sqlease._db.postgresql.dialect import (
    FENCES,
    GREATEST,
    JSON_CLAIM,
    NOW,
    ROW_PREFIX,
    batch_event,
    each_queue,
    one_of_ids,
)
from sqlease._db.postgresql.held import NOTIFIED, OWED, promote_ctes
from sqlease._db.tables import Tables


def _full_gates(t: Tables) -> str:
    """CTE ``full_gates``: the gates whose live slots reach the limit they were taken under, read
    once per claim (a scan of the live slots, as many as gated deliveries are running) so that
    each candidate row's test is a hash lookup."""
    return (
        f"full_gates AS (SELECT s.gate FROM {t.slots.name} s WHERE s.lease_expires_at_ms > {NOW} "
        "GROUP BY s.gate HAVING count(*) >= min(s.lim)), "
    )


def _candidates(t: Tables, queue: str) -> str:
    """The claimable rows of ``queue`` (a predicate on ``m.queue``), locked with SKIP LOCKED
    so claimers do not convoy on the head row; each with its gate and limit, a full gate's
    rows skipped (``full_gates``: the slots' own limit decides; a candidate whose limit is higher
    waits until the gate drains below it, one whose limit is lower finds no free slot)."""
    return (
        "SELECT m.id, m.state, m.run_id, m.attempt, (m.attempt >= m.max_attempts) AS exhausted, "
        "m.priority, m.available_at_ms, g.gate, g.lim, g.rate, g.ivl, g.tau, g.tat "
        f"FROM {t.messages.name} m {c.gate_joins(t)} "
        f"CROSS JOIN LATERAL (SELECT {c.GATE} AS gate, {c.GATE_LIMIT} AS lim, "
        f"{c.RATE} AS rate, {c.RATE_INTERVAL} AS ivl, {c.RATE_TAU} AS tau, "
        f"{c.RATE_TAT} AS tat) g "
        f"WHERE {c.ready(t, NOW, queue)} AND (m.run_id IS NULL OR {c.run_free(t, NOW)}) "
        "AND (g.gate IS NULL OR g.gate NOT IN (SELECT gate FROM full_gates)) "
        f"AND {c.rate_open(NOW)} "
        f"{c.ORDER} LIMIT :limit FOR UPDATE OF m SKIP LOCKED"
    )


#: The candidates that passed their rate limit (or have none) and may take their locks.
RATE_PASSED = "(c.rate IS NULL OR c.id IN (SELECT id FROM rate_ok))"


def _rate_takes(t: Tables) -> str:
    """CTEs ``rated``, ``rate_take`` and ``rate_ok``: per rate limit, as many candidates as
    it lets through now, taken by advancing its theoretical arrival time. The UPDATE waits for
    a concurrent claimer's row lock and then re-checks, on the newest row version, that the k
    deliveries still fit, so two claimers never spend the same allowance; a lost race spends
    nothing and leaves the candidates for the next claim."""
    fl = t.flow_limits.name
    allowed = c.rate_allowed(NOW, "c.", GREATEST)
    return (
        "rated AS (SELECT c.id, c.rate, row_number() OVER (PARTITION BY c.rate "
        "ORDER BY c.priority DESC, c.available_at_ms, c.id) AS rk FROM cand c "
        "WHERE c.rate IS NOT NULL AND NOT c.exhausted), "
        f"rate_take AS (UPDATE {fl} r SET tat_ms = {GREATEST}(COALESCE(r.tat_ms, 0), {NOW}) "
        "+ x.k * r.interval_ms "
        f"FROM (SELECT c.rate, LEAST(count(*), min({allowed})) AS k FROM cand c "
        "WHERE c.rate IS NOT NULL AND NOT c.exhausted GROUP BY c.rate) x "
        "WHERE r.name = x.rate AND x.k > 0 AND r.interval_ms IS NOT NULL "
        f"AND {GREATEST}(COALESCE(r.tat_ms, 0), {NOW}) + (x.k - 1) * r.interval_ms "
        f"- r.tau_ms <= {NOW} RETURNING r.name, x.k), "
        "rate_ok AS (SELECT rd.id FROM rated rd JOIN rate_take k ON k.name = rd.rate "
        "AND rd.rk <= k.k), "
    )


def _gate_slots(t: Tables) -> str:
    """CTEs ``ranked``, ``free`` and ``paired``: each gated candidate is matched, by rank,
    with a free slot of its gate as the snapshot shows them. The search for free slots starts
    at a random one and stops at as many as are wanted, so a large limit costs a few probes
    and concurrent claimers rarely aim at the same slot. Only paired candidates take their
    run's lock, so a message of a run that finds no slot leaves its run alone."""
    sl = t.slots.name
    return (
        "ranked AS (SELECT c.id, c.attempt, c.gate, c.lim, c.run_id, row_number() OVER "
        "(PARTITION BY c.gate ORDER BY c.priority DESC, c.available_at_ms, c.id) AS rk "
        f"FROM cand c WHERE c.gate IS NOT NULL AND NOT c.exhausted AND {RATE_PASSED}), "
        "free AS (SELECT k.gate, s.slot, row_number() OVER (PARTITION BY k.gate) AS rk "
        "FROM (SELECT gate, min(lim) AS lim, count(*) AS wanted, "
        "CAST(floor(random() * min(lim)) AS INTEGER) AS start FROM ranked GROUP BY gate) k "
        "CROSS JOIN LATERAL (SELECT mod(k.start + i, k.lim) AS slot "
        "FROM generate_series(0, k.lim - 1) AS g(i) "
        f"WHERE NOT EXISTS (SELECT 1 FROM {sl} x WHERE x.gate = k.gate "
        f"AND x.slot = mod(k.start + i, k.lim) AND x.lease_expires_at_ms > {NOW}) "
        "LIMIT k.wanted) s), "
        "paired AS (SELECT r.*, f.slot FROM ranked r "
        "JOIN free f ON f.gate = r.gate AND f.rk = r.rk), "
    )


def _gate_locks(t: Tables) -> str:
    """CTE ``gate_locks``: each paired candidate that got its run's lock (or has no run)
    takes its slot with an upsert that waits for a concurrent claimer's row lock and then
    re-checks the slot's expiry on the newest row version, so two claimers never hold one
    slot. The snapshot's free slots may be stale: a lost race only leaves that candidate for
    the next claim."""
    sl = t.slots.name
    return (
        f"gate_locks AS (INSERT INTO {sl} AS x (gate, slot, lim, message_id, attempt, "
        "lease_owner, lease_expires_at_ms) "
        "SELECT p.gate, p.slot, p.lim, p.id, p.attempt + 1, CAST(:owner AS TEXT), "
        f"{NOW} + :lease_ms FROM paired p "
        "WHERE p.run_id IS NULL OR p.run_id IN (SELECT run_id FROM run_locks) "
        "ON CONFLICT (gate, slot) DO UPDATE SET lim = excluded.lim, "
        "message_id = excluded.message_id, "
        "attempt = excluded.attempt, lease_owner = excluded.lease_owner, "
        "lease_expires_at_ms = excluded.lease_expires_at_ms "
        f"WHERE x.lease_expires_at_ms <= {NOW} OR x.message_id = excluded.message_id "
        "RETURNING x.message_id), "
    )


def _priorities(t: Tables, queue: str) -> str:
    """The distinct priorities of the ready rows of ``queue`` (an expression: ``:queue`` or
    ``qn.name``), highest first, as rows ``pp(pr)``: a skip scan of the claim index, one probe
    per priority."""
    return f"{c.ready_priorities(t, queue)} pp"


def _cand(t: Tables, *, single_queue: bool) -> str:
    """The first ``:limit`` claimable rows of each queue and priority, read in index order
    (a queue and a priority equality each), then the best ``:limit`` of those. With the
    priority fixed, the scan ends at the first row not yet due; over all priorities it read
    every delayed row of the queue whenever fewer than ``:limit`` were due (10.8 ms per claim
    with 100,000 delayed messages, against 0.7 ms). A single scan with ``queue = ANY(...)``
    sorted every ready row of the queues: 40 ms per claim at 20,000 queued, 170-250 ms at
    100,000. Rows locked here and not kept are released at the statement's commit;
    meanwhile other claimers skip them."""
    if single_queue:
        source = (
            f"{_priorities(t, ':queue')} CROSS JOIN LATERAL "
            f"({_candidates(t, 'm.queue = :queue AND m.priority = pp.pr')}) x"
        )
    else:
        source = each_queue(
            f"SELECT y.* FROM {_priorities(t, 'qn.name')} CROSS JOIN LATERAL "
            f"({_candidates(t, 'm.queue = qn.name AND m.priority = pp.pr')}) y"
        )
    return (
        f"SELECT x.* FROM {source} ORDER BY x.priority DESC, x.available_at_ms, x.id LIMIT :limit"
    )


def _claim_ctes(t: Tables, *, single_queue: bool) -> str:
    """The per-run upsert takes the run's row lock (it waits, then re-checks the run's lease
    on the newest row version), so two claimers can never both lease messages of one run; the
    UPDATE re-checks the lease predicate (READ COMMITTED). An exhausted message goes dead
    instead, with its event; the deliveries' ``claimed`` event is one batch row listing
    them.

    The UPDATE finds its rows by their ids (``one_of_ids``) besides the join, so that no
    generic plan reads the whole backlog to find them. The state is re-checked against the
    candidate's own (``'ready'``), not against a constant: ``m.state = 'ready'`` is the claim
    index's predicate, and on a table without statistics the planner ANDed the whole claim
    index into the id lookup (3.6 ms per claim at 100,000 messages)."""
    return (
        f"{_full_gates(t)}"
        f"cand AS ({_cand(t, single_queue=single_queue)}), "
        f"{_rate_takes(t)}"
        f"{_gate_slots(t)}"
        "run_locks AS ("
        f"INSERT INTO {t.runs.name} AS r (run_id, message_id, attempt, lease_owner, "
        "lease_expires_at_ms) "
        f"SELECT c.run_id, c.id, c.attempt + 1, CAST(:owner AS TEXT), {NOW} + :lease_ms "
        "FROM cand c "
        f"WHERE c.run_id IS NOT NULL AND NOT c.exhausted AND {RATE_PASSED} "
        "AND (c.gate IS NULL OR c.id IN (SELECT id FROM paired)) "
        "ON CONFLICT (run_id) DO UPDATE SET message_id = excluded.message_id, "
        "attempt = excluded.attempt, lease_owner = excluded.lease_owner, "
        "lease_expires_at_ms = excluded.lease_expires_at_ms "
        f"WHERE r.lease_expires_at_ms <= {NOW} OR r.message_id = excluded.message_id "
        "RETURNING r.run_id), "
        f"{_gate_locks(t)}"
        + claimed_ctes(
            t,
            gate="c.gate",
            rate="c.rate",
            passes=f"(c.exhausted OR ({RATE_PASSED} AND (c.run_id IS NULL "
            "OR c.run_id IN (SELECT run_id FROM run_locks)) AND (c.gate IS NULL "
            "OR c.id IN (SELECT message_id FROM gate_locks))))",
        )
    )


def claimed_ctes(t: Tables, *, gate: str, rate: str, passes: str) -> str:
    """CTEs ``claimed`` (the candidates ``cand`` as ``c`` that ``passes``, a predicate,
    leased to ``:owner``, or dead when exhausted; a leased row's ``gate`` and ``rate_gate``
    become ``gate`` and ``rate``), ``e`` and ``eb`` (their events: the deliveries' ``claimed``
    is one batch row listing them). The task rows are left alone (``sqlease._db.task_rows``)."""
    claimed_batch = batch_event(t, "claimed", JSON_CLAIM, "claimed", "m.state = 'ready'")
    return (
        f"claimed AS (UPDATE {t.messages.name} m SET "
        "attempt = CASE WHEN c.exhausted THEN m.attempt ELSE m.attempt + 1 END, "
        "lease_owner = CASE WHEN c.exhausted THEN NULL ELSE CAST(:owner AS TEXT) END, "
        f"lease_expires_at_ms = CASE WHEN c.exhausted THEN NULL ELSE {NOW} + :lease_ms "
        "END, "
        "state = CASE WHEN c.exhausted THEN 'dead' ELSE 'ready' END, "
        "reason = CASE WHEN c.exhausted THEN 'attempts_exhausted' "
        "ELSE NULLIF(m.reason, 'rate') END, "
        f"gate = CASE WHEN c.exhausted THEN m.gate ELSE {gate} END, "
        f"rate_gate = CASE WHEN c.exhausted THEN m.rate_gate ELSE {rate} END "
        f"FROM cand c WHERE m.id = c.id AND {one_of_ids('m.id', 'SELECT id FROM cand')} "
        "AND m.state = c.state "
        f"AND (m.lease_expires_at_ms IS NULL OR m.lease_expires_at_ms <= {NOW}) "
        f"AND {passes} "
        f"{c.returning(ROW_PREFIX)}), "
        f"e AS (INSERT INTO {t.events.name} (task_id, message_id, attempt, kind, data, at_ms) "
        f"SELECT m.task_id, m.id, m.attempt, 'attempts_exhausted', NULL, {NOW} "
        "FROM claimed m WHERE m.state = 'dead'), "
        f"eb AS ({claimed_batch})"
    )


def claim(t: Tables, *, single_queue: bool) -> TextClause:
    """Lease up to ``:limit`` messages of ``:queue`` (``single_queue``) or ``:queues`` to
    ``:owner``, in one statement."""
    return text(f"WITH {_claim_ctes(t, single_queue=single_queue)} SELECT * FROM claimed")


def ack_ctes(t: Tables) -> str:
    """The fenced delete of ``:owner``'s acks (CTE ``del``), their run locks, their batch
    event, and their runs' next messages made ready (``promote_ctes``: the final SELECT reads
    ``NOTIFIED`` and ``OWED``)."""
    return (
        f"f AS ({FENCES}), "
        f"del AS (DELETE FROM {t.messages.name} m USING f WHERE {c.fenced_join(NOW)} "
        "RETURNING m.id, m.task_id, m.attempt, m.run_id), "
        f"r AS (DELETE FROM {t.runs.name} r USING del WHERE r.run_id = del.run_id "
        "AND r.message_id = del.id), "
        f"ds AS (DELETE FROM {t.slots.name} x USING del WHERE x.message_id = del.id "
        "RETURNING x.gate), "
        f"ea AS ({batch_event(t, 'acked', 'NULL', 'del', 'true')}), "
        f"{promote_ctes(t, 'del', 'true')}"
    )


def ack(t: Tables) -> TextClause:
    """One row per acked id (a NULL id when none was), each with the owed runs."""
    return text(
        f"WITH {ack_ctes(t)} SELECT d.id, {OWED} FROM (SELECT 1) one "
        f"LEFT JOIN del d ON true WHERE {NOTIFIED}"
    )


def ack_claim(t: Tables, *, single_queue: bool) -> TextClause:
    """A busy worker's acks and its refill claim in one statement: one round trip and one
    commit instead of two. Every claimed row comes back with the ids the acks removed (one row
    of NULLs and those ids when nothing was claimed). The claim does not see the acks'
    effects (one snapshot): a run's next message waits for the next claim, and the acked rows
    are leased, so the claim never takes them."""
    return text(
        f"WITH {ack_ctes(t)}, {_claim_ctes(t, single_queue=single_queue)} "
        f"SELECT c.*, (SELECT array_agg(id) FROM del) AS acked_ids, {OWED} "
        f"FROM (SELECT 1) one LEFT JOIN claimed c ON true WHERE {NOTIFIED}"
    )


def ack_outside_runs_ctes(t: Tables) -> str:
    """The fenced delete of ``:owner``'s acks (CTE ``del``), the gate places they held
    (``ds``) and their batch event: ``ack_ctes`` without what only a message of a run
    needs (its run lock, its run's next message made ready), for acks the caller knows are
    of messages outside any run. A message's run is fixed when it is published. Its place at
    a gate is not (a limit set while it waited): those are deleted, and the gates named."""
    return (
        f"f AS ({FENCES}), "
        f"del AS (DELETE FROM {t.messages.name} m USING f WHERE {c.fenced_join(NOW)} "
        "RETURNING m.id, m.task_id, m.attempt), "
        f"ds AS (DELETE FROM {t.slots.name} x USING del WHERE x.message_id = del.id "
        "RETURNING x.gate), "
        f"ea AS ({batch_event(t, 'acked', 'NULL', 'del', 'true')})"
    )


#: The answer's columns of an ack outside runs: no run owed, the gates whose places it freed.
OWED_GATES = (
    "CAST(NULL AS TEXT[]) AS owed_runs, (SELECT array_agg(DISTINCT gate) FROM ds) AS owed_gates"
)


def ack_outside_runs(t: Tables) -> TextClause:
    """``ack`` for deliveries outside any run: one row per acked id (a NULL id when
    none was)."""
    return text(
        f"WITH {ack_outside_runs_ctes(t)} SELECT d.id, {OWED_GATES} "
        "FROM (SELECT 1) one LEFT JOIN del d ON true"
    )


def ack_outside_runs_claim(t: Tables, *, single_queue: bool) -> TextClause:
    """``ack_claim`` whose acks are all of deliveries outside any run."""
    return text(
        f"WITH {ack_outside_runs_ctes(t)}, {_claim_ctes(t, single_queue=single_queue)} "
        f"SELECT c.*, (SELECT array_agg(id) FROM del) AS acked_ids, {OWED_GATES} "
        "FROM (SELECT 1) one LEFT JOIN claimed c ON true"
    )


def renew(t: Tables) -> TextClause:
    """The new expiry is max(old, now + lease): based on now, never on the old expiry, and
    never shortened. An expired lease is not renewed. The run locks follow."""
    return text(
        f"WITH f AS ({FENCES}), "
        f"up AS (UPDATE {t.messages.name} m SET lease_expires_at_ms = "
        f"{GREATEST}(m.lease_expires_at_ms, {NOW} + :lease_ms) FROM f "
        f"WHERE {c.fenced_join(NOW)} "
        "RETURNING m.id, m.run_id, m.attempt, m.lease_expires_at_ms), "
        f"r AS (UPDATE {t.runs.name} r SET lease_expires_at_ms = up.lease_expires_at_ms "
        "FROM up WHERE r.run_id = up.run_id AND r.message_id = up.id), "
        f"{_follow_slots(t, 'up')} "
        "SELECT id, lease_expires_at_ms FROM up"
    )


#: A transition's messages leave their run when it fails them.
FAILED = "CAST(:new_state AS TEXT) = 'dead'"


def transition(t: Tables, fences: str = FENCES) -> TextClause:
    """Release, park or fail fenced deliveries (``fences``: a SELECT of ``id, attempt``, by
    default the bound arrays), with their run locks and events. A message released to be
    claimed now (warm shutdown, a requeue) wakes the idle workers of its queue at commit, as a
    publish does. A failed one makes its run's next message ready (``promote_ctes``)."""
    return text(
        f"WITH f AS ({fences}), "
        f"up AS (UPDATE {t.messages.name} m SET {c.transition_set(NOW)} FROM f "
        f"WHERE {c.fenced_join(NOW)} "
        "RETURNING m.id, m.task_id, m.attempt, m.run_id, m.queue), "
        f"r AS (DELETE FROM {t.runs.name} r USING up WHERE r.run_id = up.run_id "
        "AND r.message_id = up.id), "
        f"ds AS (DELETE FROM {t.slots.name} x USING up WHERE x.message_id = up.id "
        "RETURNING x.gate), "
        f"e AS (INSERT INTO {t.events.name} (task_id, message_id, attempt, kind, data, at_ms) "
        f"SELECT task_id, id, attempt, CAST(:kind AS TEXT), CAST(:data AS TEXT), {NOW} "
        "FROM up), "
        "n AS (SELECT pg_notify(CAST(:channel AS TEXT), q.queue) FROM "
        "(SELECT DISTINCT queue FROM up WHERE CAST(:new_state AS TEXT) = 'ready' "
        "AND :delay_ms <= 0) q), "
        f"{promote_ctes(t, 'up', FAILED)} "
        f"SELECT u.id, {OWED} FROM (SELECT 1) one LEFT JOIN up u ON true "
        f"WHERE (SELECT count(*) FROM n) >= 0 AND {NOTIFIED}"
    )


def _follow_slots(t: Tables, source: str) -> str:
    """CTE ``s``: the gate slots of the renewed deliveries in ``source`` (id, attempt,
    lease_expires_at_ms) keep their message's new expiry: a slot must never expire before
    the lease it stands for."""
    return (
        f"s AS (UPDATE {t.slots.name} x SET lease_expires_at_ms = {source}.lease_expires_at_ms "
        f"FROM {source} WHERE x.message_id = {source}.id AND x.attempt = {source}.attempt)"
    )


def lease_check(t: Tables) -> TextClause:
    """The compare-and-set's lease check (``sql_common.lease_check``) with the message's gate slot
    renewed with it."""
    return text(
        f"WITH h AS (UPDATE {t.messages.name} AS m SET lease_expires_at_ms = "
        f"{GREATEST}(m.lease_expires_at_ms, {NOW} + :lease_ms) "
        f"WHERE m.id = :message_id AND m.attempt = :attempt AND {c.held(NOW)} "
        "AND (CAST(:task_id AS TEXT) IS NULL OR m.task_id IS NULL "
        "OR m.task_id = CAST(:task_id AS TEXT)) "
        "RETURNING m.id, m.attempt, m.lease_expires_at_ms, m.run_id), "
        f"{_follow_slots(t, 'h')} "
        "SELECT id, lease_expires_at_ms, run_id FROM h"
    )
