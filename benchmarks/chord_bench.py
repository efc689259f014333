"""Chords end to end: sqlease's result backend beside Redis's, in one run.

The shape of Celery's own integration test ``test_chain_to_a_chord_with_large_header``:
``ident.si(1) | group(ident.s() for _ in range(N)) | tsum.s()`` (the header published by
the worker running the chain's first task), and a chord whose header the client publishes,
``chord(ident.s(i) for i in range(N))(tsum.s())``. Each is timed from the call to the body's
result (``.get()``), with a warm worker (``celery worker -P prefork -c 2``, prefetch
multiplier 4, bench_app), the broker's own result backend, and the PostgreSQL server's CPU
(its processes' user + system time) per part on the sqlease PostgreSQL run.

Rounds run every broker once, in alternating order, on fresh tables (a new prefix) and a new
SQLite file; the ratios to Redis are per round, and their medians are printed.

    .venv/bin/python benchmarks/chord_bench.py                  # N=1000, 3 rounds
    .venv/bin/python benchmarks/chord_bench.py --parts 200 --rounds 1 --only sqlease-pg,redis
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from celery import chord, group
from celery_bench import (
    Broker,
    Counter,
    app_for,
    broker_env,
    brokers,
    drop_tables,
    server_cpu,
    start_worker,
    stop_worker,
    write_results,
)

NAMES = ("sqlease-pg", "sqlease-sqlite", "redis")


def run_broker(broker: Broker, parts: int, tmp: Path, prefix: str) -> dict[str, Any]:
    counter = Counter()
    assert broker.backend
    env = dict(broker_env(broker, counter, prefix), BENCH_BACKEND=broker.backend)
    mod = app_for(broker, broker.backend, env)
    try:
        mod.app.control.purge()
    except Exception:
        pass
    worker = start_worker(env, tmp / f"{broker.name}.log", name="chord")
    out: dict[str, Any] = {"broker": broker.name, "parts": parts}
    try:
        assert mod.add.delay(1, 1).get(timeout=60) == 2  # the worker is up
        # a small chord first: every code path warm
        assert chord(mod.ident.s(i) for i in range(10))(mod.tsum.s()).get(timeout=60) == 45
        for key, make, expect in (
            (
                "chain_to_chord_s",
                lambda: (
                    mod.ident.si(1) | group(mod.ident.s() for _ in range(parts)) | mod.tsum.s()
                ).delay(),
                parts,
            ),
            (
                "chord_s",
                lambda: chord(mod.ident.s(i) for i in range(parts))(mod.tsum.s()),
                parts * (parts - 1) // 2,
            ),
        ):
            cpu = server_cpu("postgres")
            started = time.perf_counter()
            got = make().get(timeout=600)
            out[key] = round(time.perf_counter() - started, 3)
            if got != expect:
                raise RuntimeError(f"{broker.name} {key}: {got!r}, expected {expect!r}")
            if broker.name == "sqlease-pg":
                out[key[:-2] + "_pg_cpu_ms_per_part"] = round(
                    (server_cpu("postgres") - cpu) * 1000 / parts, 3
                )
    finally:
        stop_worker(worker)
        counter.sock.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(NAMES))
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    wanted = args.only.split(",")
    rounds: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        for number in range(args.rounds):
            where = Path(tmpdir) / f"round{number}"
            where.mkdir()
            prefix = f"chord{number}_{int(time.time())}_"
            chosen = [b for b in brokers(where, prefix) if b.name in wanted]
            if number % 2:
                chosen.reverse()
            results = []
            try:
                for broker in chosen:
                    try:
                        result = run_broker(broker, args.parts, where, prefix)
                    except Exception as exc:  # a missing baseline must not hide the others
                        result = {"broker": broker.name, "error": f"{type(exc).__name__}: {exc}"}
                    result["round"] = number
                    results.append(result)
                    print(json.dumps(result), flush=True)
            finally:
                drop_tables(prefix, kombu=False)
            rounds.append(results)
    ratios: dict[str, list[float]] = {}
    for results in rounds:
        by = {r["broker"]: r for r in results}
        redis = by.get("redis", {})
        for name in ("sqlease-pg", "sqlease-sqlite"):
            for key in ("chain_to_chord_s", "chord_s"):
                mine, theirs = by.get(name, {}).get(key), redis.get(key)
                if mine and theirs:
                    ratios.setdefault(f"{name}_{key}_vs_redis", []).append(mine / theirs)
    medians = {k: round(statistics.median(v), 2) for k, v in ratios.items()}
    print("| ratio (time, lower is better) | per round | median |\n|---|---|---:|")
    for key, values in ratios.items():
        print(f"| {key} | {', '.join(f'{v:.2f}' for v in values)} | {medians[key]} |")
    path = write_results("chord", args.output, parts=args.parts, rounds=rounds, medians=medians)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
