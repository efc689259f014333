"""Where a hot worker's back-to-back start latency goes: the ``delay()`` call against the
worker's side, with the next ``delay()`` made at once or after a gap.

``celery_bench.py``'s back-to-back start latency makes each ``delay()`` as soon as the previous
task has reported its start (its UDP datagram). This splits each sample as
``benchmarks/idle_split.py`` does (the ``delay()`` call; from its return to the task's start),
for each gap in ``--gaps`` (ms slept after a start before the next ``delay()``; 0: at once).

Same worker as ``celery_bench.py`` (prefork ``-c 2``, prefetch multiplier 4). Rounds run every
broker once, on fresh tables, in alternating order; medians of the rounds.

    .venv/bin/python benchmarks/b2b_split.py [--samples 200] [--rounds 2] [--gaps 0,10]
        [--only sqlease-pg,rabbitmq]

For sqlease on PostgreSQL, also the share of the tasks a publish handed straight to the
worker's offer (from the ``claimed`` events), the rest being claimed after a notification.

Prints a Markdown table; writes JSON to benchmarks/results/b2b-split-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from celery_bench import (
    Broker,
    Counter,
    app_for,
    broker_env,
    brokers,
    drop_tables,
    start_worker,
    stop_worker,
    write_results,
)

WARM_UP = 10


def split(mod: Any, counter: Counter, samples: int, gap_ms: float) -> dict[str, float]:
    publish: list[float] = []
    start: list[float] = []
    counter.drain()
    for i in range(samples + WARM_UP):
        if gap_ms:
            time.sleep(gap_ms / 1000)
        sent = time.time()
        mod.stamp.delay(sent)
        took = (time.time() - sent) * 1000
        got = counter.wait(1, 10)
        if not got or not got[0].startswith(b"l"):
            raise RuntimeError("a task did not report its start within 10 s")
        if i >= WARM_UP:
            publish.append(took)
            start.append(float(got[0][1:]) * 1000)
    return {
        "publish_p50_ms": round(statistics.median(publish), 2),
        "worker_side_p50_ms": round(
            statistics.median(s - p for s, p in zip(start, publish, strict=True)), 2
        ),
        "start_p50_ms": round(statistics.median(start), 2),
    }


def handed_share(broker: Broker, prefix: str, since_ms: float) -> float | None:
    """sqlease: the share of the deliveries since ``since_ms`` that a publish handed to the
    worker's offer (the rest were claimed after a notification); None for other brokers."""
    if not broker.url.startswith("sqlease+postgresql"):
        return None
    with psycopg.connect(broker.url.removeprefix("sqlease+"), autocommit=True) as conn:
        handed, total = conn.execute(
            "SELECT count(*) FILTER (WHERE kind = 'claimed' "
            "AND CAST(data AS JSONB) ->> 'handoff' = 'true'), "
            f"count(*) FILTER (WHERE kind = 'enqueued') FROM {prefix}events "
            "WHERE at_ms >= %s",
            (int(since_ms),),
        ).fetchone()
    return round(handed / total, 3) if total else None


def run(
    broker: Broker, counter: Counter, tmp: Path, prefix: str, samples: int, gaps: list[float]
) -> list[dict[str, Any]]:
    env = broker_env(broker, counter, prefix)
    mod = app_for(broker, None, env)
    worker = start_worker(env, tmp / f"{broker.name}.log")
    try:
        mod.stamp.delay(time.time())  # connect, declare, and wait for the worker
        if not counter.wait(1, 60):
            raise RuntimeError(f"{broker.name}: worker did not start (see {tmp})")
        rows = []
        for gap in gaps:
            since_ms = time.time() * 1000
            row = {"broker": broker.name, "gap_ms": gap, **split(mod, counter, samples, gap)}
            row["handed_share"] = handed_share(broker, prefix, since_ms)
            rows.append(row)
        return rows
    finally:
        stop_worker(worker)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gaps", default="0,10", help="ms after a start before the next delay()")
    parser.add_argument("--only", default="sqlease-pg,rabbitmq")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sqlease-b2b-split-"))
    gaps = [float(g) for g in args.gaps.split(",")]
    chosen = [b for b in brokers(tmp, "unused") if b.name in args.only.split(",")]
    counter = Counter()
    found: list[dict[str, Any]] = []
    for number in range(args.rounds):
        for broker in chosen if number % 2 == 0 else list(reversed(chosen)):
            prefix = f"b2b{os.getpid()}r{number}_"
            try:
                rows = run(broker, counter, tmp, prefix, args.samples, gaps)
            finally:
                drop_tables(prefix, kombu=False)
            for row in rows:
                row["round"] = number + 1
                found.append(row)
                print(json.dumps(row), flush=True)
    keys = ("publish_p50_ms", "worker_side_p50_ms", "start_p50_ms")
    medians = []
    print("| broker | gap ms | delay() | worker side | start | handed over |")
    print("|---|---:|---:|---:|---:|---:|")
    for broker in chosen:
        for gap in gaps:
            runs = [r for r in found if r["broker"] == broker.name and r["gap_ms"] == gap]
            row: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}
            shares = [r["handed_share"] for r in runs if r["handed_share"] is not None]
            row["handed_share"] = round(statistics.median(shares), 3) if shares else None
            medians.append({"broker": broker.name, "gap_ms": gap, **row})
            handed = "-" if row["handed_share"] is None else f"{row['handed_share']:.0%}"
            print(
                f"| {broker.name} | {gap:g} | "
                + " | ".join(f"{row[k]:.2f}" for k in keys)
                + f" | {handed} |"
            )
    write_results("b2b-split", args.output, samples=args.samples, runs=found, medians=medians)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
