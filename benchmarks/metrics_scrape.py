"""One Prometheus scrape (``sqlease.metrics``) at 1,000,000 tasks on PostgreSQL.

    python benchmarks/metrics_scrape.py [postgresql://postgres@127.0.0.1:5432/test]

Creates a throw-away database, fills it with INSERT ... SELECT generate_series, times scrapes
and drops it. Two shapes:

- backlog: 1,000,000 messages in the messages table (3 queues; 90 % queued, 4 % scheduled,
  2 % running under 50 owners, 2 % paused or waiting, 2 % failed or cancelled), the worst
  case of the per-queue GROUP BY;
- history: 1,000,000 finished tasks (task rows and 3,000,000 events: enqueued, claimed,
  acked) and 10,000 messages; the first scrape folds every event into the totals, the next
  ones only those written since (here 30,000 new events between two scrapes).
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid

from prometheus_client import generate_latest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from sqlease.admin import Admin
from sqlease.metrics import build_registry
from sqlease.store import Store

PREFIX = "mb_"


def timed(registry, runs: int = 5) -> list[float]:
    took = []
    for _ in range(runs):
        started = time.perf_counter()
        generate_latest(registry)
        took.append((time.perf_counter() - started) * 1000)
    return took


def fill_messages(conn, count: int, now: int) -> None:
    conn.execute(
        text(
            f"INSERT INTO {PREFIX}messages (queue, payload, priority, available_at_ms, "
            "created_at_ms, task_id, state, reason, lease_owner, lease_expires_at_ms, attempt, "
            "max_attempts) SELECT (ARRAY['celery','reports','mail'])[1 + i % 3], '{}', 0, "
            "CASE WHEN i % 100 < 4 THEN :now + 3600000 ELSE :now - (i % 600000) END, "
            ":now - 700000, 'task-' || i, "
            "CASE WHEN i % 100 < 94 THEN 'ready' WHEN i % 100 < 96 THEN 'ready' "
            "WHEN i % 100 < 98 THEN 'parked' ELSE 'dead' END, "
            "CASE WHEN i % 100 IN (96) THEN 'paused' WHEN i % 100 = 97 THEN 'waiting_input' "
            "WHEN i % 100 = 98 THEN 'attempts_exhausted' WHEN i % 100 = 99 THEN 'cancelled' "
            "END, "
            "CASE WHEN i % 100 IN (94, 95) THEN 'w' || (i % 50) || ':1:x' END, "
            "CASE WHEN i % 100 IN (94, 95) THEN :now + 60000 END, "
            "CASE WHEN i % 100 IN (94, 95) THEN 1 ELSE 0 END, 3 "
            "FROM generate_series(1, :count) i"
        ),
        {"now": now, "count": count},
    )


def fill_history(conn, count: int, now: int, first_id: int = 1) -> None:
    conn.execute(
        text(
            f"INSERT INTO {PREFIX}tasks (task_id, task_name, queue, attempt, checkpoint, "
            "revision, created_at_ms, updated_at_ms) SELECT 'done-' || i, 'app.task', "
            "'celery', 1, '{}', 0, :now, :now FROM generate_series(:a, :b) i"
        ),
        {"now": now, "a": first_id, "b": first_id + count - 1},
    )
    conn.execute(
        text(
            f"INSERT INTO {PREFIX}events (task_id, message_id, attempt, kind, at_ms) "
            "SELECT 'done-' || i, i, k.attempt, k.kind, :now FROM generate_series(:a, :b) i "
            "CROSS JOIN (VALUES ('enqueued', 0), ('claimed', 1), ('acked', 1)) k(kind, attempt)"
        ),
        {"now": now - 60_000, "a": first_id, "b": first_id + count - 1},
    )


def main(base: str) -> None:
    name = f"sqlease_metrics_bench_{uuid.uuid4().hex[:6]}"
    admin_engine = create_engine(
        make_url(base).set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT"
    )
    with admin_engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(base).set(database=name).render_as_string(hide_password=False)
    store = Store(url, table_prefix=PREFIX)
    admin = Admin(store.engine.url, store=store)
    for queue in ("celery", "reports", "mail", "idle"):
        store.declare_queue(queue)
    now = store.now_ms()
    with store.engine.begin() as conn:
        fill_messages(conn, 1_000_000, now)
    try:
        raw = store.engine.raw_connection()
        raw.driver_connection.autocommit = True  # VACUUM runs outside a transaction
        cur = raw.cursor()
        cur.execute(f"VACUUM ANALYZE {PREFIX}messages")
        registry = build_registry(admin)
        generate_latest(registry)  # warm: the plan, the buffers
        backlog = timed(registry)
        print(
            f"backlog, 1,000,000 messages: scrape ms {[round(t) for t in backlog]}, "
            f"median {statistics.median(backlog):.0f}"
        )
        cur.execute(f"TRUNCATE {PREFIX}messages")
        with store.engine.begin() as conn:
            fill_messages(conn, 10_000, now)
            fill_history(conn, 1_000_000, now)
        cur.execute(f"VACUUM ANALYZE {PREFIX}messages")
        cur.execute(f"VACUUM ANALYZE {PREFIX}events")
        first = timed(registry, runs=1)
        with store.engine.begin() as conn:
            fill_history(conn, 10_000, now + 1, first_id=1_000_001)
        cur.execute(f"ANALYZE {PREFIX}events")
        steady_new = timed(registry, runs=1)
        steady = timed(registry)
        print(
            f"history, 1,000,000 finished tasks and 3,000,000 events: first scrape "
            f"{first[0]:.0f} ms (folds every event in), after 30,000 new events "
            f"{steady_new[0]:.0f} ms, with nothing new {statistics.median(steady):.0f} ms "
            f"(median of {[round(t) for t in steady]})"
        )
        text_out = generate_latest(registry).decode()
        print(f"{len(text_out.splitlines())} lines, {len(text_out)} bytes")
        raw.close()
    finally:
        store.engine.dispose()
        with admin_engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin_engine.dispose()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "postgresql://postgres@127.0.0.1:5432/test")
