"""Where a hot worker's ``delay().get()`` round trip goes, with each broker's own result
backend: the publish, the worker's side up to the task's start, the task, the result's write,
and the waiter's wake-up.

``celery_bench.py``'s round trip (``get()`` p50) calls ``add.delay(2, 2).get()`` back to
back. Here the task (``bench.timed``) reports its start and end, and the moment its result
was stored (Celery's ``task_success`` signal, sent once the backend's write has returned), so
each sample splits into:

- ``delay()``: the call;
- worker side: from its return to the task's start;
- the task: start to end (a no-op);
- result write: from the task's end to the stored signal (Celery's bookkeeping, the
  backend's encoding and its write: for sqlease a statement whose commit waits for the WAL
  flush; for Redis a SET and a PUBLISH; for ``rpc://`` a publish to the client's queue);
- wake-up: from the stored signal to ``get()`` returning (the notification or message
  reaching the waiting client, and its decoding).

The worker is ``celery_bench.py``'s (prefork ``-c 2``, prefetch multiplier 4). Rounds run
every broker once, on fresh tables (and a throwaway ``appendfsync always`` Redis of the
round's own for ``redis-fsync``), in alternating order; medians of the rounds. No timed
assertion anywhere: this prints figures.

    .venv/bin/python benchmarks/get_split.py [--samples 300] [--rounds 3]
        [--only sqlease-pg,redis,redis-fsync,rabbitmq]

Prints a Markdown table; writes JSON to benchmarks/results/get-split-<date>.json.
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

from celery_bench import (
    Broker,
    Counter,
    ThrowawayRedis,
    app_for,
    broker_env,
    brokers,
    drop_tables,
    start_worker,
    stop_worker,
    write_results,
)

WARM_UP = 20
PARTS = ("publish", "worker_side", "task", "result_write", "wake_up", "get")


def split(mod: Any, counter: Counter, samples: int) -> dict[str, float]:
    found: dict[str, list[float]] = {part: [] for part in PARTS}
    counter.drain()
    for i in range(samples + WARM_UP):
        sent = time.time()
        result = mod.timed.delay()
        published = time.time()
        if result.get(timeout=10) != 4:
            raise RuntimeError("bench.timed returned something else than 4")
        done = time.time()
        got = counter.wait(1, 10)
        if not got or not got[0].startswith(b"g"):
            raise RuntimeError("bench.timed did not report its times within 10 s")
        start, end, stored = (float(x) for x in got[0][1:].split(b","))
        if i < WARM_UP:
            continue
        for part, took in zip(
            PARTS,
            (
                published - sent,
                start - published,
                end - start,
                stored - end,
                done - stored,
                done - sent,
            ),
            strict=True,
        ):
            found[part].append(took * 1000)
    return {f"{part}_p50_ms": round(statistics.median(found[part]), 3) for part in PARTS}


def run(broker: Broker, counter: Counter, tmp: Path, prefix: str, samples: int) -> dict[str, Any]:
    # sqlease-pg-publish-nowait: sqlease's backend on the same database (its writes still
    # wait for the flush: publish_sync_commit is the publish's alone)
    backend = broker.backend or (broker.url if broker.url.startswith("sqlease+") else None)
    if backend is None:
        raise SystemExit(f"{broker.name} has no result backend to measure")
    env = dict(broker_env(broker, counter, prefix), BENCH_BACKEND=backend)
    mod = app_for(broker, backend, env)
    worker = start_worker(env, tmp / f"{broker.name}.log")
    try:
        if mod.timed.delay().get(timeout=60) != 4:  # connect, declare, wait for the worker
            raise RuntimeError(f"{broker.name}: no result (see {tmp})")
        counter.wait(1, 10)
        return {"broker": broker.name, **split(mod, counter, samples)}
    finally:
        stop_worker(worker)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="sqlease-pg,redis,redis-fsync,rabbitmq")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sqlease-get-split-"))
    names = args.only.split(",")
    counter = Counter()
    found: list[dict[str, Any]] = []
    for number in range(args.rounds):
        server = ThrowawayRedis(tmp) if "redis-fsync" in names else None
        try:
            chosen = [b for b in brokers(tmp, "unused", server.port if server else 0)]
            chosen = [b for name in names for b in chosen if b.name == name]
            for broker in chosen if number % 2 == 0 else list(reversed(chosen)):
                # a prefix per broker: this process keeps each database's store open
                prefix = f"gs{os.getpid()}r{number}b{chosen.index(broker)}_"
                try:
                    row = run(broker, counter, tmp, prefix, args.samples)
                finally:
                    drop_tables(prefix, kombu=False)
                row["round"] = number + 1
                found.append(row)
                print(json.dumps(row), flush=True)
        finally:
            if server is not None:
                server.stop()
    keys = [f"{part}_p50_ms" for part in PARTS]
    medians = []
    print("| broker | delay() | worker side | task | result write | wake-up | get() |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        runs = [r for r in found if r["broker"] == name]
        row = {k: round(statistics.median(r[k] for r in runs), 2) for k in keys}
        medians.append({"broker": name, **row})
        print(f"| {name} | " + " | ".join(f"{row[k]:.2f}" for k in keys) + " |")
    write_results("get-split", args.output, samples=args.samples, runs=found, medians=medians)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
