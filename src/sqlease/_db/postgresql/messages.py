"""PostgreSQL: publishing (with handoff to an idle worker), taking, and the next due time."""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db import sql_common as c
from sqlease._db import task_rows
from sqlease._db.ops import BATCH_FIELDS
from sqlease._db.postgresql import held
from sqlease._db.postgresql.dialect import NOW, each_queue, one_of_ids
from sqlease._db.tables import Tables

#: A handed-off message travels whole in its notification when the text fits in this many
#: bytes (PostgreSQL refuses a NOTIFY payload of 8000 bytes or more); otherwise only its id.
HANDOFF_NOTIFY_BYTES = 7900


def _events(t: Tables, *, handed: bool) -> str:
    """CTE ``e``: the ``enqueued`` event of the inserted row, if ``:record``; with
    ``handed``, also the ``claimed`` event of a row a handoff leased."""
    claimed = (
        " UNION ALL SELECT task_id, id, 1, 'claimed', "
        "json_build_object('owner', lease_owner, 'handoff', true)::text, "
        f"{NOW} FROM ins WHERE lease_owner IS NOT NULL"
    )
    return (
        f"e AS (INSERT INTO {t.events.name} (task_id, message_id, attempt, kind, data, at_ms) "
        f"SELECT task_id, id, 0, 'enqueued', NULL, {NOW} FROM ins "
        f"WHERE CAST(:record AS BOOLEAN){claimed if handed else ''})"
    )


def enqueue_plain(t: Tables) -> TextClause:
    """Inside a caller's transaction (the outbox), no handoff: the offer's row would stay
    locked until that transaction ends, and the offering worker's next refresh would wait for
    it in its event loop. Wakes listening workers at commit. A message of a run whose earlier
    messages are unfinished is inserted parked behind its run (sqlease._db.postgresql.held)."""
    # The run's probe once, for both the state and the reason.
    state = "CASE WHEN p.waits THEN 'parked' ELSE 'ready' END"
    return text(
        f"WITH {held.enqueue_ctes(t)}"
        f"ins AS (INSERT INTO {t.messages.name} ({c.INSERT_COLS}, reason) "
        f"SELECT {c.insert_values(NOW, state)}, CASE WHEN p.waits THEN 'run' END "
        f"FROM (SELECT {held.parks(t)} AS waits) p "
        "RETURNING id, task_id, queue, attempt, run_id), "
        f"{_events(t, handed=False)}, {task_rows.publish_cte(t, NOW)} "
        "SELECT ins.id FROM ins CROSS JOIN "
        "(SELECT pg_notify(CAST(:channel AS TEXT), ins2.queue) FROM ins ins2) n"
    )


def _handoff(t: Tables) -> str:
    """CTE ``o``: a message that needs no claim-time check (no run, due now) goes to the
    freshest live offer of an idle worker for its queue, if any. The offer is marked handed
    (one-shot, for that queue; SKIP LOCKED: two publishes never share one). Live: not
    handed, unexpired, and the worker's listening connection still holds its advisory lock,
    so a killed worker (its connections closed) is never chosen. A message under a
    concurrency limit is never handed over: only a claim can take its gate's slot. Nor is
    one that would pass a message waiting in its queue (an offer can stand a moment after
    the message it missed went to the table): it waits its turn for a claim. (Read per
    candidate offer only: a publish with no idle worker pays nothing for it.)"""
    off, m = t.offers.name, t.messages.name
    # A scalar subquery in the claim index's order, not EXISTS: PostgreSQL would turn NOT
    # EXISTS into an anti-join that may read the messages whole; this stays a probe of the
    # claim index, per candidate offer.
    waiting = (
        f"(SELECT 1 FROM {m} x WHERE x.state = 'ready' AND x.queue = w.queue "
        f"AND x.available_at_ms <= {NOW} "
        f"AND (x.lease_expires_at_ms IS NULL OR x.lease_expires_at_ms <= {NOW}) "
        "ORDER BY x.priority DESC, x.available_at_ms, x.id LIMIT 1)"
    )
    return (
        f"o AS (UPDATE {off} SET handed = true WHERE queue = :queue AND owner = "
        f"(SELECT w.owner FROM {off} w WHERE CAST(:run_id AS TEXT) IS NULL "
        f"AND :delay_ms <= 0 AND {_ungated(t)} AND w.queue = :queue AND NOT w.handed "
        f"AND w.expires_at_ms > {NOW} AND {waiting} IS NULL "
        "AND NOT pg_try_advisory_xact_lock_shared(w.lock_key) "
        "ORDER BY w.expires_at_ms DESC LIMIT 1 FOR UPDATE SKIP LOCKED) "
        "RETURNING owner, lease_ms, offer_seq), "
    )


