"""A worker draining a plain queue beside a queue of held work, against the same drain with
nothing held, end to end through Celery.

Each round, for each scenario, on fresh tables (a table prefix of its own on PostgreSQL, a
new file on SQLite): ``--tasks`` no-op tasks (default 10,000) are published to ``celery``;
the queue ``held`` gets the scenario's held work; then ``celery worker -P prefork -c 2 -Q
celery,held`` starts and the drain of ``celery`` is timed (tasks/s from the first task's
start to the last's, counted by UDP datagrams as in ``celery_bench.py``).

- **none**: ``held`` is empty.
- **runs**: ``--runs`` runs (default 2,222) of ``--waiting`` + 1 messages each (default 9
  waiting, 19,998 messages behind 2,222 heads), the heads leased for an hour by another
  worker (long tasks in progress): the waiting messages are parked behind their runs; the
  running heads are in the claim index, as every running task is.
- **runs_waiting**: the same, with each head then waiting for a person (parked, as
  ``ctx.wait_for_input`` leaves it): nothing of ``held`` is in the claim index.
- **gate**: ``--held`` messages (default 20,000) on ``held`` behind a queue concurrency
  limit of 1 whose place another worker holds (a lease of an hour): the worker's sweep
  parks them at the full gate, within a second of its first claim.
- **rate**: the same behind a queue rate limit of 1/h whose one delivery is spent: the
  sweep gives each its turn as its due time.

Reported: drain/s per scenario and round, and the median over rounds of each round's ratio
to ``none`` (target 0.8). JSON in ``benchmarks/results/held-drain-<date>.json``.

    .venv/bin/python benchmarks/held_drain.py                     # PostgreSQL, 3 rounds
    .venv/bin/python benchmarks/held_drain.py --backends sqlite,postgresql --rounds 1
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery
from celery_bench import Counter, start_worker, stop_worker

from sqlease import NewMessage, Store

HERE = Path(__file__).resolve().parent
DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
BATCH = 5_000


def fill_runs(store: Store, runs: int, waiting: int, *, heads_wait: bool = False) -> None:
    """The heads first (leased for an hour by ``holder``; ``heads_wait``: then parked,
    waiting for a person), then the waiting messages."""
    for round_ in range(waiting + 1):
        for start in range(0, runs, BATCH):
            store.enqueue_many(
                [
                    NewMessage("held", "{}", run_id=f"run-{i}", task_id=str(uuid.uuid4()))
                    for i in range(start, min(runs, start + BATCH))
                ]
            )
        if round_ == 0:
            leased = 0
            while leased < runs:
                got = store.claim(["held"], "holder", lease_ms=3_600_000, limit=1_000)
                leased += len(got)
                for message in got if heads_wait else []:
                    store.park(message.fence, "waiting_input")


def fill_held(store: Store, held: int, by: str) -> None:
    for start in range(0, held, BATCH):
        store.enqueue_many(
            [
                NewMessage("held", "{}", task_id=str(uuid.uuid4()))
                for _ in range(min(BATCH, held - start))
            ]
        )
    if by == "rate":
        store.set_rate_limits({"queue:held": "1/h"})
    else:
        store.set_limits({"queue:held": 1})
    first = store.claim(["held"], "holder", lease_ms=3_600_000, limit=5)
    if len(first) != 1:
        raise RuntimeError(f"the {by} limit let {len(first)} messages through, not 1")


def drain(url: str, prefix: str, tasks: int, counter: Counter, log: Path) -> float:
    env = dict(
        os.environ,
        BENCH_BROKER=f"sqlease+{url}",
        BENCH_UDP=str(counter.port),
        BENCH_PREFIX=prefix,
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    )
    env.pop("BENCH_BACKEND", None)
    # The tasks by name, from an app of this scenario's own (bench_app is the worker's).
    client = Celery("held-drain", broker=env["BENCH_BROKER"], set_as_current=False)
    client.conf.broker_transport_options = {"table_prefix": prefix}
    for _ in range(tasks):
        client.send_task("bench.noop")
    client.close()
    counter.drain()
    worker = start_worker(env, log, queues="celery,held", name="held")
    try:
        if not counter.wait(1, 60):
            raise RuntimeError(f"the worker did not start (see {log})")
        started = time.perf_counter()
        rest = counter.wait(tasks - 1, 600)
        elapsed = time.perf_counter() - started
        if len(rest) != tasks - 1:
            raise RuntimeError(f"drained {len(rest) + 1} of {tasks} (see {log})")
        return (tasks - 1) / elapsed
    finally:
        stop_worker(worker)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--backends", default="postgresql")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=2_222)
    parser.add_argument("--waiting", type=int, default=9)
    parser.add_argument("--held", type=int, default=20_000)
    parser.add_argument("--scenarios", default="none,runs")
    parser.add_argument("--pg", default=DEFAULT_PG)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    scenarios = [s for s in args.scenarios.split(",") if s]
    counter = Counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sqlease-held-") as tmp:
        for rnd in range(args.rounds):
            order = scenarios if rnd % 2 == 0 else scenarios[::-1]
            for backend in backends:
                for scenario in order:
                    prefix = f"hd{uuid.uuid4().hex[:8]}_"
                    url = args.pg if backend == "postgresql" else f"sqlite:///{tmp}/{prefix}.db"
                    store = Store(url, table_prefix=prefix)
                    if scenario in ("runs", "runs_waiting"):
                        heads_wait = scenario == "runs_waiting"
                        fill_runs(store, args.runs, args.waiting, heads_wait=heads_wait)
                    elif scenario in ("gate", "rate"):
                        fill_held(store, args.held, scenario)
                    store.engine.dispose()
                    print(f"[{rnd + 1}/{args.rounds}] {backend} {scenario}", file=sys.stderr)
                    rate = drain(url, prefix, args.tasks, counter, Path(tmp) / "worker.log")
                    rows.append(
                        {
                            "round": rnd,
                            "backend": backend,
                            "scenario": scenario,
                            "drain_per_s": rate,
                        }
                    )
                    print(f"    {rate:,.0f} tasks/s", file=sys.stderr)
    summary = []
    print("| database | scenario | drain/s (median) | ratio to none, per round | median |")
    print("|---|---|---:|---|---:|")
    for backend in backends:
        base = {
            r["round"]: r["drain_per_s"]
            for r in rows
            if (r["backend"], r["scenario"]) == (backend, "none")
        }
        for scenario in scenarios:
            mine = [r for r in rows if (r["backend"], r["scenario"]) == (backend, scenario)]
            ratios = [r["drain_per_s"] / base[r["round"]] for r in mine if r["round"] in base]
            med = statistics.median(r["drain_per_s"] for r in mine)
            ratio = statistics.median(ratios) if ratios else None
            summary.append(
                {"backend": backend, "scenario": scenario, "drain_per_s": med, "ratio": ratio}
            )
            shown = ", ".join(f"{x:.2f}" for x in ratios)
            print(f"| {backend} | {scenario} | {med:,.0f} | {shown} | {ratio or 0:.2f} |")
    commit = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    output = args.output or HERE / "results" / f"held-drain-{dt.date.today().isoformat()}.json"
    output.write_text(
        json.dumps(
            {
                "benchmark": "held_drain",
                "settings": {k: v for k, v in vars(args).items() if k != "output"},
                "environment": {"python": platform.python_version(), "commit": commit},
                "summary": summary,
                "rounds": rows,
            },
            indent=1,
            default=str,
        )
        + "\n"
    )
    print(f"wrote {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
