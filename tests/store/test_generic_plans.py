"""The hot path's statements find their rows through indexes under generic plans, on tables
that autovacuum has analyzed.

sqlease's hot engine runs with ``plan_cache_mode = force_generic_plan`` and psycopg prepares
a statement after five executions, so in production these statements run on generic plans,
planned from the statistics of the moment. A generic plan does not know ``:limit``: it
estimates a claim's candidates at a tenth of the backlog. With that estimate, on an analyzed
table of 5,000 to 50,000 messages, PostgreSQL joined the candidates to a sequential scan of
every message, so each claim read the whole backlog (12 ms instead of 0.7 at 40,000).

The tables here are filled and analyzed at that size. Each statement is prepared and
explained under a forced generic plan. A plan may read no table that grows with the traffic
whole (``test_retention_plans.big_table_scans``).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from sqlalchemy import text

from sqlease import Store

from .test_retention_plans import big_table_scans, filled

pytestmark = pytest.mark.pg

NOW = 1_800_000_000_000
#: Inside the size range where the old claim's generic plan scanned the table.
ROWS = 20_000

#: The statements of the hot engine (enqueue, claims, acks, renewals, transitions, fenced
#: writes, task rows, results, the idle worker's offer). Not ``leased_to_owner``: a closing
#: worker's one read of what it still holds, on the planned engine.
HOT = (
    "enqueue",
    "enqueue_plain",
    "take",
    "claim",
    "claim_single",
    "ack_claim",
    "ack_claim_single",
    "renew",
    "ack",
    "release_run",
    "transition",
    "lease_check",
    "run_lease",
    "task_cas",
    "task_get",
    "message_get",
    "event_insert",
    "result_put",
    "result_put_offer",
    "ack_offer",
    "ack_outside_runs_offer",
    "ack_outside_runs",
    "ack_outside_runs_claim",
    "ack_outside_runs_claim_single",
    "claim_plain",
    "claim_plain_single",
    "ack_claim_plain",
    "ack_claim_plain_single",
    "ack_outside_runs_claim_plain",
    "ack_outside_runs_claim_plain_single",
)

#: Ready messages in one queue, no runs, each with its task row, event and result: the
#: shape a backlog of plain Celery tasks has.
FILL = {
    "messages": (
        "queue, payload, priority, available_at_ms, created_at_ms, task_id, state, "
        "attempt, max_attempts",
        "'celery', '{}', 0, :now, :now, 't' || i, 'ready', 0, 3",
    ),
    "tasks": (
        "task_id, created_at_ms, updated_at_ms",
        "'t' || i, :now, :now",
    ),
    "events": ("task_id, message_id, attempt, kind, at_ms", "'t' || i, i, 0, 'enqueued', :now"),
    "results": (
        "key, value, state, expires_at_ms, updated_at_ms",
        "'celery-task-meta-t' || i, 'x', 'SUCCESS', :now + 86400000, :now",
    ),
}


@pytest.fixture(scope="module")
def pg_store(pg_database_url: str) -> Store:
    return filled(pg_database_url, FILL, dict.fromkeys(FILL, ROWS), NOW)


def generic_plan(store: Store, statement: Any) -> str:
    """EXPLAIN of ``statement``'s generic plan, as the hot engine's prepared statement runs
    it: PREPARE with ``$n`` parameters (types inferred), EXECUTE with NULLs (a generic plan
    does not depend on the values)."""
    sql = str(statement.compile(dialect=store.engine.dialect))
    names: list[str] = []

    def number(found: re.Match[str]) -> str:
        if found.group(1) not in names:
            names.append(found.group(1))
        return f"${names.index(found.group(1)) + 1}"

    prepared = re.sub(r"%\((\w+)\)s", number, sql).replace("%%", "%")
    arguments = f"({', '.join(['NULL'] * len(names))})" if names else ""
    with store.engine.connect() as conn:
        conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql(f"PREPARE hot AS {prepared}")
        rows = conn.exec_driver_sql(f"EXPLAIN EXECUTE hot{arguments}")
        explained = "\n".join(r[0] for r in rows)
        conn.exec_driver_sql("DEALLOCATE hot")  # a prepared statement outlives a rollback
        conn.rollback()
    return explained


def test_no_hot_statement_reads_a_big_table_whole(pg_store: Store) -> None:
    scans = {
        name: big_table_scans(pg_store, generic_plan(pg_store, getattr(pg_store.sql, name)))
        for name in HOT
    }
    assert {name: tables for name, tables in scans.items() if tables} == {}


def test_the_check_sees_the_join_that_scanned_the_backlog(pg_store: Store) -> None:
    # The claim's UPDATE as it was: candidates joined to messages by id alone.
    m = pg_store.tables.messages.name
    old = text(
        f"WITH cand AS (SELECT id FROM {m} WHERE state = 'ready' AND queue = :queue "
        f"ORDER BY priority DESC, available_at_ms, id LIMIT :limit) "
        f"UPDATE {m} SET attempt = attempt + 1 FROM cand c WHERE {m}.id = c.id RETURNING {m}.id"
    )
    assert big_table_scans(pg_store, generic_plan(pg_store, old)) == [m]
    new = text(
        f"WITH cand AS (SELECT id FROM {m} WHERE state = 'ready' AND queue = :queue "
        f"ORDER BY priority DESC, available_at_ms, id LIMIT :limit) "
        f"UPDATE {m} SET attempt = attempt + 1 FROM cand c WHERE {m}.id = c.id "
        f"AND {m}.id = ANY(ARRAY(SELECT id FROM cand)) RETURNING {m}.id"
    )
    assert big_table_scans(pg_store, generic_plan(pg_store, new)) == []
