"""PostgreSQL: the claim of queues whose messages nothing holds back, and its acks.

The full claim (sqlease._db.postgresql.leases) carries every held-work check in its plan: the
full gates, the rate limits' allowances, the free gate slots, the run locks. PostgreSQL
initialises every node of a plan on each execution whether or not any row reaches it, and on
a backlog of plain tasks that start-up was 27% of the server's time per claim. Here the plan
holds only what a plain message needs: its candidates, each marked ``plain`` (no run, no
concurrency key, no limit or rate on its task or queue), and the claim of those in front of
the first that is not. The claim stops there, so nothing passes a held message; its answer
says so (``held_ahead``) and the caller claims again with the full statement, which sees
the held message's run, gate or rate (sqlease._db.postgresql.lease_ops keeps to it for a
while). The acks that go with it are the full ack's, or, when every acked delivery is outside
any run, the ack without a run's promotion (``leases.ack_outside_runs_ctes``).

Measured on one connection, ack + claim of 4 over a backlog of 30,000 plain messages, median
round trip: 1,030 us for the full statement, 835 us for this one."""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db import sql_common as c
from sqlease._db.postgresql import leases
from sqlease._db.postgresql.dialect import (
    NOW,
    each_queue,
)
from sqlease._db.postgresql.held import NOTIFIED, OWED
from sqlease._db.tables import Tables


def _plain(t: Tables) -> str:
    """A message ``m`` the full claim would lease as it is: no run, no concurrency key, and
    no concurrency or rate limit on its task or its queue (``sql_common.gate_joins``)."""
    return (
        "(m.run_id IS NULL AND m.gate_key IS NULL AND NOT EXISTS (SELECT 1 FROM "
        f"{t.flow_limits.name} fl WHERE fl.name IN ('task:' || m.task_name, 'queue:' || m.queue) "
        "AND (fl.concurrency IS NOT NULL OR fl.interval_ms IS NOT NULL)))"
    )


def _candidates(t: Tables, queue: str) -> str:
    """The claimable rows of ``queue`` (a predicate on ``m.queue``) in claim order, locked
    with SKIP LOCKED, each marked ``plain``."""
    return (
        "SELECT m.id, m.state, m.attempt, (m.attempt >= m.max_attempts) AS exhausted, "
        f"m.priority, m.available_at_ms, {_plain(t)} AS plain "
        f"FROM {t.messages.name} m WHERE {c.ready(t, NOW, queue)} "
        f"{c.ORDER} LIMIT :limit FOR UPDATE OF m SKIP LOCKED"
    )


def _cand(t: Tables, *, single_queue: bool) -> str:
    """The first ``:limit`` candidates over the queue's priorities (or each queue's), with
    their rank in claim order (``rk``), as the full claim reads them."""
    if single_queue:
        source = (
            f"{c.ready_priorities(t, ':queue')} pp CROSS JOIN LATERAL "
            f"({_candidates(t, 'm.queue = :queue AND m.priority = pp.pr')}) x"
        )
    else:
        source = each_queue(
            f"SELECT y.* FROM {c.ready_priorities(t, 'qn.name')} pp CROSS JOIN LATERAL "
            f"({_candidates(t, 'm.queue = qn.name AND m.priority = pp.pr')}) y"
        )
    order = "x.priority DESC, x.available_at_ms, x.id"
    return (
        f"SELECT x.*, row_number() OVER (ORDER BY {order}) AS rk FROM {source} "
        f"ORDER BY {order} LIMIT :limit"
    )


def _claim_ctes(t: Tables, *, single_queue: bool) -> str:
    """CTEs ``cand``, ``stop`` (the rank of the first candidate that is not plain; NULL when
    all are), ``claimed`` (those in front of it: leased, or dead when exhausted), their
    events."""
    return (
        f"cand AS ({_cand(t, single_queue=single_queue)}), "
        "stop AS (SELECT min(rk) AS rk FROM cand WHERE NOT plain), "
        + leases.claimed_ctes(
            t,
            gate="NULL",
            rate="NULL",
            passes="c.rk < COALESCE((SELECT rk FROM stop), :limit + 1)",
        )
    )


#: The answer's column: the claim stopped in front of a message the full claim must judge.
HELD_AHEAD = "((SELECT rk FROM stop) IS NOT NULL) AS held_ahead"


def claim(t: Tables, *, single_queue: bool) -> TextClause:
    """Lease up to ``:limit`` plain messages of ``:queue`` (``single_queue``) or ``:queues``
    to ``:owner``, stopping at the first that is not plain (one row of NULLs with
    ``held_ahead`` when nothing was claimed)."""
    return text(
        f"WITH {_claim_ctes(t, single_queue=single_queue)} "
        f"SELECT c.*, {HELD_AHEAD} FROM (SELECT 1) one LEFT JOIN claimed c ON true"
    )


def ack_claim(t: Tables, *, single_queue: bool) -> TextClause:
    """A busy worker's acks and its refill claim of plain messages in one statement: the
    acks are the full ack's (``leases.ack_ctes``: a run's next message is made ready in the
    same statement, as a crash between two statements must not leave it parked). Every
    claimed row comes back with the ids the acks removed, the owed runs and gates, and
    ``held_ahead``."""
    return text(
        f"WITH {leases.ack_ctes(t)}, {_claim_ctes(t, single_queue=single_queue)} "
        f"SELECT c.*, (SELECT array_agg(id) FROM del) AS acked_ids, {OWED}, {HELD_AHEAD} "
        f"FROM (SELECT 1) one LEFT JOIN claimed c ON true WHERE {NOTIFIED}"
    )


def ack_outside_runs_claim(t: Tables, *, single_queue: bool) -> TextClause:
    """``ack_claim`` whose acks are all of deliveries outside any run (the plan holds no
    promotion of a run: on a backlog of plain tasks every statement of a draining worker)."""
    return text(
        f"WITH {leases.ack_outside_runs_ctes(t)}, {_claim_ctes(t, single_queue=single_queue)} "
        f"SELECT c.*, (SELECT array_agg(id) FROM del) AS acked_ids, {leases.OWED_GATES}, "
        f"{HELD_AHEAD} FROM (SELECT 1) one LEFT JOIN claimed c ON true"
    )
