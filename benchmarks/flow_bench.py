"""Flow control's cost: claim+ack throughput with concurrency limits against the same work
without them, in the same run, on SQLite and PostgreSQL.

Scenarios (each round runs all of them, in an order that rotates per round, on fresh tables:
a new SQLite file, a new PostgreSQL database):

- ``none``: no limits;
- ``keys``: every message has one of 1,000 concurrency keys at limit 2;
- ``queue``: the queue has a limit (``queue:q``) above what the workers can hold;
- ``rates``: 1,000 task names, each with a rate limit of 100/s (100,000/s together).

No scenario throttles: the workers never hold as many leases as a limit allows, so the ratio
is the claim's own cost of checking and taking places.

Each round: bulk-insert N messages, then P worker processes loop
``claim(["q"], owner, lease_ms=60000, limit=B)`` + ``ack`` until the queue is empty.
Throughput = tasks acked / wall time from the start barrier to the last worker's finish.

    .venv/bin/python benchmarks/flow_bench.py                 # 3 rounds, both databases
    .venv/bin/python benchmarks/flow_bench.py --tasks 5000 --rounds 1 --backends sqlite

Writes a Markdown table to stdout and JSON to benchmarks/results/flow-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from sqlease import Store
from sqlease._db.engine import dispose_all

SCENARIOS = ("none", "keys", "queue", "rates")
KEYS = 1000


def _worker(url: str, prefix: str, batch: int, barrier: Any, out: Any) -> None:
    store = Store(url, table_prefix=prefix, auto_migrate=False)
    owner = f"w-{uuid.uuid4().hex[:6]}"
    store.claim(["warmup"], owner, lease_ms=60_000, limit=batch)
    barrier.wait()
    start = time.perf_counter()
    done = 0
    while True:
        got = store.claim(["q"], owner, lease_ms=60_000, limit=batch)
        if not got:
            break
        store.ack([m.fence for m in got])
        done += len(got)
    out.put((start, time.perf_counter(), done))
    dispose_all(close=True)


def _fill(store: Store, scenario: str, tasks: int) -> None:
    m = store.tables.messages
    now = store.now_ms()
    rows: list[dict[str, Any]] = []
    for i in range(tasks):
        key, limit = None, None
        if scenario == "keys":
            key, limit = f"k{i % KEYS}", 2
        rows.append(
            {
                "queue": "q",
                "payload": "x" * 200,
                "priority": 0,
                "available_at_ms": now,
                "created_at_ms": now,
                "state": "ready",
                "attempt": 0,
                "max_attempts": 3,
                "task_name": f"bench.t{i % KEYS}" if scenario == "rates" else "bench.t",
                "gate_key": key,
                "gate_limit": limit,
            }
        )
    with store.engine.begin() as conn:
        for start in range(0, len(rows), 5000):
            conn.execute(m.insert(), rows[start : start + 5000])
    if scenario == "queue":
        store.set_limits({"queue:q": 1000})
    if scenario == "rates":
        store.set_rate_limits({f"task:bench.t{k}": "100/s" for k in range(KEYS)})
    if store.is_postgresql:
        with store.engine.begin() as conn:
            conn.execute(text(f"ANALYZE {m.name}"))


def _database(backend: str, pg_admin: str, tmp: Path) -> tuple[str, Any]:
    if backend == "sqlite":
        path = tmp / f"{uuid.uuid4().hex}.db"
        return f"sqlite:///{path}", None
    name = f"flowbench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(pg_admin, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    base = pg_admin.rsplit("/", 1)[0]
    return f"{base}/{name}", (admin, name)


def _drop(handle: Any) -> None:
    if handle is None:
        return
    admin, name = handle
    dispose_all(close=True)
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    admin.dispose()


def run_one(backend: str, scenario: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    url, handle = _database(backend, args.pg, tmp)
    try:
        prefix = "fb_"
        store = Store(url, table_prefix=prefix)
        _fill(store, scenario, args.tasks)
        dispose_all(close=True)
        ctx = mp.get_context("spawn")
        barrier, out = ctx.Barrier(args.processes), ctx.Queue()
        procs = [
            ctx.Process(target=_worker, args=(url, prefix, args.batch, barrier, out))
            for _ in range(args.processes)
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        start = min(r[0] for r in results)
        end = max(r[1] for r in results)
        done = sum(r[2] for r in results)
        return {
            "backend": backend,
            "scenario": scenario,
            "tasks": done,
            "seconds": end - start,
            "per_s": done / (end - start),
        }
    finally:
        _drop(handle)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            for n in range(args.rounds):
                order = SCENARIOS[n % len(SCENARIOS) :] + SCENARIOS[: n % len(SCENARIOS)]
                round_runs = {}
                for scenario in order:
                    r = run_one(backend, scenario, args, Path(tmp))
                    r["round"] = n
                    round_runs[scenario] = r
                    print(f"{backend} round {n} {scenario}: {r['per_s']:.0f}/s", file=sys.stderr)
                for r in round_runs.values():
                    r["ratio"] = r["per_s"] / round_runs["none"]["per_s"]
                runs.extend(round_runs.values())
    print("| database | scenario | tasks/s (median) | ratio to no limits (median of rounds) |")
    print("|---|---|---|---|")
    for backend in args.backends.split(","):
        for scenario in SCENARIOS:
            mine = [r for r in runs if r["backend"] == backend and r["scenario"] == scenario]
            print(
                f"| {backend} | {scenario} | {statistics.median(r['per_s'] for r in mine):,.0f} "
                f"| {statistics.median(r['ratio'] for r in mine):.2f} |"
            )
    output = args.output or Path(__file__).parent / "results" / (
        f"flow-{dt.date.today().isoformat()}.json"
    )
    output.write_text(
        json.dumps({"args": vars(args) | {"output": str(output)}, "runs": runs}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
