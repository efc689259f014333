"""``sqlease tasks`` and the dashboard's task list with no filter at 1,000,000 task records: a
page of 50 at the start, in the middle and at the end of the list (keyset pages on
``tasks_created_ix``), read by ``Admin.tasks``, by the dashboard's read model
(``AdminViews.task_page``) and as the whole ``GET /tasks`` page the dashboard serves (read and
rendered, in process); and the dashboard's list filtered by queue, by a task name every record
has, and by a state.

    .venv/bin/python benchmarks/task_list.py --url postgresql://postgres@127.0.0.1:5432/test
    .venv/bin/python benchmarks/task_list.py --url sqlite:////tmp/task_list.db

Inserts the records once under the table prefix ``bench_list_`` (and 1,000 queued tasks),
then prints the median of 20 reads of each page and writes them to
``benchmarks/results/task_list-<date>-<dialect>.json``.
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

from sqlalchemy import text

from sqlease import Store
from sqlease.admin import Admin
from sqlease.ui._read.views import AdminViews

RESULTS = Path(__file__).parent / "results"

BASE_MS = 1_700_000_000_000
COLUMNS = "task_id, checkpoint, revision, created_at_ms, updated_at_ms, task_name, queue, attempt"
ROW = "'task-' || {n}, '{{}}', 0, {base} + {n}, {base} + {n}, 'app.t', 'celery', 1"


def fill(store: Store, count: int) -> None:
    table = store.tables.tasks.name
    with store.engine.begin() as conn:
        if conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one() >= count:
            return
        row = ROW.format(n="n", base=BASE_MS)
        if store.is_postgresql:
            source = f"FROM generate_series(1, {count}) AS n"
            conn.execute(text(f"INSERT INTO {table} ({COLUMNS}) SELECT {row} {source}"))
        else:
            numbers = (
                f"WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < {count})"
            )
            conn.execute(text(f"{numbers} INSERT INTO {table} ({COLUMNS}) SELECT {row} FROM g"))
    if store.is_postgresql:
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f"ANALYZE {table}"))
    for i in range(1000):
        store.enqueue("celery", "{}", task_id=f"live-{i}", task_name="app.live")


def median_ms(read: Callable[[], Any], rounds: int = 20) -> float:
    read()
    took = []
    for _ in range(rounds):
        started = time.perf_counter()
        read()
        took.append((time.perf_counter() - started) * 1000)
    return statistics.median(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--count", type=int, default=1_000_000)
    args = parser.parse_args()
    store = Store(args.url, table_prefix="bench_list_")
    fill(store, args.count)
    admin = Admin(store.engine.url, store=store)
    views = AdminViews(admin)
    figures: dict[str, float] = {}
    pages = {"first": None, "middle": args.count // 2, "last": 1000}
    for name, n in pages.items():
        cursor = None if n is None else f"{BASE_MS + n}:task-{n}"
        reads: dict[str, Callable[[], Any]] = {
            "Admin.tasks": lambda c=cursor: admin.tasks(limit=50, before=c),
            "dashboard read": lambda c=cursor: views.task_page(limit=50, before=c),
        }
        for what, read in reads.items():
            figures[f"{what}, {name}"] = median_ms(read)
    figures |= {
        "dashboard read, queue=celery": median_ms(lambda: views.task_page(queue="celery")),
        "dashboard read, name=app.t": median_ms(lambda: views.task_page(name="app.t")),
        "dashboard read, state=queued": median_ms(lambda: views.task_page(state="queued")),
        # the worst case of a filter on the records: a name no task has walks all of them
        "dashboard read, name no task has": median_ms(
            lambda: views.task_page(name="app.none"), rounds=5
        ),
    }
    figures |= http_pages(admin, args.count)
    for label, took in figures.items():
        print(f"{args.count:,} tasks, page of 50, {label}: {took:.2f} ms")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"task_list-{datetime.date.today()}-{store.driver.name}.json"
    out.write_text(json.dumps({"tasks": args.count, "median_ms": figures}, indent=2) + "\n")
    print(f"wrote {out}")


def http_pages(admin: Admin, count: int) -> dict[str, float]:
    """``GET /tasks`` through the dashboard's ASGI app (read, rendered, sent): the first page
    and one in the middle, as a browser asks for them."""
    from starlette.testclient import TestClient

    from sqlease.ui import create_app

    middle = f"{BASE_MS + count // 2}:task-{count // 2}"
    with TestClient(create_app(admin, read_only=True)) as client:

        def page(query: str) -> None:
            response = client.get(f"/tasks{query}")
            assert response.status_code == 200 and response.text.count('data-task="') == 50

        return {
            "GET /tasks, first": median_ms(lambda: page("")),
            "GET /tasks, middle": median_ms(lambda: page(f"?before={middle}")),
        }


if __name__ == "__main__":
    main()
