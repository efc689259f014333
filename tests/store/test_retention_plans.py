"""Every prune statement of the maintenance pass reads its rows through an index on
PostgreSQL (migration 7), so that a pass costs what it deletes, not the size of the table.

The plans are read on tables filled and analyzed as in production: 20,000 rows each, of which
1% are past the retention (a pass runs every minute, so few rows are due at each). A plan
may not read one of the tables that grow with the traffic whole: no sequential scan, no index
scan without an index condition. ``runs``, ``offers``, ``locks`` and ``queues`` may be read
whole: they hold one row per live lease, idle worker, singleton and (bounded by the idle
expiry) queue.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from sqlalchemy import text

from sqlease import Store
from sqlease._core import retention
from sqlease._core.maintenance import leftover_statements

pytestmark = pytest.mark.pg

#: The tables that grow with the traffic.
BIG = ("messages", "events", "tasks", "results", "counters", "steps", "waits", "bindings")
NOW = 1_800_000_000_000
ROWS = 20_000
#: The messages table is the one the others' conditions look into; it is the biggest.
MESSAGES = 200_000
#: Partial indexes that hold exactly the rows their statement changes: read whole by design.
EXACT = ("messages_stray_ix",)

#: Per table: columns and the SELECT over generate_series(1, ROWS) AS i that fills them; a
#: row's time is NOW + (i - ROWS/100) s, so 1% are older than NOW.
FILL = {
    "messages": (
        "queue, payload, available_at_ms, created_at_ms, task_id, state, max_attempts",
        "'celery', '{}', :now, :now + (i - :due) * 1000, 't' || i, "
        "CASE WHEN i % 50 = 0 THEN 'dead' ELSE 'ready' END, 3",
    ),
    "events": ("task_id, kind, at_ms", "'e' || i, 'acked', :now + (i - :due) * 1000"),
    "tasks": (
        "task_id, created_at_ms, updated_at_ms",
        "'e' || i, :now + (i - :due) * 1000, :now + (i - :due) * 1000",
    ),
    "results": (
        "key, value, state, expires_at_ms, updated_at_ms",
        "'k' || i, 'x', CASE WHEN i % 50 = 0 THEN 'FAILURE' ELSE 'SUCCESS' END, "
        "CASE WHEN i % 50 = 0 THEN NULL ELSE :now + (i - :due) * 1000 END, "
        ":now + (i - :due) * 1000",
    ),
    "counters": ("key, value, expires_at_ms", "'c' || i, 1, :now + (i - :due) * 1000"),
    "steps": (
        "task_id, name, status, started_at_ms, finished_at_ms",
        "'e' || i, 's', 'succeeded', :now + (i - :due) * 1000, :now + (i - :due) * 1000",
    ),
    "waits": (
        "task_id, key, kind, status, created_at_ms",
        "'e' || i, 'k', 'input', 'waiting', :now + (i - :due) * 1000",
    ),
    "bindings": ("exchange, queue, routing_key", "'celeryev', 'celeryev.' || i, '#'"),
    "queues": (
        "name, created_at_ms, expires_ms, expires_at_ms",
        "'celeryev.' || i, :now, 60000, :now + (i - :due) * 1000",
    ),
}


def filled(url: str, fill: dict[str, tuple[str, str]], rows: dict[str, int], now: int) -> Store:
    """A store on new tables filled by ``fill`` (per table: columns and the SELECT over
    generate_series(1, rows) AS i; ``:due`` is 1% of the rows), then analyzed as autovacuum
    would."""
    from conftest import unique_prefix

    store = Store(url, table_prefix=unique_prefix())
    with store.engine.begin() as conn:
        for short, (columns, values) in fill.items():
            count = rows[short]
            conn.execute(
                text(
                    f"INSERT INTO {store.tables.name(short)} ({columns}) SELECT {values} "
                    "FROM generate_series(1, :rows) AS i"
                ),
                {"now": now, "due": count // 100, "rows": count},
            )
    with store.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        for short in fill:
            conn.execute(text(f"ANALYZE {store.tables.name(short)}"))
    return store


@pytest.fixture(scope="module")
def pg_store(pg_database_url: str) -> Store:
    rows = {short: MESSAGES if short == "messages" else ROWS for short in FILL}
    return filled(pg_database_url, FILL, rows, NOW)


def plan(store: Store, statement: Any) -> str:
    sql = str(
        statement.compile(dialect=store.engine.dialect, compile_kwargs={"literal_binds": True})
    ).replace("%%", "%")
    with store.engine.connect() as conn:
        rows = conn.execute(text(f"EXPLAIN {sql}").execution_options(no_parameters=True))
        explained = "\n".join(rows.scalars().all())
        conn.rollback()
    return explained


SCAN = re.compile(
    r"(Seq Scan on|Bitmap Heap Scan on|Index Scan using (\w+) on|Index Only Scan using (\w+) on) "
    r"(\w+)"
)


def _depth(line: str) -> int:
    return len(line) - len(line.lstrip(" -"))


def big_table_scans(store: Store, explained: str) -> list[str]:
    """The big tables the plan reads whole: by a sequential scan, or by an index scan with
    no index condition (all of the index, in its order), unless the index is one of EXACT."""
    big = {store.tables.name(short) for short in BIG}
    exact = {store.tables.name(short) for short in EXACT}
    lines = explained.splitlines()
    whole = []
    for number, line in enumerate(lines):
        found = SCAN.search(line)
        if found is None or found.group(4) not in big:
            continue
        kind, index, only, table = found.groups()
        if kind.startswith("Seq"):
            whole.append(table)
            continue
        depth = _depth(line)
        below = []
        for later in lines[number + 1 :]:
            if _depth(later) <= depth:
                break
            below.append(later)
        if kind.startswith("Bitmap"):  # the condition is on its Bitmap Index Scan
            used = re.findall(r"Bitmap Index Scan on (\w+)", "\n".join(below))
        else:  # its own details, not its subplans'
            below = below[: next((i for i, b in enumerate(below) if "->" in b), len(below))]
            used = [index or only]
        if set(used) <= exact:
            continue
        if not any("Index Cond" in b for b in below):
            whole.append(table)
    return whole


def prune_statements(store: Store) -> dict[str, Any]:
    from sqlalchemy import delete, select

    t = store.tables
    q = t.queues
    found: dict[str, Any] = {
        **retention.statements(store, NOW),
        **leftover_statements(store, NOW, ["w1@host.celery.pidbox", "celeryev.x"]),
        # expire_idle_queues: the due queues, then per queue its row, bindings and messages
        "idle_queues": select(q.c.name).where(q.c.expires_at_ms < NOW).limit(100),
        "idle_queue_row": delete(q).where(q.c.name == "x", q.c.expires_at_ms < NOW),
    }
    found["delete_queue_bindings"] = store.sql.delete_queue_bindings.bindparams(queue="x")
    found["delete_queue_messages"] = store.sql.delete_queue_messages.bindparams(queue="x", now=NOW)
    return found


def test_every_prune_statement_can_use_an_index(pg_store: Store) -> None:
    statements = prune_statements(pg_store)
    assert {"events", "dead_messages", "broadcasts_dropped", "idle_queues"} <= set(statements)
    scans = {
        name: big_table_scans(pg_store, plan(pg_store, statement))
        for name, statement in statements.items()
    }
    assert {name: tables for name, tables in scans.items() if tables} == {}


def test_the_check_finds_a_statement_without_an_index(pg_store: Store) -> None:
    from sqlalchemy import delete, select

    events, m = pg_store.tables.events, pg_store.tables.messages
    unindexed = delete(events).where(events.c.data == "x")  # no index on data
    assert big_table_scans(pg_store, plan(pg_store, unindexed)) == [events.name]
    # A whole index read in its order (no condition on its columns) counts as a scan too.
    whole_index = select(m.c.id).order_by(m.c.id).limit(5)
    assert big_table_scans(pg_store, plan(pg_store, whole_index)) == [m.name]
