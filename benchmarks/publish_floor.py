"""Where a durable ``delay()`` on PostgreSQL spends its time: the floor under it.

Per call, in microseconds, one process, interleaved rounds (the median of ``--rounds``):

- ``select 1``: one autocommit round trip to the server (psycopg, no sqlease);
- ``insert, durable``: a one-row INSERT into a table with a primary key, autocommit: the
  round trip plus the commit's WAL flush (``synchronous_commit = on``);
- ``insert, no flush wait``: the same with ``synchronous_commit = off``;
- ``insert with pg_notify, durable``: the durable insert that also notifies, in the same
  statement, as sqlease's publish does (the difference is the notification's cost);
- ``Store.enqueue``: sqlease's publish statement (the message with its indexes, its
  ``enqueued`` event, its task row, the handoff-offer lookup and the ``NOTIFY``), durable and
  with ``publish_sync_commit=False``;
- ``Store.enqueue, no task id, durable``: a message without a task id, which has no
  ``enqueued`` event and no task row: the difference is theirs;
- ``Store.enqueue, delayed``: the same for a message due in a minute, which no idle worker
  can be handed, so its statement has no handoff lookup: the difference is that lookup's
  cost;
- ``Store.enqueue, into a run``: a message of one of 100 runs whose head is unfinished (it is
  parked behind its run; the run's order row is upserted): the same statement as the delayed
  one (no handoff lookup), so that is its like for like;
- ``Store.enqueue, into a full gate``: a message on a queue whose concurrency limit of 1 is
  taken (it waits at the gate until a worker's sweep parks it): the plain statement, so the
  plain durable enqueue is its like for like;
- ``delay()``: Celery's whole publish of a no-op task, on sqlease (both) and on Redis.

``--store-url`` runs the ``Store.enqueue`` cases on another database (a SQLite file: then
choose them with ``--only``, the others are PostgreSQL's).

Beside the wall time per call, the CPU the server spent per call (every process named
``postgres``, or ``redis-server`` for Redis, from ``/proc``, so nothing else may use that
server meanwhile): what each part of the publish costs the database, which several
publishers share (``benchmarks/publishers.py``).

So ``delay()`` = Celery's own work (about the Redis figure) + sqlease's statement, and the
statement can be no cheaper than the durable one-row insert.

    .venv/bin/python benchmarks/publish_floor.py [--calls 2000] [--rounds 3]

Prints a Markdown table; writes JSON to benchmarks/results/publish-floor-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
from celery import Celery
from celery_bench import server_cpu

import sqlease  # noqa: F401  (registers the transport)
from sqlease import Store
from sqlease.types import NewMessage

HERE = Path(__file__).resolve().parent
PG = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
PAYLOAD = "x" * 900  # about a Celery message's size


def per_call(fn: Callable[[], object], calls: int, server: str | None) -> tuple[float, float]:
    """Microseconds per call: wall time, and the CPU of the server's processes (``server``:
    their name; None: no server, 0)."""
    fn()
    cpu = server_cpu(server) if server else 0.0
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    wall = (time.perf_counter() - start) / calls * 1e6
    used = server_cpu(server) - cpu if server else 0.0
    return wall, used / calls * 1e6


def celery_app(broker: str, prefix: str, options: dict[str, object]) -> Celery:
    app = Celery(f"floor-{uuid.uuid4().hex[:6]}", broker=broker)
    if broker.startswith("sqlease"):
        app.conf.broker_transport_options = {"table_prefix": prefix, **options}

    @app.task(name="floor.noop", ignore_result=True)
    def noop() -> None:
        return None

    return app


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument(
        "--only", default="", help="case names separated by semicolons (default: all)"
    )
    parser.add_argument(
        "--store-url",
        default=None,
        help="the Store cases on this database instead (e.g. sqlite:////tmp/floor.db)",
    )
    args = parser.parse_args()
    prefix = f"floor{os.getpid()}_"
    conn = psycopg.connect(PG, autocommit=True)
    plain = f"{prefix}plain"
    conn.execute(f"CREATE TABLE {plain} (id bigserial PRIMARY KEY, payload text)")
    store_url = args.store_url or PG
    durable = Store(store_url, table_prefix=prefix)
    nowait = Store(store_url, table_prefix=prefix, publish_sync_commit=False)
    apps = {
        "delay(), sqlease": celery_app(f"sqlease+{PG}", prefix, {}),
        "delay(), sqlease, publish_sync_commit False": celery_app(
            f"sqlease+{PG}", prefix, {"publish_sync_commit": False}
        ),
        "delay(), Redis": celery_app("redis://127.0.0.1:6379/13", prefix, {}),
    }

    def insert(sync: bool, notify: bool = False) -> Callable[[], object]:
        conn.execute(f"SET synchronous_commit = {'on' if sync else 'off'}")
        sql = f"INSERT INTO {plain} (payload) VALUES (%s)"
        if notify:  # woken as sqlease's publish wakes workers
            sql = f"WITH i AS ({sql} RETURNING id) SELECT pg_notify('{plain}', 'q') FROM i"
        return lambda: conn.execute(sql, (PAYLOAD,))

    def enqueue(
        store: Store, delay_ms: int = 0, runs: int = 0, gate: bool = False, task: bool = True
    ) -> Callable[[], object]:
        count = iter(range(10**9))
        for r in range(runs):  # each run's head, left unfinished
            store.enqueue("floor-runs", PAYLOAD, run_id=f"run-{r}")
        queue = "floor-runs" if runs else "floor-gate" if gate else "floor"
        if gate:  # the queue's one place taken, as by a running task
            store.set_limits({"queue:floor-gate": 1})
            store.enqueue(queue, PAYLOAD)
            store.claim([queue], "holder", lease_ms=3_600_000, limit=1)
        return lambda: store.enqueue_many(
            [
                NewMessage(
                    queue,
                    PAYLOAD,
                    delay_ms=delay_ms,
                    run_id=f"run-{next(count) % runs}" if runs else None,
                    # Without a task id: no enqueued event, no task row.
                    task_id=str(uuid.uuid4()) if task else None,
                    task_name="floor.noop",
                )
            ]
        )

    cases: dict[str, Callable[[], Callable[[], object]]] = {
        "select 1": lambda: lambda: conn.execute("SELECT 1"),
        "insert, durable": lambda: insert(True),
        "insert, no flush wait": lambda: insert(False),
        "insert with pg_notify, durable": lambda: insert(True, notify=True),
        "Store.enqueue, durable": lambda: enqueue(durable),
        "Store.enqueue, publish_sync_commit False": lambda: enqueue(nowait),
        "Store.enqueue, no task id, durable": lambda: enqueue(durable, task=False),
        "Store.enqueue, delayed, durable": lambda: enqueue(durable, 60_000),
        "Store.enqueue, delayed, publish_sync_commit False": lambda: enqueue(nowait, 60_000),
        "Store.enqueue, into a run, durable": lambda: enqueue(durable, runs=100),
        "Store.enqueue, into a full gate, durable": lambda: enqueue(durable, gate=True),
        **{name: (lambda app=app: app.tasks["floor.noop"].delay) for name, app in apps.items()},
    }
    if args.only:
        wanted = [name.strip() for name in args.only.split(";") if name.strip()]
        unknown = [name for name in wanted if name not in cases]
        if unknown:
            parser.error(f"unknown --only case(s) {unknown}; known: {list(cases)}")
        cases = {name: cases[name] for name in wanted}
    found: dict[str, list[float]] = {name: [] for name in cases}
    server: dict[str, list[float]] = {name: [] for name in cases}

    def server_of(name: str) -> str | None:
        if "Redis" in name:
            return "redis-server"
        on_sqlite = name.startswith("Store.") and store_url.startswith("sqlite")
        return None if on_sqlite else "postgres"

    try:
        for n in range(args.rounds):
            names = list(cases) if n % 2 == 0 else list(reversed(cases))
            for name in names:
                wall, cpu = per_call(cases[name](), args.calls, server_of(name))
                found[name].append(wall)
                server[name].append(cpu)
        conn.execute("SET synchronous_commit = on")
    finally:
        conn.execute(f"DROP TABLE IF EXISTS {plain}")
        tables = conn.execute(
            "SELECT tablename FROM pg_tables WHERE tablename LIKE %s", (prefix + "%",)
        ).fetchall()
        for (name,) in tables:
            conn.execute(f"DROP TABLE IF EXISTS {name} CASCADE")
        for app in apps.values():
            if not app.conf.broker_url.startswith("sqlease"):
                with app.connection_for_write() as c:
                    c.default_channel.client.flushdb()  # type: ignore[attr-defined]
    medians = {name: statistics.median(v) for name, v in found.items()}
    server_medians = {name: statistics.median(v) for name, v in server.items()}
    print("| per call | µs (median of rounds) | server's CPU, µs | rounds |")
    print("|---|---:|---:|---|")
    for name, v in found.items():
        rounds = ", ".join(f"{x:.0f}" for x in v)
        print(f"| {name} | {medians[name]:.0f} | {server_medians[name]:.0f} | {rounds} |")
    # Each held kind against its like for like, per round (the same round's runs).
    pairs = {
        "into a run / delayed": (
            "Store.enqueue, into a run, durable",
            "Store.enqueue, delayed, durable",
        ),
        "into a full gate / plain": (
            "Store.enqueue, into a full gate, durable",
            "Store.enqueue, durable",
        ),
    }
    ratios = {}
    for label, (held, like) in pairs.items():
        if held in found and like in found:
            per_round = [h / p for h, p in zip(found[held], found[like], strict=True)]
            ratios[label] = {"rounds": per_round, "median": statistics.median(per_round)}
            rounds = ", ".join(f"{r:.2f}" for r in per_round)
            print(f"| {label} | {ratios[label]['median']:.2f}x | {rounds} |")
    output = args.output or HERE / "results" / f"publish-floor-{dt.date.today().isoformat()}.json"
    output.write_text(
        json.dumps(
            {
                "calls": args.calls,
                "rounds": found,
                "medians": medians,
                "server_cpu_rounds": server,
                "server_cpu_medians": server_medians,
                "ratios": ratios,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
