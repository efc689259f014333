"""PostgreSQL: the messages parked behind their run, parked at enqueue and made ready by the
statement that finishes the run's head, with no promotion lost between two statements that
run at once (sqlease._db.held_tables).

An enqueue into a run and a statement that finishes a member of it (an ack, a failure) each
read the run's members in their own snapshot, taken when the statement started: each can
miss the other's commit. Both upsert the run's ``run_order`` row, which serializes them
(the second waits for the first's commit) and, by comparing the version its snapshot shows
with the one its upsert produced, tells the second that the first committed after its
snapshot was taken:

- an enqueue that cannot trust its snapshot inserts its message ready, not parked (the
  claim's own head check keeps a run in order: parking only keeps the claim's scan short);
- a finishing statement that cannot trust its snapshot cannot see the message it would make
  ready: it names the run in its answer (``owed``), and the caller promotes it in a
  statement of its own (``promote_runs``), whose snapshot does see it.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

from sqlease._db.tables import Tables

#: The new message's run (NULL: none).
RUN = "CAST(:run_id AS TEXT)"


def enqueue_ctes(t: Tables) -> str:
    """CTEs ``hs`` (the run's version as the snapshot shows it) and ``hb`` (the upserted
    one) of a publish into the run ``:run_id`` (nothing without a run)."""
    ro = t.run_order.name
    return (
        f"hs AS (SELECT version FROM {ro} WHERE run_id = {RUN}), "
        f"hb AS (INSERT INTO {ro} AS o (run_id, version) SELECT {RUN}, 1 "
        f"WHERE {RUN} IS NOT NULL ON CONFLICT (run_id) DO UPDATE SET version = o.version + 1 "
        "RETURNING o.version), "
    )


def parks(t: Tables) -> str:
    """The new message waits for its run: it has one, an earlier message of it is
    unfinished, and no member left the run since the snapshot (``enqueue_ctes``)."""
    return (
        f"({RUN} IS NOT NULL AND (SELECT version FROM hb) = "
        "COALESCE((SELECT version FROM hs), 0) + 1 "
        f"AND EXISTS (SELECT 1 FROM {t.messages.name} h WHERE h.run_id = {RUN} "
        "AND h.state IN ('ready', 'parked')))"
    )


def promote_ctes(t: Tables, source: str, removed: str) -> str:
    """CTEs after a statement that changed the messages ``source`` (a CTE with ``id``,
    ``run_id`` and ``queue``): of each run among them whose head left it (``removed``, a
    predicate on ``source``'s row), the new head is made ready if it waited parked
    (``hp``), its queue notified (``hn``), and the runs this snapshot cannot judge are
    named (``ho``). The statement's final SELECT must read ``hn`` and ``ho``."""
    m, ro = t.messages.name, t.run_order.name
    return (
        f"hv AS (SELECT DISTINCT s.run_id FROM {source} s WHERE s.run_id IS NOT NULL "
        f"AND {removed}), "
        f"hs AS (SELECT o.run_id, o.version FROM {ro} o WHERE o.run_id IN "
        "(SELECT run_id FROM hv)), "
        f"hb AS (INSERT INTO {ro} AS o (run_id, version) SELECT run_id, 1 FROM hv "
        "ORDER BY run_id ON CONFLICT (run_id) DO UPDATE SET version = o.version + 1 "
        "RETURNING o.run_id, o.version), "
        # The statement's own changes are not in its snapshot: its removed rows are left out.
        "hh AS (SELECT DISTINCT ON (h.run_id) h.run_id, h.id, h.state, h.reason "
        f"FROM {m} h WHERE h.run_id IN (SELECT run_id FROM hv) "
        "AND h.state IN ('ready', 'parked') "
        f"AND h.id NOT IN (SELECT s.id FROM {source} s WHERE {removed}) "
        "ORDER BY h.run_id, h.id), "
        f"hp AS (UPDATE {m} p SET state = 'ready', reason = NULL FROM hh "
        "WHERE p.id = hh.id AND hh.state = 'parked' AND hh.reason = 'run' "
        "AND p.state = 'parked' AND p.reason = 'run' RETURNING p.id, p.queue), "
        "hn AS (SELECT pg_notify(CAST(:channel AS TEXT), q.queue) "
        "FROM (SELECT DISTINCT queue FROM hp) q), "
        "ho AS (SELECT b.run_id FROM hb b LEFT JOIN hs s ON s.run_id = b.run_id "
        "WHERE b.version <> COALESCE(s.version, 0) + 1)"
    )


#: The final SELECT's condition that makes the notifications' CTE run.
NOTIFIED = "(SELECT count(*) FROM hn) >= 0"
#: The runs owed a promotion, as an array (NULL when none); and the gates whose places the
#: statement freed (its CTE ``ds``, the slots it deleted), which the caller promotes in a
#: statement of its own (sqlease._db.postgresql.gates).
OWED = (
    "(SELECT array_agg(run_id) FROM ho) AS owed_runs, "
    "(SELECT array_agg(DISTINCT gate) FROM ds) AS owed_gates"
)


def bump_runs(t: Tables) -> TextClause:
    """The first statement of ``promote_runs``: the runs' rows, upserted in one order, so
    that an enqueue into them either committed before (the next statement sees its message)
    or waits and then knows its snapshot is stale."""
    ro = t.run_order.name
    return text(
        f"INSERT INTO {ro} AS o (run_id, version) "
        "SELECT DISTINCT r, 1 FROM unnest(CAST(:runs AS TEXT[])) AS u(r) ORDER BY r "
        "ON CONFLICT (run_id) DO UPDATE SET version = o.version + 1"
    )


def promote_runs(t: Tables) -> TextClause:
    """The second: each run's head, made ready if it waits parked behind its run; the queues
    of those made ready are notified."""
    m = t.messages.name
    return text(
        f"WITH hh AS (SELECT (SELECT h.id FROM {m} h WHERE h.run_id = u.r "
        "AND h.state IN ('ready', 'parked') ORDER BY h.id LIMIT 1) AS id "
        "FROM (SELECT DISTINCT r FROM unnest(CAST(:runs AS TEXT[])) AS u(r)) u), "
        f"hp AS (UPDATE {m} p SET state = 'ready', reason = NULL FROM hh "
        "WHERE p.id = hh.id AND p.state = 'parked' AND p.reason = 'run' "
        "RETURNING p.id, p.queue), "
        "hn AS (SELECT pg_notify(CAST(:channel AS TEXT), q.queue) "
        "FROM (SELECT DISTINCT queue FROM hp) q) "
        f"SELECT id FROM hp WHERE {NOTIFIED}"
    )
