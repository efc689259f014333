"""Where an idle worker's start latency goes: the ``delay()`` call against the worker's side.

``celery_bench.py``'s idle start latency is ``delay()``-to-start, one task at a time with
the worker idle (50 ms between tasks). This splits each sample in two:

- **publish**: the ``delay()`` call itself, after 50 ms of quiet (the client's and the
  server's processes have gone idle, as in a real trickle of tasks);
- **worker side**: from ``delay()`` returning to the task body starting (the broker's
  delivery, the worker's event loop, the prefork pool).

For sqlease on PostgreSQL it also times, in the same process and after the same 50 ms of
quiet, ``SELECT 1`` (the round trip alone: what waking the server process costs on this
machine) and ``Store.enqueue`` (the publish statement without Celery).

Same worker as ``celery_bench.py`` (prefork ``-c 2``, prefetch multiplier 4). Rounds run
every broker once, in alternating order, each on fresh tables; medians of the rounds.

    .venv/bin/python benchmarks/idle_split.py [--samples 200] [--rounds 3]
        [--only sqlease-pg,sqlease-pg-publish-nowait,redis,rabbitmq]

Prints a Markdown table; writes JSON to benchmarks/results/idle-split-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from celery_bench import (
    HERE,
    PG,
    Broker,
    Counter,
    app_for,
    broker_env,
    brokers,
    drop_tables,
    start_worker,
    stop_worker,
)

from sqlease import Store
from sqlease.types import NewMessage

QUIET_S = 0.05
DEFAULT = "sqlease-pg,sqlease-pg-publish-nowait,redis,rabbitmq"


def split(mod: Any, counter: Counter, samples: int) -> dict[str, float]:
    publish: list[float] = []
    start: list[float] = []
    counter.drain()
    for _ in range(samples):
        time.sleep(QUIET_S)
        sent = time.time()
        mod.stamp.delay(sent)
        publish.append((time.time() - sent) * 1000)
        got = counter.wait(1, 10)
        if not got or not got[0].startswith(b"l"):
            raise RuntimeError("a task did not report its start within 10 s")
        start.append(float(got[0][1:]) * 1000)
    return {
        "publish_p50_ms": statistics.median(publish),
        "worker_side_p50_ms": statistics.median(s - p for s, p in zip(start, publish, strict=True)),
        "start_p50_ms": statistics.median(start),
    }


def after_quiet(run: Any, samples: int) -> float:
    """p50 ms of ``run()`` called after QUIET_S of nothing."""
    for _ in range(10):
        run()
    times: list[float] = []
    for _ in range(samples):
        time.sleep(QUIET_S)
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def statement_floor(prefix: str, samples: int) -> dict[str, float]:
    store = Store(PG, table_prefix=prefix)
    conn = psycopg.connect(PG, autocommit=True)
    try:

        def enqueue() -> None:
            message = NewMessage("idle-split", "x" * 900, task_id=str(uuid.uuid4()))
            store.enqueue_many([message])

        return {
            "select1_p50_ms": after_quiet(lambda: conn.execute("SELECT 1"), samples),
            "store_enqueue_p50_ms": after_quiet(enqueue, samples),
        }
    finally:
        conn.close()
        store.engine.dispose()


def run(broker: Broker, counter: Counter, tmp: Path, prefix: str, samples: int) -> dict[str, Any]:
    env = broker_env(broker, counter, prefix)
    mod = app_for(broker, None, env)
    worker = start_worker(env, tmp / f"{broker.name}.log")
    try:
        mod.stamp.delay(time.time())  # connect, declare, and wait for the worker
        if not counter.wait(1, 60):
            raise RuntimeError(f"{broker.name}: worker did not start (see {tmp})")
        out: dict[str, Any] = {"broker": broker.name, **split(mod, counter, samples)}
    finally:
        stop_worker(worker)
    if broker.name == "sqlease-pg":
        out.update(statement_floor(prefix, samples))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=DEFAULT)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sqlease-idle-split-"))
    wanted = args.only.split(",")
    chosen = [b for b in brokers(tmp, "unused") if b.name in wanted]
    counter = Counter()
    found: list[dict[str, Any]] = []
    for number in range(args.rounds):
        order = chosen if number % 2 == 0 else list(reversed(chosen))
        for broker in order:
            prefix = f"idle{os.getpid()}r{number}_"
            try:
                result = run(broker, counter, tmp, prefix, args.samples)
            finally:
                drop_tables(prefix, kombu=False)
            result["round"] = number + 1
            found.append(result)
            print(json.dumps(result), flush=True)
    keys = [k for k in found[0] if k.endswith("_ms")] + ["select1_p50_ms", "store_enqueue_p50_ms"]
    medians: dict[str, dict[str, float]] = {}
    for broker in chosen:
        runs = [r for r in found if r["broker"] == broker.name]
        medians[broker.name] = {
            k: round(statistics.median(r[k] for r in runs), 2)
            for k in dict.fromkeys(keys)
            if all(k in r for r in runs)
        }
    print("| broker | delay() after 50 ms quiet | worker side | start | rounds |")
    print("|---|---:|---:|---:|---|")
    for name, row in medians.items():
        per = ", ".join(f"{r['start_p50_ms']:.2f}" for r in found if r["broker"] == name)
        print(
            f"| {name} | {row['publish_p50_ms']:.2f} | {row['worker_side_p50_ms']:.2f} "
            f"| {row['start_p50_ms']:.2f} | {per} |"
        )
    pg = medians.get("sqlease-pg", {})
    if "select1_p50_ms" in pg:
        print(
            f"\nafter 50 ms quiet, PostgreSQL: SELECT 1 {pg['select1_p50_ms']:.2f} ms, "
            f"Store.enqueue {pg['store_enqueue_p50_ms']:.2f} ms"
        )
    output = args.output or HERE / "results" / f"idle-split-{dt.date.today().isoformat()}.json"
    output.write_text(json.dumps({"samples": args.samples, "runs": found, "medians": medians}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
