"""Flow control end to end: a real Celery worker draining a backlog with limits, against the
same backlog without them, in the same run, on sqlease's PostgreSQL and SQLite.

Scenarios (each round runs all of them, in an order that rotates per round, each on fresh
tables: a new table prefix on PostgreSQL, a new SQLite file):

- ``none``: no limits;
- ``keys``: every task carries one of 1,000 concurrency keys at limit 2 (headers
  ``concurrency_key`` / ``concurrency_limit``);
- ``queue``: the ``celery`` queue has a concurrency limit of 1,000 (transport option
  ``concurrency_limits``);
- ``keys+rates``: the keys of ``keys``, each also under a rate limit of 100/s
  (``rate_limits={"key:k0": "100/s", ...}``, 100,000/s together).

No scenario throttles (the worker, prefork -c 2 with prefetch multiplier 4, never holds two
leases of one key, and a key's ten tasks are spread over the backlog), so a ratio is the cost of
checking and taking places, through the whole Celery path. Per scenario: ``delay()`` rate of
the N publishes (headers included), then the drain rate of a worker started on that backlog
(completions counted by UDP datagrams, as in ``celery_bench.py``).

    .venv/bin/python benchmarks/flow_celery.py                      # 3 rounds, both databases
    .venv/bin/python benchmarks/flow_celery.py --tasks 3000 --rounds 1 --backends sqlite

Writes a Markdown table to stdout and JSON to benchmarks/results/flow-celery-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from celery_bench import PG, Broker, Counter, app_for, drop_tables, start_worker, stop_worker

HERE = Path(__file__).resolve().parent
SCENARIOS = ("none", "keys", "queue", "keys+rates")
KEYS = 1000


class _Target:
    """Where one scenario runs: its broker URL and table prefix."""

    def __init__(self, backend: str, tmp: Path) -> None:
        self.prefix = f"flowc{os.getpid()}_{uuid.uuid4().hex[:6]}_"
        if backend == "postgresql":
            self.url = f"sqlease+{PG}"
        else:
            self.url = f"sqlease+sqlite:///{tmp / (uuid.uuid4().hex + '.db')}"
        self.backend = backend


def _options(scenario: str) -> dict[str, Any]:
    if scenario == "queue":
        return {"concurrency_limits": {"queue:celery": 1000}}
    if scenario == "keys+rates":
        return {"rate_limits": {f"key:k{k}": "100/s" for k in range(KEYS)}}
    return {}


def run_one(backend: str, scenario: str, tasks: int, counter: Counter, tmp: Path) -> dict[str, Any]:
    target = _Target(backend, tmp)
    env = dict(
        os.environ,
        BENCH_BROKER=target.url,
        BENCH_UDP=str(counter.port),
        BENCH_PREFIX=target.prefix,
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        BENCH_TRANSPORT_OPTIONS=json.dumps(_options(scenario)),
    )
    env.pop("BENCH_BACKEND", None)
    mod = app_for_env(env)
    keyed = scenario in ("keys", "keys+rates")
    try:
        if scenario in ("queue", "keys+rates"):
            # The limits are written by a consuming worker at start; write them before the
            # backlog is published, as a running fleet would have them.
            worker = start_worker(env, tmp / f"{scenario}-setup.log")
            counter.drain()
            mod.noop.delay()
            if not counter.wait(1, 60):
                raise RuntimeError(f"{backend} {scenario}: setup worker did not start")
            stop_worker(worker)
        mod.noop.delay()  # connect and declare
        started = time.perf_counter()
        for i in range(tasks):
            if keyed:
                mod.noop.apply_async(
                    headers={"concurrency_key": f"k{i % KEYS}", "concurrency_limit": 2}
                )
            else:
                mod.noop.delay()
        delay_per_s = tasks / (time.perf_counter() - started)
        counter.drain()
        worker = start_worker(env, tmp / f"{scenario}.log")
        try:
            if not counter.wait(1, 60):
                raise RuntimeError(f"{backend} {scenario}: worker did not start")
            t0 = time.perf_counter()
            rest = counter.wait(tasks, 600)
            elapsed = time.perf_counter() - t0
        finally:
            stop_worker(worker)
        if len(rest) < tasks - 1:
            raise RuntimeError(f"{backend} {scenario}: only {len(rest) + 1} of {tasks + 1} ran")
        return {
            "backend": backend,
            "scenario": scenario,
            "tasks": tasks,
            "delay_per_s": delay_per_s,
            "drain_per_s": len(rest) / elapsed,
        }
    finally:
        mod.app.pool.force_close_all()
        if backend == "postgresql":
            drop_tables(target.prefix, kombu=False)


def app_for_env(env: dict[str, str]) -> Any:
    return app_for(Broker("flow", env["BENCH_BROKER"]), None, env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="postgresql,sqlite")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    counter = Counter()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.rounds):
            for backend in args.backends.split(","):
                order = SCENARIOS[n % len(SCENARIOS) :] + SCENARIOS[: n % len(SCENARIOS)]
                round_runs = {}
                for scenario in order:
                    r = run_one(backend, scenario, args.tasks, counter, Path(tmp))
                    r["round"] = n
                    round_runs[scenario] = r
                    print(
                        f"{backend} round {n} {scenario}: delay {r['delay_per_s']:.0f}/s, "
                        f"drain {r['drain_per_s']:.0f}/s",
                        file=sys.stderr,
                    )
                for r in round_runs.values():
                    r["drain_ratio"] = r["drain_per_s"] / round_runs["none"]["drain_per_s"]
                    r["delay_ratio"] = r["delay_per_s"] / round_runs["none"]["delay_per_s"]
                runs.extend(round_runs.values())
    print("| database | scenario | drain/s | drain ratio | delay()/s | delay() ratio |")
    print("|---|---|---|---|---|---|")
    for backend in args.backends.split(","):
        for scenario in SCENARIOS:
            mine = [r for r in runs if r["backend"] == backend and r["scenario"] == scenario]

            def med(key: str, rows: list[dict[str, Any]] = mine) -> float:
                return statistics.median(r[key] for r in rows)

            print(
                f"| {backend} | {scenario} | {med('drain_per_s'):,.0f} | {med('drain_ratio'):.2f} "
                f"| {med('delay_per_s'):,.0f} | {med('delay_ratio'):.2f} |"
            )
    output = args.output or HERE / "results" / f"flow-celery-{dt.date.today().isoformat()}.json"
    output.write_text(
        json.dumps({"args": vars(args) | {"output": str(output)}, "runs": runs}, indent=1)
    )
    print(f"written {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