def _ungated(t: Tables) -> str:
    """The new message has no concurrency key, and no limit is configured for its task name
    or its queue."""
    return (
        f"CAST(:gate_key AS TEXT) IS NULL AND NOT EXISTS (SELECT 1 FROM {t.flow_limits.name} l "
        "WHERE l.name = 'queue:' || CAST(:queue AS TEXT) "
        "OR l.name = 'task:' || CAST(:task_name AS TEXT))"
    )


def _handed_note() -> str:
    """The notification of a handed message: its worker, then the row whole within
    NOTIFY's 8000 bytes, otherwise only its id (the worker then reads the row back, fenced by
    owner and attempt); with the offer's number, which the worker must show before that
    offer can stand again."""
    row_json = (
        "json_build_object('id', i.id, 'queue', i.queue, 'payload', i.payload, "
        "'priority', i.priority, 'available_at_ms', i.available_at_ms, "
        "'created_at_ms', i.created_at_ms, 'run_id', i.run_id, 'task_id', i.task_id, "
        "'lease_owner', i.lease_owner, 'lease_expires_at_ms', i.lease_expires_at_ms, "
        "'attempt', i.attempt, 'offer_seq', o.offer_seq, "
        "'max_attempts', i.max_attempts)::text"
    )
    return (
        f"chr(1) || i.lease_owner || chr(10) || CASE WHEN octet_length({row_json}) "
        f"+ octet_length(i.lease_owner) < {HANDOFF_NOTIFY_BYTES} THEN {row_json} "
        "ELSE json_build_object('id', i.id, 'attempt', i.attempt, 'queue', i.queue, "
        "'offer_seq', o.offer_seq)::text END"
    )


def enqueue(t: Tables) -> TextClause:
    """Publish, handing the message to an offer (``_handoff``) when one stands: it is then
    inserted leased to that worker with attempt 1. The notification wakes listening workers
    (or hands the message over); delivered at commit, so a rolled-back enqueue never wakes
    anyone."""
    handed_cols = f"{c.INSERT_COLS}, lease_owner, lease_expires_at_ms"
    handed_vals = (
        f":queue, :payload, :priority, {NOW} + :delay_ms, {NOW}, :run_id, :task_id, "
        "'ready', CASE WHEN o.owner IS NULL THEN 0 ELSE 1 END, :max_attempts, "
        f"{c.INSERT_FLOW}, o.owner, {NOW} + o.lease_ms"
    )
    return text(
        f"WITH {_handoff(t)}"
        f"ins AS (INSERT INTO {t.messages.name} ({handed_cols}) SELECT {handed_vals} "
        "FROM (SELECT 1) one LEFT JOIN o ON true "
        "RETURNING id, task_id, queue, payload, priority, available_at_ms, "
        "created_at_ms, run_id, lease_owner, lease_expires_at_ms, attempt, "
        "max_attempts), "
        f"{_events(t, handed=True)}, {task_rows.publish_cte(t, NOW)} "
        "SELECT ins.id FROM ins CROSS JOIN "
        "(SELECT pg_notify(CAST(:channel AS TEXT), CASE WHEN i.lease_owner IS NULL "
        f"THEN i.queue ELSE {_handed_note()} END) FROM ins i LEFT JOIN o ON true) n"
    )


