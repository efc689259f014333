"""SQLite: the claim reads the claim index whatever ``ANALYZE`` taught the planner.

On an analyzed table of a few thousand messages, with one row in the limits table, SQLite's
planner chose a full scan of the messages for the claim's candidates (2.2 ms per claim against
0.17 ms at 2,000 messages, twelve times the cost, and more as the table grows until the
statistics change again). The claim names its index (``INDEXED BY``), so its plan is the same
on any table."""

from __future__ import annotations

import re
import uuid

import pytest
from sqlalchemy import text

from sqlease import NewMessage, Store

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def test_an_analyzed_claim_with_limits_reads_the_claim_index(store: Store) -> None:
    store.enqueue_many(
        [NewMessage("q", "x" * 200, task_id=str(uuid.uuid4())) for _ in range(2_000)]
    )
    store.set_limits({"queue:other": 3})
    with store.engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE")
    messages = store.tables.messages.name
    for name, params in (
        ("claim_single", {"queue": "q"}),
        ("claim", {"queues": '["q", "r"]'}),
    ):
        statement = getattr(store.driver.sql, name)
        with store.engine.connect() as conn:
            plan = conn.execute(
                text(f"EXPLAIN QUERY PLAN {statement.text}"),
                {"owner": "w", "lease_ms": 1000, "limit": 32, "now": None, **params},
            ).all()
        details = [str(row[-1]) for row in plan]
        scans = [d for d in details if re.match(rf"SCAN (m|{messages})\b", d)]
        assert not scans, f"{name} reads the messages table whole: {details}"
        assert any(f"{messages}_claim_ix" in d for d in details), details
