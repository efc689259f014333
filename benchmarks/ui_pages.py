"""The dashboard's reads at 1,000,000 messages (and their 1,000,000 task records) on
PostgreSQL: a throwaway database filled by INSERT ... SELECT generate_series, then each read of
sqlease.ui._read.views timed (median of 5 after one warm-up). Drops the database at the end.
With no state the task list reads the task records; with a state, the messages.

    python benchmarks/ui_pages.py [--url postgresql://postgres@127.0.0.1:5432/test] [--rows N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from sqlease import Admin, Store
from sqlease.ui._read.views import AdminViews

RESULTS = Path(__file__).parent / "results"
NAMES = [f"shop.task_{i}" for i in range(10)]


def fill(store: Store, rows: int, now: int) -> None:
    m, e, k = store.tables.messages.name, store.tables.events.name, store.tables.tasks.name
    # 70% ready (1 in 50 of them leased, 1 in 20 scheduled), 10% parked (half waiting), 20%
    # dead (1 in 10 of them cancelled); 5 queues; 1 in 100 in one of 1,000 runs; ten task
    # names in the Celery header, one of them (task_9) rare: 1 in 10,000.
    fill_messages = f"""
    INSERT INTO {m} (queue, payload, priority, available_at_ms, created_at_ms, run_id,
                     task_id, state, reason, lease_owner, lease_expires_at_ms, attempt,
                     max_attempts)
    SELECT 'q' || (g % 5),
           '{{"body": "W1tdLCB7fSwge31d", "content-type": "application/json", '
             || '"headers": {{"task": "shop.task_'
             || CASE WHEN g % 10000 = 0 THEN 9 ELSE g % 9 END || '", "id": "t' || g || '"}}, '
             || '"properties": {{"body_encoding": "base64"}}}}',
           0,
           CASE WHEN g % 20 = 1 THEN :now + 3600000 ELSE :now - (:rows - g) * 10 END,
           :now - (:rows - g) * 10,
           CASE WHEN g % 100 = 7 THEN 'run-' || (g % 1000) END,
           't' || g,
           CASE WHEN g % 10 < 7 THEN 'ready' WHEN g % 10 = 7 THEN 'parked' ELSE 'dead' END,
           CASE WHEN g % 10 = 7 THEN (CASE WHEN g % 20 = 7 THEN 'waiting_approval'
                                            ELSE 'paused' END)
                WHEN g % 10 >= 8 THEN (CASE WHEN g % 100 = 8 THEN 'cancelled'
                                             ELSE 'attempts_exhausted' END) END,
           CASE WHEN g % 10 < 7 AND g % 50 = 3 THEN 'host-' || (g % 8) || ':1:abc' END,
           CASE WHEN g % 10 < 7 AND g % 50 = 3 THEN :now + 60000 END,
           1, 3
    FROM generate_series(1, :rows) AS g
    """
    fill_events = f"""
    INSERT INTO {e} (task_id, message_id, attempt, kind, data, at_ms)
    SELECT 't' || g, g, 1, CASE WHEN g % 3 = 0 THEN 'acked' ELSE 'claimed' END, NULL,
           :now - (:rows - g) * 10
    FROM generate_series(1, :rows) AS g
    """
    # Each message's task record (publish writes one): name, queue, run, creation time.
    fill_tasks = f"""
    INSERT INTO {k} (task_id, checkpoint, revision, run_id, created_at_ms, updated_at_ms,
                     task_name, queue, attempt)
    SELECT 't' || g, '{{}}', 0, CASE WHEN g % 100 = 7 THEN 'run-' || (g % 1000) END,
           :now - (:rows - g) * 10, :now - (:rows - g) * 10,
           'shop.task_' || CASE WHEN g % 10000 = 0 THEN 9 ELSE g % 9 END, 'q' || (g % 5), 1
    FROM generate_series(1, :rows) AS g
    """
    with store.engine.begin() as conn:
        conn.execute(text(fill_messages), {"rows": rows, "now": now})
        conn.execute(text(fill_events), {"rows": rows, "now": now})
        conn.execute(text(fill_tasks), {"rows": rows, "now": now})
    with store.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(text(f"VACUUM ANALYZE {m}"))
        conn.execute(text(f"VACUUM ANALYZE {e}"))
        conn.execute(text(f"VACUUM ANALYZE {k}"))


def timed(fn: Callable[[], Any]) -> float:
    fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    base = make_url(args.url).set(drivername="postgresql+psycopg")
    server = create_engine(base, isolation_level="AUTOCOMMIT")
    name = "sqlease_ui_bench"
    with server.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = base.set(database=name).render_as_string(hide_password=False)
    try:
        store = Store(url)
        now = store.now_ms()
        start = time.perf_counter()
        fill(store, args.rows, now)
        print(f"filled {args.rows:,} messages and events in {time.perf_counter() - start:.1f} s")
        views = AdminViews(Admin(url, store=store))
        middle = args.rows // 2  # a message id, for the lists filtered by state
        created = now - (args.rows - middle) * 10
        cursor = f"{created}:t{middle}"  # a task record's, for the list of every task
        reads: dict[str, Callable[[], Any]] = {
            "overview (Admin.stats + cancelled)": views.overview,
            "workers": views.workers,
            "throughput (30 min)": views.throughput,
            "runs": views.runs,
            "run (one run's tasks)": lambda: views.run("run-7"),
            "page 1, no filter (task records)": lambda: views.task_page(),
            "page in the middle (before=cursor)": lambda: views.task_page(before=cursor),
            "state=failed": lambda: views.task_page(state="failed"),
            "state=failed, middle": lambda: views.task_page(state="failed", before=middle),
            "state=cancelled": lambda: views.task_page(state="cancelled"),
            "state=waiting": lambda: views.task_page(state="waiting"),
            "state=running": lambda: views.task_page(state="running"),
            "state=scheduled": lambda: views.task_page(state="scheduled"),
            "queue=q3": lambda: views.task_page(queue="q3"),
            "state=queued, queue=q3": lambda: views.task_page(state="queued", queue="q3"),
            "name=shop.task_1 (common)": lambda: views.task_page(name="shop.task_1"),
            "name=shop.task_9 (1 in 10,000)": lambda: views.task_page(name="shop.task_9"),
            "run_id=run-7": lambda: views.task_page(run_id="run-7"),
            "state=queued, name=shop.task_9": lambda: views.task_page(
                state="queued", name="shop.task_9"
            ),
            "state=queued, run_id=run-7": lambda: views.task_page(state="queued", run_id="run-7"),
            "search by task id": lambda: views.task_page(search=f"t{args.rows // 3}"),
            "time range (last 10 s)": lambda: views.task_page(since_ms=now - 10_000),
            "time range (until 1 h ago)": lambda: views.task_page(until_ms=now - 3_600_000),
            "task detail (Admin.task)": lambda: views.admin.task(f"t{args.rows // 3}"),
        }
        width = max(map(len, reads))
        figures = {}
        for label, fn in reads.items():
            figures[label] = timed(fn)
            print(f"{label:<{width}}  {figures[label]:8.1f} ms")
        out = RESULTS / f"ui_pages-{datetime.date.today()}.json"
        out.write_text(json.dumps({"rows": args.rows, "median_ms": figures}, indent=2) + "\n")
        print(f"wrote {out}")
        store.engine.dispose()
    finally:
        from sqlease._db.engine import dispose_all

        dispose_all(close=True)
        with server.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        server.dispose()


if __name__ == "__main__":
    main()