def enqueue_batch(t: Tables) -> TextClause:
    """Publish many messages (no run, no uniqueness or concurrency key: ``ops.batch_row``)
    in one statement, their ``enqueued`` events and task rows with them; their ids in the
    order given. The rows are one JSON parameter (``ops.batch_json``). The ids are drawn first
    and numbered in their own order, so the enqueue order follows the list whatever order
    the sequence gives them in. No handoff (one offer takes one message; the rest would wait
    for the claim anyway); each queue is notified once, at commit."""
    m = t.messages.name
    types = ("TEXT", "TEXT", "SMALLINT", "BIGINT", "TEXT", "INTEGER", "TEXT", "TEXT", "BOOLEAN")
    fields = ", ".join(
        f"CAST(v ->> {i} AS {kind}) AS {name}"
        for i, (name, kind) in enumerate(zip(BATCH_FIELDS, types, strict=True))
    )
    return text(
        f"WITH src AS (SELECT {fields}, n FROM "
        "jsonb_array_elements(CAST(:rows AS JSONB)) WITH ORDINALITY AS s(v, n)), "
        "ids AS (SELECT id, row_number() OVER (ORDER BY id) AS n FROM "
        f"(SELECT nextval(pg_get_serial_sequence('{m}', 'id')) AS id FROM src) x), "
        "r AS (SELECT ids.id, src.* FROM src JOIN ids ON ids.n = src.n), "
        f"ins AS (INSERT INTO {m} (id, {c.INSERT_COLS}) SELECT id, queue, payload, priority, "
        f"{NOW} + GREATEST(delay_ms, 0), {NOW}, NULL, task_id, 'ready', 0, max_attempts, "
        "task_name, NULL, NULL FROM r ORDER BY id), "
        f"e AS (INSERT INTO {t.events.name} (task_id, message_id, attempt, kind, data, at_ms) "
        f"SELECT task_id, id, 0, 'enqueued', NULL, {NOW} FROM r WHERE record ORDER BY id), "
        f"{task_rows.publish_batch_cte(t, NOW, 'r')}, "
        "wake AS (SELECT count(pg_notify(CAST(:channel AS TEXT), q.queue)) AS woken "
        "FROM (SELECT DISTINCT queue FROM src) q) "
        "SELECT r.id FROM r CROSS JOIN wake ORDER BY r.n"
    )


def take(t: Tables) -> TextClause:
    """As the claim: each queue read in index order, then the best ``:limit`` of them (a
    backlog of events in one queue must not make each fetch sort it)."""
    per_queue = c.take_ready(NOW, "m.queue = qn.name")
    taken_ids = (
        "SELECT x.id FROM "
        + each_queue(
            f"SELECT m.id, m.priority, m.available_at_ms FROM {t.messages.name} m "
            f"WHERE {per_queue} {c.ORDER} LIMIT :limit FOR UPDATE OF m SKIP LOCKED"
        )
        + " ORDER BY x.priority DESC, x.available_at_ms, x.id LIMIT :limit"
    )
    return c.take(t, one_of_ids("id", taken_ids))


def next_due_of_queues(t: Tables) -> str:
    """When the next delayed message of ``:queues`` is due, in milliseconds from now (lets an
    idle worker sleep until exactly then instead of polling). A closed rate limit's
    reopening counts as a due time."""
    names = "SELECT DISTINCT name AS q FROM unnest(CAST(:queues AS TEXT[])) AS u(name)"
    return f"SELECT LEAST({c.next_due_at(t, names, NOW)}, {c.rate_due(t, NOW)}) - {NOW}"


def next_due(t: Tables) -> TextClause:
    return text(next_due_of_queues(t))
