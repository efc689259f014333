"""Several processes publishing at once: where the CPU goes, and what PostgreSQL's NOTIFY does
to group commit.

**Celery** (``--producers`` processes, each with its own app, splitting ``--tasks`` no-op
``delay()`` calls once all are connected; ``celery_bench.py``'s brokers and app): publishes per
second, the publishing processes' CPU per publish (``os.times`` in each, around its loop),
and the broker server's CPU per publish (``/proc`` of every process of the server's name:
``postgres``, ``redis-server``, ``beam.smp``; read while the publishers' connections are still
open, since a PostgreSQL backend's CPU leaves ``/proc`` with it).

**Statements** (psycopg, no Celery): 1 and ``--producers`` processes, each with its own
connection in autocommit, inserting a 300-byte row ``--rows`` times into a table of their
own, every commit waiting for the WAL flush: the bare insert; the insert with a
``pg_notify`` in the same statement (as sqlease's publish wakes workers); the insert and
then the notification in a second transaction in the same round trip (a pipeline).
PostgreSQL takes a database-wide lock at the commit of a transaction that notified and holds
it to the commit's end, so notifying commits cannot share a WAL flush.

Rounds alternate the order; medians of the rounds are printed as Markdown and written to
``results/publishers-<date>.json``.

    .venv/bin/python benchmarks/publishers.py [--rounds 3] [--producers 4] [--tasks 8000]
        [--rows 2000] [--only sqlease-pg,sqlease-pg-publish-nowait,redis,rabbitmq]
        [--output FILE.json]

Needs PostgreSQL (``BENCH_PG_URL``) and, for the baselines, Redis and RabbitMQ.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from celery_bench import (
    HERE,
    PG,
    Counter,
    app_for,
    broker_env,
    brokers,
    drop_tables,
    server_cpu,
    shares,
    write_results,
)

#: The broker server's processes, by name (``/proc/<pid>/comm``).
SERVERS = {"sqlease": "postgres", "redis": "redis-server", "rabbitmq": "beam.smp"}


def _celery_publisher(env: dict[str, str], count: int, barrier: Any, answers: Any) -> None:
    os.environ.update(env)
    sys.path.insert(0, str(HERE))
    import bench_app

    bench_app.noop.delay()  # connected before the start
    barrier.wait()
    before = os.times()
    for _ in range(count):
        bench_app.noop.delay()
    after = os.times()
    answers.put(after.user + after.system - before.user - before.system)
    barrier.wait()  # connections kept open until the server's CPU is read


def celery_round(broker: Any, counter: Counter, tasks: int, producers: int) -> dict[str, Any]:
    prefix = f"pub{uuid.uuid4().hex[:8]}_"
    env = broker_env(broker, counter, prefix)
    mod = app_for(broker, None, env)
    server = SERVERS[broker.name.split("-")[0]]
    context = multiprocessing.get_context("spawn")
    barrier, answers = context.Barrier(producers + 1), context.Queue()
    workers = [
        context.Process(target=_celery_publisher, args=(env, n, barrier, answers))
        for n in shares(tasks, producers)
    ]
    try:
        for worker in workers:
            worker.start()
        barrier.wait(120)
        server_before = server_cpu(server)
        started = time.perf_counter()
        client = sum(answers.get(timeout=600) for _ in workers)
        elapsed = time.perf_counter() - started
        server_used = server_cpu(server) - server_before
        barrier.wait(60)
        for worker in workers:
            worker.join()
    finally:
        try:
            mod.app.control.purge()
        except Exception:
            pass
        if broker.name.startswith("sqlease"):
            drop_tables(prefix, kombu=False)
    return {
        "broker": broker.name,
        "per_s": round(tasks / elapsed, 1),
        "client_cpu_us": round(client / tasks * 1e6, 1),
        "server_cpu_us": round(server_used / tasks * 1e6, 1),
    }


#: The statements' variants: what each process runs per row.
INSERT = "INSERT INTO {t} (payload) VALUES (%s)"
NOTIFYING = (
    "WITH i AS (INSERT INTO {t} (payload) VALUES (%s) RETURNING id) "
    "SELECT pg_notify('{t}', 'q') FROM i"
)
VARIANTS = ("insert", "insert with pg_notify", "insert, then NOTIFY (pipelined)")


def _statement_publisher(variant: str, table: str, rows: int, barrier: Any, answers: Any) -> None:
    import psycopg

    payload = "x" * 300
    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute("SELECT 1")
        barrier.wait()
        started = time.perf_counter()
        for _ in range(rows):
            if variant == VARIANTS[0]:
                conn.execute(INSERT.format(t=table), (payload,), prepare=True)
            elif variant == VARIANTS[1]:
                conn.execute(NOTIFYING.format(t=table), (payload,), prepare=True)
            else:
                with conn.pipeline():
                    conn.execute(INSERT.format(t=table), (payload,), prepare=True)
                    conn.execute(f"SELECT pg_notify('{table}', 'q')", prepare=True)
        answers.put(time.perf_counter() - started)


def statements_round(variant: str, processes: int, rows: int) -> float:
    import psycopg

    table = f"pubrows_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, payload text)")
    context = multiprocessing.get_context("spawn")
    barrier, answers = context.Barrier(processes), context.Queue()
    workers = [
        context.Process(target=_statement_publisher, args=(variant, table, rows, barrier, answers))
        for _ in range(processes)
    ]
    try:
        for worker in workers:
            worker.start()
        slowest = max(answers.get(timeout=600) for _ in workers)
        for worker in workers:
            worker.join()
    finally:
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")
    return round(processes * rows / slowest, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=8000)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--only", default="sqlease-pg,sqlease-pg-publish-nowait,redis,rabbitmq")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    names = args.only.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="sqlease-publishers-"))
    # The brokers on the machine's own servers (not the throwaway Redis, not Kombu's SQL).
    known = {
        b.name: b
        for b in brokers(tmp, "unused")
        if b.name.split("-")[0] in SERVERS and not b.throwaway_redis and "sqlite" not in b.name
    }
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(
            f"--only: {', '.join(unknown)}: not measured here (one of {', '.join(known)})"
        )
    chosen = [known[name] for name in names]
    counter = Counter()
    celery_runs: list[dict[str, Any]] = []
    statement_runs: list[dict[str, Any]] = []
    for number in range(args.rounds):
        flip = number % 2 == 1
        for broker in reversed(chosen) if flip else chosen:
            row = celery_round(broker, counter, args.tasks, args.producers)
            row["round"] = number + 1
            celery_runs.append(row)
            print(row, flush=True)
        for processes in (1, args.producers):
            for variant in reversed(VARIANTS) if flip else VARIANTS:
                rate = statements_round(variant, processes, args.rows)
                found = {"variant": variant, "processes": processes, "per_s": rate}
                statement_runs.append({**found, "round": number + 1})
                print(found, flush=True)
    print(f"\n{args.producers} Celery processes publishing, medians of {args.rounds} rounds\n")
    print("| broker | `delay()`/s | publishers' CPU per publish | server's CPU per publish |")
    print("|---|---:|---:|---:|")
    medians: dict[str, Any] = {"celery": {}, "statements": {}}
    for name in names:
        runs = [r for r in celery_runs if r["broker"] == name]
        row = {
            k: statistics.median(r[k] for r in runs) for k in runs[0] if k.endswith(("_s", "_us"))
        }
        medians["celery"][name] = row
        print(
            f"| {name} | {row['per_s']:,.0f} | {row['client_cpu_us']:.0f} us | "
            f"{row['server_cpu_us']:.0f} us |"
        )
    print(f"\nDurable one-row inserts per second, medians of {args.rounds} rounds\n")
    print(f"| statement | 1 process | {args.producers} processes |")
    print("|---|---:|---:|")
    for variant in VARIANTS:
        rates = {
            p: statistics.median(
                r["per_s"]
                for r in statement_runs
                if r["variant"] == variant and r["processes"] == p
            )
            for p in (1, args.producers)
        }
        medians["statements"][variant] = rates
        print(f"| {variant} | {rates[1]:,.0f} | {rates[args.producers]:,.0f} |")
    path = write_results(
        "publishers",
        args.output,
        command=" ".join(sys.argv),
        producers=args.producers,
        tasks=args.tasks,
        rows=args.rows,
        rounds=args.rounds,
        celery=celery_runs,
        statements=statement_runs,
        medians=medians,
    )
    print(f"\nwritten {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
