"""Every SQL statement of the lease store, per dialect.

This is the only module that knows how PostgreSQL and SQLite differ. Statements are written as
SQL text because the claim is a chain of data-modifying CTEs on PostgreSQL that SQLAlchemy's
expression language would only obscure; table names come from the validated prefix.

Time: every statement takes ``:now`` (epoch milliseconds). When it is NULL the database's own
clock is used, so that on PostgreSQL all workers compare leases against one clock whatever their
own clocks say; tests bind a fake clock instead.

Fence lists (``:fences``) are JSON arrays of ``[message_id, attempt]`` pairs, so one statement
handles a whole batch on both dialects.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import TextClause, text

from .schema import Tables, offers_sequence

#: A handed-off message travels whole in its notification when the text fits in this many
#: bytes (PostgreSQL refuses a NOTIFY payload of 8000 bytes or more); otherwise only its id.
HANDOFF_NOTIFY_BYTES = 7900

_SELECT_COLS = (
    "id, queue, payload, priority, available_at_ms, created_at_ms, run_id, task_id, state, "
    "reason, lease_owner, lease_expires_at_ms, attempt, max_attempts"
)


@dataclass(frozen=True)
class Dialect:
    name: str
    now: str
    greatest: str
    fences: str
    strings: str
    json_owner: str

    @property
    def is_postgresql(self) -> bool:
        return self.name == "postgresql"


POSTGRESQL = Dialect(
    name="postgresql",
    # statement_timestamp() is stable within a statement, so every comparison in one claim
    # sees the same instant.
    now="COALESCE(CAST(:now AS BIGINT), "
    "CAST(floor(EXTRACT(EPOCH FROM statement_timestamp()) * 1000) AS BIGINT))",
    greatest="GREATEST",
    # Arrays, not JSON: the planner then knows the batch is small and looks rows up by
    # primary key instead of scanning the ready rows.
    fences="SELECT * FROM unnest(CAST(:ids AS BIGINT[]), CAST(:attempts AS INTEGER[])) "
    "AS f(id, attempt)",
    strings="{col} = ANY(CAST(:{name} AS TEXT[]))",
    json_owner="json_build_object('owner', CAST(:owner AS TEXT))::text",
)

SQLITE = Dialect(
    name="sqlite",
    now="COALESCE(:now, CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER))",
    greatest="max",
    fences="SELECT CAST(json_extract(value, '$[0]') AS INTEGER) AS id, "
    "CAST(json_extract(value, '$[1]') AS INTEGER) AS attempt FROM json_each(:fences)",
    strings="{col} IN (SELECT value FROM json_each(:{name}))",
    json_owner="json_object('owner', :owner)",
)


def dialect_for(name: str) -> Dialect:
    return POSTGRESQL if name == "postgresql" else SQLITE


def offer_writes(
    off: str,
    sequence: str,
    now: str,
    *,
    revive: str,
    params: str = "",
    only_if: str = "true",
    names: tuple[str, str] = ("rv", "o"),
) -> str:
    """Two CTEs that make ``:owner``'s offers for ``:{params}queues`` stand (PostgreSQL).

    The first updates the offers that exist. ``revive="refresh"``: a live one gets a new
    expiry, and a handed one stands again only if the worker has heard of that handoff
    (``:{params}seen``, per queue, the highest ``offer_seq`` its handoffs carried, aligned
    with the queues). ``revive="handed only"``: live offers are left alone (not even locked)
    and only heard-of handed ones stand again. The second inserts the offers that do not
    exist. Every write that makes an offer stand takes a new number from ``sequence``, so a
    handed offer's number names the one handoff that used it."""
    p = params
    if revive == "refresh":
        which = "(NOT w.handed OR w.offer_seq <= s.seen)"
    elif revive == "handed only":
        which = "w.handed AND w.offer_seq <= s.seen"
    else:
        raise ValueError(f"unknown revive mode {revive!r}")
    update, insert = names
    return (
        f"{update} AS (UPDATE {off} w SET lease_ms = :{p}lease_ms, lock_key = :{p}lock_key, "
        f"expires_at_ms = {now} + :{p}ttl_ms, handed = false, "
        f"offer_seq = nextval('{sequence}') "
        f"FROM unnest(CAST(:{p}queues AS TEXT[]), CAST(:{p}seen AS BIGINT[])) AS s(q, seen) "
        f"WHERE w.owner = :owner AND w.queue = s.q AND {which} AND {only_if}), "
        f"{insert} AS (INSERT INTO {off} "
        "(owner, queue, lease_ms, lock_key, expires_at_ms, offer_seq, handed) "
        f"SELECT :owner, q, :{p}lease_ms, :{p}lock_key, {now} + :{p}ttl_ms, "
        f"nextval('{sequence}'), false FROM unnest(CAST(:{p}queues AS TEXT[])) q "
        f"WHERE {only_if} ON CONFLICT (owner, queue) DO NOTHING)"
    )


