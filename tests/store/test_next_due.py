"""When an idle worker's next delayed message is due (``next_due_in_ms``): the soonest due
time across priorities and queues, and a plan that reads a few index pages, not every
delayed message (it runs on every idle look and every ack that leaves a worker idle)."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import text

from sqlease import Store
from sqlease.testing import FakeClock
from sqlease.types import NewMessage


def test_the_soonest_due_time_across_priorities_and_queues(store: Store, clock: FakeClock) -> None:
    assert store.next_due_in_ms(["q", "r"]) is None
    store.enqueue("q", "now")  # due now: not "next"
    assert store.next_due_in_ms(["q"]) is None
    store.enqueue("q", "high, late", priority=9, delay_ms=5_000)
    store.enqueue("q", "low, soon", priority=0, delay_ms=700)
    store.enqueue("q", "middle", priority=4, delay_ms=3_000)
    store.enqueue("q", "negative", priority=-3, delay_ms=900)
    store.enqueue("r", "other queue", priority=2, delay_ms=400)
    store.enqueue("s", "not asked", delay_ms=10)
    assert store.next_due_in_ms(["q"]) == 700
    assert store.next_due_in_ms(["q", "r"]) == 400
    assert store.next_due_in_ms(["r", "q", "r"]) == 400
    assert store.next_due_in_ms(["nothing"]) is None
    clock.advance(750)  # "low, soon" is due now; the next is the negative priority's
    assert store.next_due_in_ms(["q"]) == 150
    clock.advance(200)
    assert store.next_due_in_ms(["q"]) == 2_050
    clock.advance(5_000)
    assert store.next_due_in_ms(["q", "r"]) is None


def test_parked_and_dead_messages_are_not_due(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "later", delay_ms=2_000)
    store.enqueue("q", "sooner", delay_ms=1_000)
    assert store.next_due_in_ms(["q"]) == 1_000
    clock.advance(1_000)
    (msg,) = store.claim(["q"], "w", lease_ms=10_000)
    assert store.next_due_in_ms(["q"]) == 1_000  # a leased message is not "next"
    store.fail(msg.fence, "boom")  # dead: never due again
    assert store.next_due_in_ms(["q"]) == 1_000


@pytest.mark.pg
def test_the_plan_reads_a_few_pages_with_many_delayed_messages(pg_database_url: str) -> None:
    from conftest import unique_prefix

    store = Store(pg_database_url, table_prefix=unique_prefix())
    now = store.now_ms()
    m = store.tables.messages.name
    with store.engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {m} (queue, payload, priority, available_at_ms, created_at_ms, "
                "state, attempt, max_attempts) SELECT 'q', 'x', i % 3, :now + 60000 + i, :now, "
                "'ready', 0, 3 FROM generate_series(1, 50000) AS i"
            ),
            {"now": now},
        )
        conn.execute(text(f"ANALYZE {m}"))
    store.enqueue_many([NewMessage("q", "due", delay_ms=0)], now=now)
    assert store.next_due_in_ms(["q"], now=now) == 60_001
    sql = str(store.sql.next_due.compile(dialect=store.engine.dialect))
    with store.engine.connect() as conn:
        driver = conn.connection.dbapi_connection
        assert driver is not None
        cursor = driver.cursor()
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, {"queues": ["q"], "now": now})
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Seq Scan on" not in plan.replace(f"Seq Scan on {store.tables.flow_limits.name}", "")
    pages = [int(n) for n in re.findall(r"Buffers: shared hit=(\d+)", plan)]
    # A scan of the 50,000 delayed messages' index entries reads hundreds of pages.
    assert pages and pages[0] < 80, plan


def test_sqlite_reads_a_few_index_entries_with_many_delayed_messages(tmp_path: object) -> None:
    """Counted in SQLite's virtual-machine steps (its progress handler), not in time: a scan
    of the 50,000 delayed messages' index entries takes millions of steps."""
    store = Store(f"sqlite:///{tmp_path}/due.db", table_prefix="d_")
    now = store.now_ms()
    m = store.tables.messages.name
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g "
                f"WHERE i < 50000) INSERT INTO {m} (queue, payload, priority, available_at_ms, "
                "created_at_ms, state, attempt, max_attempts) "
                "SELECT 'q', 'x', i % 3, :now + 60000 + i, :now, 'ready', 0, 3 FROM g"
            ),
            {"now": now},
        )
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    with store.engine.connect() as conn:
        driver = conn.connection.dbapi_connection
        assert driver is not None
        driver.set_progress_handler(count, 100)  # type: ignore[attr-defined]
        due = conn.execute(store.sql.next_due, {"queues": '["q"]', "now": now}).scalar()
        driver.set_progress_handler(None, 100)  # type: ignore[attr-defined]
    assert due == 60_001
    assert steps * 100 < 20_000, f"{steps * 100} steps"
