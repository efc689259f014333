"""Group publish benchmark: the wall time of ``group(noop.s() for _ in range(N)).apply_async()``
(no worker running, no result backend) on sqlease beside Redis and RabbitMQ, in one run.

Brokers:
- ``sqlease-pg``, ``sqlease-sqlite``: a group published as one batch (sqlease.batch());
- ``sqlease-pg-each``, ``sqlease-sqlite-each``: the same group published one message at a
  time, as before batches (the group's batch wrapper taken off in that process: each task is
  then a single publish, one commit each, the single publish's unchanged path);
- ``redis``; ``rabbitmq``; ``rabbitmq-confirm`` (publisher confirms:
  ``broker_transport_options={"confirm_publish": True}``, each publish waits for the broker's
  confirmation, as each sqlease publish waits for its commit);
- ``memory``: Kombu's in-memory transport, no broker at all: what Celery itself costs to
  build and publish the group's messages, the floor under every broker's time.

Each round runs every broker once, in a rotated order (rounds alternate), each in a process of
its own, on a fresh database (PostgreSQL: a new database per measurement; SQLite: a new file;
Redis: a flushed database; RabbitMQ: a new queue). In the process: the app connects and
publishes a warm-up group of 10 (connections, queue declaration, tables), then the timed group.
Ratios per round (the other's time over sqlease's: above 1, sqlease is faster) and their
medians.

Usage: python benchmarks/group_publish.py [--tasks 1000] [--rounds 3] [--only a,b]
[--output FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

PG = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS = "redis://127.0.0.1:6379/13"
AMQP = "amqp://guest:guest@127.0.0.1:5672//"

BROKERS = [
    "sqlease-pg",
    "sqlease-pg-each",
    "sqlease-sqlite",
    "sqlease-sqlite-each",
    "redis",
    "rabbitmq",
    "rabbitmq-confirm",
    "memory",
]

#: (ratio name, numerator: the slower one's time, denominator: sqlease's time)
RATIOS = [
    ("pg_vs_pg_each", "sqlease-pg-each", "sqlease-pg"),
    ("pg_vs_redis", "redis", "sqlease-pg"),
    ("pg_vs_rabbitmq", "rabbitmq", "sqlease-pg"),
    ("pg_vs_rabbitmq_confirm", "rabbitmq-confirm", "sqlease-pg"),
    ("sqlite_vs_sqlite_each", "sqlease-sqlite-each", "sqlease-sqlite"),
    ("sqlite_vs_redis", "redis", "sqlease-sqlite"),
    ("sqlite_vs_rabbitmq", "rabbitmq", "sqlease-sqlite"),
    ("sqlite_vs_rabbitmq_confirm", "rabbitmq-confirm", "sqlease-sqlite"),
    # Below 1: how close to Celery's own cost (the memory transport's time) sqlease comes.
    ("floor_vs_pg", "memory", "sqlease-pg"),
    ("floor_vs_sqlite", "memory", "sqlease-sqlite"),
    ("floor_vs_redis", "memory", "redis"),
]


# ---- the measuring process --------------------------------------------------------------


def measure(name: str, url: str, tasks: int, queue: str) -> dict[str, Any]:
    """In a process of its own: the seconds of one group of ``tasks`` after a warm-up."""
    from celery import Celery, group

    import sqlease  # noqa: F401  (the transport, and groups as batches)

    options: dict[str, Any] = {}
    if name == "rabbitmq-confirm":
        options["confirm_publish"] = True
    app = Celery("group_bench", broker=url, set_as_current=False)
    app.conf.update(
        broker_transport_options=options,
        task_default_queue=queue,
        task_ignore_result=True,
    )

    @app.task(name="bench.noop", shared=False)
    def noop() -> None:
        return None

    if name.endswith("-each"):
        # Before batches: each task of the group is a single publish with its own commit.
        from celery import canvas

        canvas.group.apply_async = canvas.group.apply_async.__wrapped__  # type: ignore[method-assign]
    group(noop.s() for _ in range(10)).apply_async()  # warm-up: connections, queue, tables
    start = time.perf_counter()
    result = group(noop.s() for _ in range(tasks)).apply_async()
    seconds = time.perf_counter() - start
    assert len(result.results) == tasks
    published = _count(name, url, queue, app)
    app.close()
    return {"seconds": seconds, "published": published}


def _count(name: str, url: str, queue: str, app: Any) -> int:
    """Messages in the queue after the timed group (warm-up's included): the check that the
    group was published whole."""
    if name.startswith("sqlease"):
        from sqlease import Store

        return Store(url.removeprefix("sqlease+")).size(queue)
    with app.connection_for_write() as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).message_count)


# ---- the driver -------------------------------------------------------------------------


def fresh(name: str, tmp: Path, round_no: int) -> tuple[str, str, Any]:
    """A fresh database for one measurement: its URL, its queue and what removes it."""
    queue = f"gbench-{uuid.uuid4().hex[:8]}"
    if name.startswith("sqlease-pg"):
        import psycopg

        db = f"gbench_{round_no}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {db}")
        base, _ = PG.rsplit("/", 1)

        def drop() -> None:
            with psycopg.connect(PG, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")

        return f"sqlease+{base}/{db}", queue, drop
    if name.startswith("sqlease-sqlite"):
        path = tmp / f"{name}-{round_no}-{uuid.uuid4().hex[:6]}.db"
        return f"sqlease+sqlite:///{path}", queue, lambda: None
    if name == "memory":
        return "memory://", queue, lambda: None
    if name == "redis":
        import redis

        client = redis.Redis.from_url(REDIS)
        client.flushdb()
        return REDIS, queue, client.flushdb
    return AMQP, queue, lambda: _delete_amqp_queue(queue)


def _delete_amqp_queue(queue: str) -> None:
    from kombu import Connection

    with Connection(AMQP) as conn:
        conn.default_channel.queue_delete(queue)


def run_one(name: str, tasks: int, tmp: Path, round_no: int) -> dict[str, Any]:
    url, queue, cleanup = fresh(name, tmp, round_no)
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--child", name, url, str(tasks), queue],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{done.stdout}\n{done.stderr}")
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        cleanup()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        name, url, tasks, queue = sys.argv[2:6]
        print(json.dumps(measure(name, url, int(tasks), queue)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated brokers")
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    names = [n for n in BROKERS if not args.only or n in args.only.split(",")]
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        for r in range(args.rounds):
            shift = r % len(names)
            order = names[shift:] + names[:shift]  # rounds alternate the order
            results: dict[str, Any] = {}
            for name in order:
                results[name] = run_one(name, args.tasks, Path(tmp_dir), r)
                seconds = results[name]["seconds"]
                print(f"round {r + 1} {name:22s} {seconds * 1000:9.1f} ms", flush=True)
            ratios = {
                label: results[slow]["seconds"] / results[fast]["seconds"]
                for label, slow, fast in RATIOS
                if slow in results and fast in results
            }
            rounds.append({"order": order, "results": results, "ratios": ratios})
    medians = {
        name: statistics.median(r["results"][name]["seconds"] for r in rounds) for name in names
    }
    ratio_medians = {
        label: statistics.median(r["ratios"][label] for r in rounds)
        for label in rounds[0]["ratios"]
    }
    print("median seconds:", json.dumps({k: round(v, 4) for k, v in medians.items()}))
    print("median ratios:", json.dumps({k: round(v, 2) for k, v in ratio_medians.items()}))
    report = {
        "benchmark": "group_publish",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "tasks": args.tasks,
        "rounds": rounds,
        "median_seconds": medians,
        "median_ratios": ratio_medians,
        "note": "ratios: the other's time over sqlease's (above 1: sqlease is faster)",
    }
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