class Statements:
    """The compiled statements for one dialect and table prefix."""

    def __init__(self, dialect: Dialect, tables: Tables) -> None:
        self.d = d = dialect
        m = tables.messages.name
        runs = tables.runs.name
        ev = tables.events.name
        tasks = tables.tasks.name
        now = d.now
        queue_in = d.strings.format(col="m.queue", name="queues")
        # One queue (a Celery worker's usual case): plain equality, so PostgreSQL reads the
        # claim index in delivery order and stops at LIMIT instead of sorting the backlog.
        queue_eq = "m.queue = :queue"

        # A message is held while it is ready, leased to this owner at this attempt, and the
        # lease has not expired by the database's clock.
        held = f"m.state = 'ready' AND m.lease_owner = :owner AND m.lease_expires_at_ms > {now}"
        self.held_predicate = held

        def batch_event(kind: str, data: str, source: str, where: str) -> str:
            # PostgreSQL: one event row for all the messages one statement claimed or acked,
            # listed in id order (no row when there are none). Per-message rows cost about a
            # third of a claim's and an ack's server time and most of their WAL; `events()`
            # expands the batch back into one event per message.
            return (
                f"INSERT INTO {ev} (kind, data, at_ms, task_ids, message_ids, attempts) "
                f"SELECT '{kind}', {data}, {now}, array_agg(m.task_id ORDER BY m.id), "
                "array_agg(m.id ORDER BY m.id), array_agg(m.attempt ORDER BY m.id) "
                f"FROM {source} m WHERE {where} HAVING count(*) > 0"
            )

        def each_queue(per_queue: str) -> str:
            # PostgreSQL: `per_queue` (which reads `qn.name`) for each distinct queue of
            # :queues, as rows `x`. A queue equality reads the claim index in order; one scan
            # with `queue = ANY(...)` sorted every ready row of the queues instead, and a
            # generic plan of it scanned the table.
            return (
                "(SELECT DISTINCT name FROM unnest(CAST(:queues AS TEXT[])) AS u(name)) qn "
                f"CROSS JOIN LATERAL ({per_queue}) x"
            )

        # ---- enqueue --------------------------------------------------------------------
        insert_cols = (
            "queue, payload, priority, available_at_ms, created_at_ms, run_id, task_id, "
            "state, attempt, max_attempts"
        )
        insert_vals = (
            f":queue, :payload, :priority, {now} + :delay_ms, {now}, :run_id, :task_id, "
            "'ready', 0, :max_attempts"
        )
        if d.is_postgresql:
            off = tables.offers.name
            # Handoff: a message that needs no claim-time check (no run, due now) goes to the
            # freshest live offer of an idle worker for its queue, if any. The offer is
            # marked handed (one-shot, for that queue; SKIP LOCKED: two publishes never share
            # one), the message is inserted leased to that worker with attempt 1, and the
            # notification carries it whole, with the offer's number, which the worker must
            # show before that offer can stand again. Live: not handed, unexpired, and the
            # worker's listening connection still holds its advisory lock, so a killed worker
            # (its connections closed) is never chosen.
            handoff = (
                f"o AS (UPDATE {off} SET handed = true WHERE queue = :queue AND owner = "
                f"(SELECT w.owner FROM {off} w WHERE CAST(:run_id AS TEXT) IS NULL "
                f"AND :delay_ms <= 0 AND w.queue = :queue AND NOT w.handed "
                f"AND w.expires_at_ms > {now} "
                "AND NOT pg_try_advisory_xact_lock_shared(w.lock_key) "
                "ORDER BY w.expires_at_ms DESC LIMIT 1 FOR UPDATE SKIP LOCKED) "
                "RETURNING owner, lease_ms, offer_seq), "
            )
            handed_cols = f"{insert_cols}, lease_owner, lease_expires_at_ms"
            handed_vals = (
                f":queue, :payload, :priority, {now} + :delay_ms, {now}, :run_id, :task_id, "
                "'ready', CASE WHEN o.owner IS NULL THEN 0 ELSE 1 END, :max_attempts, "
                f"o.owner, {now} + o.lease_ms"
            )
            # Within NOTIFY's 8000 bytes the whole row travels; otherwise only its id (the
            # worker then reads the row back, fenced by owner and attempt).
            row_json = (
                "json_build_object('id', i.id, 'queue', i.queue, 'payload', i.payload, "
                "'priority', i.priority, 'available_at_ms', i.available_at_ms, "
                "'created_at_ms', i.created_at_ms, 'run_id', i.run_id, 'task_id', i.task_id, "
                "'lease_owner', i.lease_owner, 'lease_expires_at_ms', i.lease_expires_at_ms, "
                "'attempt', i.attempt, 'offer_seq', o.offer_seq, "
                "'max_attempts', i.max_attempts)::text"
            )
            handed_note = (
                f"chr(1) || i.lease_owner || chr(10) || CASE WHEN octet_length({row_json}) "
                f"+ octet_length(i.lease_owner) < {HANDOFF_NOTIFY_BYTES} THEN {row_json} "
                "ELSE json_build_object('id', i.id, 'attempt', i.attempt, 'queue', i.queue, "
                "'offer_seq', o.offer_seq)::text END"
            )
            # Inside a caller's transaction (the outbox), no handoff: the offer's row would
            # stay locked until that transaction ends, and the offering worker's next refresh
            # would wait for it in its event loop.
            self.enqueue_plain = text(
                f"WITH ins AS (INSERT INTO {m} ({insert_cols}) VALUES ({insert_vals}) "
                "RETURNING id, task_id, queue), "
                f"e AS (INSERT INTO {ev} (task_id, message_id, attempt, kind, data, at_ms) "
                f"SELECT task_id, id, 0, 'enqueued', NULL, {now} FROM ins "
                "WHERE CAST(:record AS BOOLEAN)) "
                "SELECT ins.id FROM ins CROSS JOIN "
                "(SELECT pg_notify(CAST(:channel AS TEXT), ins2.queue) FROM ins ins2) n"
            )
            self.enqueue = text(
                f"WITH {handoff}"
                f"ins AS (INSERT INTO {m} ({handed_cols}) SELECT {handed_vals} "
                "FROM (SELECT 1) one LEFT JOIN o ON true "
                "RETURNING id, task_id, queue, payload, priority, available_at_ms, "
                "created_at_ms, run_id, lease_owner, lease_expires_at_ms, attempt, "
                "max_attempts), "
                f"e AS (INSERT INTO {ev} (task_id, message_id, attempt, kind, data, at_ms) "
                f"SELECT task_id, id, 0, 'enqueued', NULL, {now} FROM ins "
                "WHERE CAST(:record AS BOOLEAN) "
                f"UNION ALL SELECT task_id, id, 1, 'claimed', "
                "json_build_object('owner', lease_owner, 'handoff', true)::text, "
                f"{now} FROM ins WHERE lease_owner IS NOT NULL) "
                # Wake listening workers (or hand the message over); delivered at commit, so
                # a rolled-back enqueue never wakes anyone.
                "SELECT ins.id FROM ins CROSS JOIN "
                "(SELECT pg_notify(CAST(:channel AS TEXT), CASE WHEN i.lease_owner IS NULL "
                f"THEN i.queue ELSE {handed_note} END) FROM ins i LEFT JOIN o ON true) n"
            )
            # An idle worker's offer for each queue it consumes (refreshed by each idle look;
            # live offers for queues it no longer consumes are dropped), with, in the same
            # statement, when the next delayed message of those queues is due.
            offers_gone = (
                f"gone AS (DELETE FROM {off} WHERE owner = :owner AND NOT handed "
                "AND queue <> ALL(CAST(:queues AS TEXT[]))), "
            )
            self.offer_ctes: str | None = offers_gone + offer_writes(
                off, offers_sequence(tables), now, revive="refresh"
            )
            # Per queue: a generic plan of `queue = ANY(...) AND available_at_ms > now`
            # scanned the whole table (47 ms at 60,000 queued, against 5 ms this way).
            due_of_queue = (
                f"SELECT min(m.available_at_ms) AS due FROM {m} m WHERE m.state = 'ready' "
                f"AND m.queue = qn.name AND m.available_at_ms > {now}"
            )
            self.next_due_of_queues: str | None = (
                f"SELECT min(x.due) - {now} FROM {each_queue(due_of_queue)}"
            )
            self.offer_and_next_due: TextClause | None = text(
                f"WITH {self.offer_ctes} SELECT ({self.next_due_of_queues}) AS due"
            )
            # A handed offer stays until its worker has heard of the handoff (or closes):
            # deleting it would let a refresh sent before then make a new one.
            self.offer_withdraw: TextClause | None = text(
                f"DELETE FROM {off} WHERE owner = :owner AND NOT handed"
            )
            self.offer_withdraw_all: TextClause | None = text(
                f"DELETE FROM {off} WHERE owner = :owner"
            )
            self.leased_to_owner: TextClause | None = text(
                f"SELECT id, attempt FROM {m} WHERE lease_owner = :owner AND state = 'ready'"
            )
        else:
            self.enqueue = text(
                f"INSERT INTO {m} ({insert_cols}) VALUES ({insert_vals}) RETURNING id"
            )
            self.offer_and_next_due = self.offer_withdraw = self.leased_to_owner = None
            self.offer_withdraw_all = None
            self.offer_ctes = self.next_due_of_queues = None
            self.enqueue_plain = self.enqueue
        self.event_insert = text(
            f"INSERT INTO {ev} (task_id, message_id, attempt, kind, data, at_ms) "
            f"VALUES (:task_id, :message_id, :attempt, :kind, CAST(:data AS TEXT), {now})"
        )

        # ---- claim ----------------------------------------------------------------------
        # Ready: available now, not leased (or lease expired), and either without a run or
        # the head of its run (its lowest unfinished message), which keeps a run in order.
        ready = (
            "m.state = 'ready' AND {queue} AND m.available_at_ms <= " + now + " "
            f"AND (m.lease_expires_at_ms IS NULL OR m.lease_expires_at_ms <= {now}) "
            f"AND (m.run_id IS NULL OR m.id = (SELECT min(h.id) FROM {m} h "
            "WHERE h.run_id = m.run_id AND h.state IN ('ready', 'parked')))"
        )
        run_free = (
            f"NOT EXISTS (SELECT 1 FROM {runs} r WHERE r.run_id = m.run_id "
            f"AND r.lease_expires_at_ms > {now} AND r.message_id <> m.id)"
        )
        order = "ORDER BY m.priority DESC, m.available_at_ms, m.id"
        q = "m." if d.is_postgresql else ""  # SQLite's RETURNING takes bare column names
        returning = "RETURNING " + ", ".join(q + c for c in _SELECT_COLS.split(", "))
        if d.is_postgresql:
            # One statement. The candidate CTE locks rows with SKIP LOCKED so claimers do not
            # convoy on the head row; the per-run upsert takes the run's row lock (it waits,
            # then re-checks the run's lease on the newest row version), so two claimers can
            # never both lease messages of one run; the outer UPDATE re-checks the lease
            # predicate (READ COMMITTED).
            claimed_batch = batch_event("claimed", d.json_owner, "claimed", "m.state = 'ready'")
            candidates = (
                "SELECT m.id, m.run_id, m.attempt, (m.attempt >= m.max_attempts) AS exhausted, "
                f"m.priority, m.available_at_ms FROM {m} m "
                f"WHERE {ready} AND (m.run_id IS NULL OR {run_free}) "
                f"{order} LIMIT :limit FOR UPDATE OF m SKIP LOCKED"
            )
            # Several queues: the first :limit of each queue, read in index order (a queue
            # equality per queue), then the best :limit of those. A single scan with
            # `queue = ANY(...)` sorted every ready row of the queues: 40 ms per claim at
            # 20,000 queued, 170-250 ms at 100,000. Rows locked here and not kept are
            # released at the statement's commit; meanwhile other claimers skip them.
            per_queue = candidates.replace("{queue}", "m.queue = qn.name")
            cand_single = f"SELECT * FROM ({candidates.replace('{queue}', queue_eq)}) c"
            cand_multi = (
                f"SELECT x.* FROM {each_queue(per_queue)} "
                "ORDER BY x.priority DESC, x.available_at_ms, x.id LIMIT :limit"
            )
            claim_ctes = (
                "cand AS ({cand}), "
                "run_locks AS ("
                f"INSERT INTO {runs} AS r (run_id, message_id, attempt, lease_owner, "
                "lease_expires_at_ms) "
                f"SELECT c.run_id, c.id, c.attempt + 1, CAST(:owner AS TEXT), {now} + :lease_ms "
                "FROM cand c "
                "WHERE c.run_id IS NOT NULL AND NOT c.exhausted "
                "ON CONFLICT (run_id) DO UPDATE SET message_id = excluded.message_id, "
                "attempt = excluded.attempt, lease_owner = excluded.lease_owner, "
                "lease_expires_at_ms = excluded.lease_expires_at_ms "
                f"WHERE r.lease_expires_at_ms <= {now} OR r.message_id = excluded.message_id "
                "RETURNING r.run_id), "
                f"claimed AS (UPDATE {m} m SET "
                "attempt = CASE WHEN c.exhausted THEN m.attempt ELSE m.attempt + 1 END, "
                "lease_owner = CASE WHEN c.exhausted THEN NULL ELSE CAST(:owner AS TEXT) END, "
                f"lease_expires_at_ms = CASE WHEN c.exhausted THEN NULL ELSE {now} + :lease_ms "
                "END, "
                "state = CASE WHEN c.exhausted THEN 'dead' ELSE 'ready' END, "
                "reason = CASE WHEN c.exhausted THEN 'attempts_exhausted' ELSE m.reason END "
                "FROM cand c WHERE m.id = c.id AND m.state = 'ready' "
                f"AND (m.lease_expires_at_ms IS NULL OR m.lease_expires_at_ms <= {now}) "
                "AND (c.exhausted OR c.run_id IS NULL "
                "OR c.run_id IN (SELECT run_id FROM run_locks)) "
                f"{returning}), "
                f"e AS (INSERT INTO {ev} (task_id, message_id, attempt, kind, data, at_ms) "
                f"SELECT m.task_id, m.id, m.attempt, 'attempts_exhausted', NULL, {now} "
                "FROM claimed m WHERE m.state = 'dead'), "
                # The deliveries' `claimed` event: one batch row listing them.
                f"eb AS ({claimed_batch})"
            )
            claim_sql = f"WITH {claim_ctes} SELECT * FROM claimed"
            self.claim_runs = None
            self.claim_events = None
        else:
            # SQLite: the engine opens every transaction with BEGIN IMMEDIATE, so the claim's
            # statements run under the database's single write lock and no other writer can
            # interleave; the UPDATE still picks and leases in one statement.
            exhausted = "attempt >= max_attempts"
            claim_sql = (
                f"UPDATE {m} AS m SET "
                f"lease_owner = CASE WHEN {exhausted} THEN NULL ELSE :owner END, "
                f"lease_expires_at_ms = CASE WHEN {exhausted} THEN NULL "
                f"ELSE {now} + :lease_ms END, "
                f"state = CASE WHEN {exhausted} THEN 'dead' ELSE 'ready' END, "
                f"reason = CASE WHEN {exhausted} THEN 'attempts_exhausted' ELSE reason END, "
                f"attempt = CASE WHEN {exhausted} THEN attempt ELSE attempt + 1 END "
                f"WHERE m.id IN (SELECT m.id FROM {m} m WHERE {ready} "
                f"AND (m.run_id IS NULL OR {run_free}) {order} LIMIT :limit) "
                f"{returning}"
            )
            self.claim_runs = text(
                f"INSERT INTO {runs} (run_id, message_id, attempt, lease_owner, "
                "lease_expires_at_ms) VALUES (:run_id, :message_id, :attempt, :owner, "
                ":lease_expires_at_ms) ON CONFLICT (run_id) DO UPDATE SET "
                "message_id = excluded.message_id, attempt = excluded.attempt, "
                "lease_owner = excluded.lease_owner, "
                "lease_expires_at_ms = excluded.lease_expires_at_ms"
            )
            self.claim_events = self.event_insert

        if d.is_postgresql:
            self.claim = text(claim_sql.replace("{cand}", cand_multi))
            self.claim_single = text(claim_sql.replace("{cand}", cand_single))
        else:
            self.claim = text(claim_sql.replace("{queue}", queue_in))
            self.claim_single = text(claim_sql.replace("{queue}", queue_eq))
        # The fences drive the join: one primary-key probe per fence. (A further
        # `m.id = ANY(:ids)` made PostgreSQL scan the index for all ids and then rescan the
        # unnested fences for every row: 0.41 against 0.15 ms for an ack of 32.)
        fenced_join = f"m.id = f.id AND m.attempt = f.attempt AND {held}"
        ack_ctes = (
            f"f AS ({d.fences}), "
            f"del AS (DELETE FROM {m} m USING f WHERE {fenced_join} "
            "RETURNING m.id, m.task_id, m.attempt, m.run_id), "
            f"r AS (DELETE FROM {runs} r USING del WHERE r.run_id = del.run_id "
            "AND r.message_id = del.id), "
            f"ea AS ({batch_event('acked', 'NULL', 'del', 'true')})"
        )
        if d.is_postgresql:
            # A busy worker's acks and its refill claim in one statement: one round trip and
            # one commit instead of two. Every claimed row comes back with the ids the acks
            # removed (one row of NULLs and those ids when nothing was claimed). The claim does
            # not see the acks' effects (one snapshot): a run's next message waits for the
            # next claim, and the acked rows are leased, so the claim never takes them.
            ack_claim = (
                f"WITH {ack_ctes}, {claim_ctes} "
                "SELECT c.*, (SELECT array_agg(id) FROM del) AS acked_ids "
                "FROM (SELECT 1) one LEFT JOIN claimed c ON true"
            )
            self.ack_claim: TextClause | None = text(ack_claim.replace("{cand}", cand_multi))
            self.ack_claim_single: TextClause | None = text(
                ack_claim.replace("{cand}", cand_single)
            )
        else:
            self.ack_claim = self.ack_claim_single = None

        # ---- renew ----------------------------------------------------------------------
        # The new expiry is max(old, now + lease): based on now, never on the old expiry, and
        # never shortened. An expired lease is not renewed.
        if d.is_postgresql:
            self.renew = text(
                f"WITH f AS ({d.fences}), "
                f"up AS (UPDATE {m} m SET lease_expires_at_ms = "
                f"{d.greatest}(m.lease_expires_at_ms, {now} + :lease_ms) FROM f "
                f"WHERE {fenced_join} RETURNING m.id, m.run_id, m.lease_expires_at_ms), "
                f"r AS (UPDATE {runs} r SET lease_expires_at_ms = up.lease_expires_at_ms "
                "FROM up WHERE r.run_id = up.run_id AND r.message_id = up.id) "
                "SELECT id, lease_expires_at_ms FROM up"
            )
            self.renew_runs = None
        else:
            self.renew = text(
                f"UPDATE {m} AS m SET lease_expires_at_ms = "
                f"{d.greatest}(lease_expires_at_ms, {now} + :lease_ms) "
                f"WHERE m.id IN (SELECT m.id FROM {m} m JOIN ({d.fences}) f "
                f"ON {fenced_join}) RETURNING id, run_id, lease_expires_at_ms"
            )
            self.renew_runs = text(
                f"UPDATE {runs} SET lease_expires_at_ms = :lease_expires_at_ms "
                "WHERE run_id = :run_id AND message_id = :message_id"
            )

        # ---- ack / release / park / fail (fenced) -----------------------------------------
        if d.is_postgresql:
            self.ack = text(f"WITH {ack_ctes} SELECT id FROM del")
            # The ack that leaves a worker idle, with its handoff offer (and its next due
            # time): one statement instead of two, so the offer stands sooner.
            assert self.offer_ctes is not None
            # An offer that already stands (the task's result wrote it) is kept, not updated:
            # updating would lock its row just when the client's next publish looks for it,
            # and the publish, which skips locked offers, would miss it.
            offer_keep = offers_gone + offer_writes(
                tables.offers.name, offers_sequence(tables), now, revive="handed only"
            )
            self.ack_offer: TextClause | None = text(
                f"WITH {ack_ctes}, {offer_keep} "
                "SELECT (SELECT array_agg(id) FROM del) AS acked_ids, "
                f"({self.next_due_of_queues}) AS due"
            )
        else:
            self.ack = text(
                f"DELETE FROM {m} WHERE id IN (SELECT m.id FROM {m} m JOIN ({d.fences}) f "
                f"ON {fenced_join}) RETURNING id, task_id, attempt, run_id"
            )
            self.ack_offer = None
        self.release_run = text(
            f"DELETE FROM {runs} WHERE run_id = :run_id AND message_id = :message_id"
        )

        # release: lease cleared, optionally delayed; ``refund`` gives the delivery back to
        # the attempt budget (the message was never started, e.g. warm shutdown).
        transition = (
            "lease_owner = NULL, lease_expires_at_ms = NULL, "
            f"available_at_ms = CASE WHEN :delay_ms > 0 THEN {now} + :delay_ms "
            "ELSE available_at_ms END, "
            "max_attempts = max_attempts + :refund, "
            "state = CAST(:new_state AS TEXT), reason = CAST(:reason AS TEXT), "
            "last_error = COALESCE(CAST(:error AS TEXT), last_error)"
        )
        if d.is_postgresql:
            self.transition = text(
                f"WITH f AS ({d.fences}), "
                f"up AS (UPDATE {m} m SET {transition} FROM f WHERE {fenced_join} "
                "RETURNING m.id, m.task_id, m.attempt, m.run_id, m.queue), "
                f"r AS (DELETE FROM {runs} r USING up WHERE r.run_id = up.run_id "
                "AND r.message_id = up.id), "
                f"e AS (INSERT INTO {ev} (task_id, message_id, attempt, kind, data, at_ms) "
                f"SELECT task_id, id, attempt, CAST(:kind AS TEXT), CAST(:data AS TEXT), {now} "
                "FROM up), "
                # A message released to be claimed now (warm shutdown, a requeue) wakes the
                # idle workers of its queue at commit, as a publish does.
                "n AS (SELECT pg_notify(CAST(:channel AS TEXT), q.queue) FROM "
                "(SELECT DISTINCT queue FROM up WHERE CAST(:new_state AS TEXT) = 'ready' "
                "AND :delay_ms <= 0) q) "
                "SELECT id FROM up WHERE (SELECT count(*) FROM n) >= 0"
            )
        else:
            self.transition = text(
                f"UPDATE {m} AS m SET {transition} WHERE m.id IN (SELECT m.id FROM {m} m "
                f"JOIN ({d.fences}) f ON {fenced_join}) "
                "RETURNING id, task_id, attempt, run_id"
            )

        # ---- compare-and-set on the task's durable state --------------------------------
        # Locks and renews the message row first (so no takeover can interleave), then
        # writes the task row only at the expected revision.
        self.hold = text(
            f"UPDATE {m} AS m SET lease_expires_at_ms = "
            f"{d.greatest}(m.lease_expires_at_ms, {now} + :lease_ms) "
            f"WHERE m.id = :message_id AND m.attempt = :attempt AND {held} "
            "AND (CAST(:task_id AS TEXT) IS NULL OR m.task_id IS NULL "
            "OR m.task_id = CAST(:task_id AS TEXT)) "
            f"RETURNING {q}id, {q}lease_expires_at_ms, {q}run_id"
        )
        self.hold_run = text(
            f"UPDATE {runs} SET lease_expires_at_ms = :lease_expires_at_ms "
            "WHERE run_id = :run_id AND message_id = :message_id"
        )
        self.task_ensure = text(
            f"INSERT INTO {tasks} (task_id, state, checkpoint, revision, run_id, "
            f"created_at_ms, updated_at_ms) VALUES (:task_id, NULL, '{{}}', 0, :run_id, "
            f"{now}, {now}) ON CONFLICT (task_id) DO NOTHING"
        )
        self.task_cas = text(
            f"UPDATE {tasks} SET state = COALESCE(CAST(:state AS TEXT), state), "
            "reason = CASE WHEN CAST(:state AS TEXT) IS NULL THEN reason "
            "ELSE CAST(:reason AS TEXT) END, "
            "checkpoint = COALESCE(CAST(:checkpoint AS TEXT), checkpoint), "
            "revision = revision + 1, "
            f"updated_at_ms = {now} WHERE task_id = :task_id AND revision = :expected "
            "RETURNING revision"
        )
        self.task_get = text(
            f"SELECT task_id, state, reason, checkpoint, revision, run_id, created_at_ms, "
            f"updated_at_ms FROM {tasks} WHERE task_id = :task_id"
        )

        # ---- no-ack fetch: delete on fetch (pidbox, events) -----------------------------
        take_ready = (
            f"m.state = 'ready' AND {queue_in} AND m.available_at_ms <= {now} "
            f"AND (m.lease_expires_at_ms IS NULL OR m.lease_expires_at_ms <= {now}) "
            "AND m.run_id IS NULL"
        )
        if d.is_postgresql:
            # As the claim: each queue read in index order, then the best :limit of them
            # (a backlog of events in one queue must not make each fetch sort it).
            per_queue = take_ready.replace(queue_in, "m.queue = qn.name")
            taken_ids = (
                "SELECT x.id FROM "
                + each_queue(
                    f"SELECT m.id, m.priority, m.available_at_ms FROM {m} m WHERE {per_queue} "
                    f"{order} LIMIT :limit FOR UPDATE OF m SKIP LOCKED"
                )
                + " ORDER BY x.priority DESC, x.available_at_ms, x.id LIMIT :limit"
            )
        else:
            taken_ids = f"SELECT m.id FROM {m} m WHERE {take_ready} {order} LIMIT :limit"
        self.take = text(
            f"DELETE FROM {m} WHERE id IN ({taken_ids}) "
            "RETURNING id, queue, payload, priority, available_at_ms, created_at_ms, run_id, "
            "task_id, state, reason, lease_owner, lease_expires_at_ms, attempt, max_attempts"
        )

        # ---- queue-level ----------------------------------------------------------------
        unleased = f"(lease_expires_at_ms IS NULL OR lease_expires_at_ms <= {now})"
        self.size = text(
            f"SELECT count(*) FROM {m} WHERE state = 'ready' AND queue = :queue "
            f"AND available_at_ms <= {now} AND {unleased}"
        )
        # Ready (due, unleased) messages only, as RabbitMQ purges its ready messages: a
        # scheduled message (eta, countdown, retry) is, there, already held by a worker.
        self.purge = text(
            f"DELETE FROM {m} WHERE state = 'ready' AND queue = :queue AND {unleased} "
            f"AND available_at_ms <= {now} "
            "RETURNING id, task_id, attempt"
        )
        self.requeue = text(
            f"UPDATE {m} SET state = 'ready', reason = NULL, lease_owner = NULL, "
            f"lease_expires_at_ms = NULL, available_at_ms = {now} + :delay_ms, "
            "max_attempts = attempt + :budget "
            "WHERE id = :message_id AND state IN ('parked', 'dead') "
            "RETURNING id, task_id, attempt"
        )
        # When will something in these queues next become due? (Lets an idle worker sleep
        # until exactly then instead of polling.)
        self.next_due = text(
            self.next_due_of_queues
            if self.next_due_of_queues is not None
            else f"SELECT min(available_at_ms) - {now} FROM {m} WHERE state = 'ready' "
            f"AND {d.strings.format(col='queue', name='queues')} AND available_at_ms > {now}"
        )
        self.message_get = text(f"SELECT {_SELECT_COLS}, last_error FROM {m} WHERE id = :id")
        event_cols = "id, task_id, message_id, attempt, kind, data, at_ms"
        if d.is_postgresql:
            # A task's own rows and, expanded, the batch rows that list it (found through
            # the GIN index); a message's batch rows are searched without an index (a
            # diagnostic query: a delivery is known by its task).
            expanded = (
                "SELECT e.id, u.task_id, u.message_id, u.attempt, e.kind, e.data, e.at_ms "
                f"FROM {ev} e CROSS JOIN LATERAL "
                "unnest(e.task_ids, e.message_ids, e.attempts) AS u(task_id, message_id, attempt) "
            )
            self.events_for_task = text(
                f"SELECT {event_cols} FROM {ev} WHERE task_id = :task_id UNION ALL "
                f"{expanded} WHERE e.task_ids @> ARRAY[CAST(:task_id AS TEXT)] "
                "AND u.task_id = :task_id ORDER BY id, message_id"
            )
            self.events_for_message = text(
                f"SELECT {event_cols} FROM {ev} WHERE message_id = :message_id UNION ALL "
                f"{expanded} WHERE e.message_ids @> ARRAY[CAST(:message_id AS BIGINT)] "
                "AND u.message_id = :message_id ORDER BY id"
            )
        else:
            self.events_for_task = text(
                f"SELECT {event_cols} FROM {ev} WHERE task_id = :task_id ORDER BY id"
            )
            self.events_for_message = text(
                f"SELECT {event_cols} FROM {ev} WHERE message_id = :message_id ORDER BY id"
            )
        self.now = text(f"SELECT {now}")

        # ---- result write (PostgreSQL: one statement) ---------------------------------------
        # The lease check of ``hold`` as a row-locking UPDATE (only when fenced), the upsert
        # only if it held (and, with :keep_success, never over a stored SUCCESS), and the
        # waiters' notification: with the value when it was stored, by key alone when a
        # stored SUCCESS was kept. SQLite runs the check and the upsert in one transaction.
        self.result_put: TextClause | None = None
        if d.is_postgresql:
            r = tables.results.name
            cols = "key, value, state, task_id, message_id, attempt, expires_at_ms, updated_at_ms"
            self.result_put = text(
                f"WITH h AS (UPDATE {m} AS m SET lease_expires_at_ms = m.lease_expires_at_ms "
                "WHERE CAST(:fenced AS BOOLEAN) AND m.id = :message_id "
                f"AND m.attempt = :attempt AND {held} "
                "AND (CAST(:task_id AS TEXT) IS NULL OR m.task_id IS NULL "
                "OR m.task_id = CAST(:task_id AS TEXT)) RETURNING m.id), "
                f"up AS (INSERT INTO {r} AS r ({cols}) "
                "SELECT CAST(:key AS TEXT), :value, CAST(:state AS TEXT), "
                "CAST(:task_id AS TEXT), CAST(:message_id AS BIGINT), "
                "CAST(:attempt AS INTEGER), CAST(:expires_at_ms AS BIGINT), "
                "CAST(:updated_at_ms AS BIGINT) "
                "WHERE NOT CAST(:fenced AS BOOLEAN) OR EXISTS (SELECT 1 FROM h) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value, "
                "state = excluded.state, task_id = excluded.task_id, "
                "message_id = excluded.message_id, attempt = excluded.attempt, "
                "expires_at_ms = excluded.expires_at_ms, updated_at_ms = excluded.updated_at_ms "
                "WHERE NOT CAST(:keep_success AS BOOLEAN) "
                "OR r.state IS DISTINCT FROM 'SUCCESS' RETURNING 1), "
                "n AS (SELECT pg_notify(CAST(:channel AS TEXT), CASE WHEN EXISTS "
                "(SELECT 1 FROM up) THEN CAST(:payload AS TEXT) ELSE CAST(:key AS TEXT) END) "
                "WHERE NOT CAST(:fenced AS BOOLEAN) OR EXISTS (SELECT 1 FROM h)) "
                "SELECT EXISTS (SELECT 1 FROM h) AS held, "
                "(SELECT count(*) FROM up) + 0 * (SELECT count(*) FROM n) AS stored"
            )
            # The final result of a delivery its worker took while idle carries that worker's
            # next handoff offer, written only if the lease held (the worker is alive and the
            # task over): it stands before the client even wakes, so the client's next publish
            # is handed over (the worker's ack would put it back a round trip later).
            result_sql = str(self.result_put.text)
            offer_cte = (
                offer_writes(
                    tables.offers.name,
                    offers_sequence(tables),
                    now,
                    revive="refresh",
                    params="offer_",
                    only_if="EXISTS (SELECT 1 FROM h)",
                    names=("rr", "ro"),
                )
                + ", "
            )
            notify_cte = "n AS (SELECT pg_notify"
            self.result_put_offer: TextClause | None = text(
                result_sql.replace(notify_cte, offer_cte + notify_cte, 1)
            )
        else:
            self.result_put_offer = None

        # ---- bindings and queues --------------------------------------------------------
        b = tables.bindings.name
        q = tables.queues.name
        self.bind = text(
            f"INSERT INTO {b} (exchange, queue, routing_key, pattern) "
            "VALUES (:exchange, :queue, :routing_key, :pattern) ON CONFLICT DO NOTHING"
        )
        self.unbind = text(
            f"DELETE FROM {b} WHERE exchange = :exchange AND queue = :queue "
            "AND routing_key = :routing_key AND pattern = :pattern"
        )
        self.bindings_for = text(
            f"SELECT routing_key, pattern, queue FROM {b} WHERE exchange = :exchange "
            "ORDER BY queue, routing_key"
        )
        self.declare_queue = text(
            f"INSERT INTO {q} (name, created_at_ms) VALUES (:queue, {now}) ON CONFLICT DO NOTHING"
        )
        self.has_queue = text(f"SELECT 1 FROM {q} WHERE name = :queue")
        self.delete_queue = text(f"DELETE FROM {q} WHERE name = :queue")
        self.delete_queue_bindings = text(f"DELETE FROM {b} WHERE queue = :queue")
        self.delete_queue_messages = text(
            f"DELETE FROM {m} WHERE queue = :queue AND state = 'ready' AND {unleased}"
        )


def compile_all(statements: Statements) -> list[TextClause]:
    """Every statement object (used by tests to make sure each one compiles)."""
    return [v for v in vars(statements).values() if isinstance(v, TextClause)]
