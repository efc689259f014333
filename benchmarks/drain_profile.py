"""Where a Celery worker's main process spends a drain, per task: sqlease against RabbitMQ's
py-amqp and Redis's redis-py, package by package.

A drain of ``--tasks`` no-op tasks (prefork ``-c 2``, prefetch multiplier 4, no result
backend: ``celery_bench.py``'s worker) is first timed for ``--seconds`` once the first task
has completed (its tasks/s), then sampled with py-spy (``--idle``, ``--rate`` samples per
second) for as long. py-spy pauses the process for each sample, which slows the drain it
samples; hence the rate from the seconds before. Only the worker's main thread counts (the
event loop: Celery's consumer, Kombu, the transport; sqlease's own threads, the heartbeat and
the side thread, are left out, as are the pool processes). Each sample is given to the
package of its innermost frame that belongs to one of ``PACKAGES`` (the broker's client
library, Kombu, Celery, billiard, ...); a sample inside ``epoll.poll`` is the loop waiting,
``idle``. A package's microseconds per task = its share of the samples x 1,000,000 / the
tasks/s. These are wall-clock samples: on a busy machine a runnable thread that waits for a
core counts as busy too, so compare brokers sampled in the same run.

    .venv/bin/python benchmarks/drain_profile.py [--tasks 30000] [--seconds 3] [--rounds 2]
        [--only sqlease-pg,rabbitmq,redis]

Needs py-spy (the ``bench`` extra) and, like ``celery_bench.py``, the brokers' servers. Prints
a Markdown table (medians of the rounds) and the heaviest frames of sqlease's own; writes JSON
to benchmarks/results/drain-profile-<date>.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from celery_bench import (
    Counter,
    app_for,
    broker_env,
    brokers,
    drop_tables,
    start_worker,
    stop_worker,
    write_results,
)

#: Libraries a sample is given to (innermost frame first); "sqlease" and "psycopg" together
#: are sqlease's transport, "amqp" RabbitMQ's client, "redis" Redis's.
PACKAGES = ("sqlease", "psycopg", "sqlalchemy", "amqp", "redis", "kombu", "celery", "billiard")
_FILE = re.compile(r"\((.*):\d+\)$")


def owner(frame: str) -> str | None:
    found = _FILE.search(frame)
    path = found.group(1) if found else frame
    return next((p for p in PACKAGES if path.startswith(p + "/")), None)


def attribute(raw: Path) -> tuple[collections.Counter[str], collections.Counter[str], int]:
    """Per package and per sqlease function (innermost sqlease frame of the samples that
    sqlease or psycopg own): sample counts of the main thread; and its total."""
    packages: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if "Evloop.start" not in stack:  # not the main thread's event loop
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        if "epoll.poll" in frames[-1]:
            packages["idle"] += count
            continue
        found = next((o for o in map(owner, reversed(frames)) if o is not None), "other")
        packages[found] += count
        if found in ("sqlease", "psycopg"):
            inner = next(f for f in reversed(frames) if owner(f) == "sqlease")
            name = inner.split(" (")[0] + " (" + inner.split("(")[-1].split(":")[0] + ")"
            ours[name] += count
    return packages, ours, total


def py_spy() -> str:
    """py-spy beside this interpreter (a venv's, not on the PATH), else the PATH's."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
    return found


def run(
    broker: Any, counter: Counter, tmp: Path, prefix: str, tasks: int, seconds: int, rate: int
) -> dict[str, Any]:
    env = broker_env(broker, counter, prefix)
    mod = app_for(broker, None, env)
    try:
        mod.app.control.purge()
    except Exception:
        pass
    for _ in range(tasks):
        mod.noop.delay()
    counter.drain()
    worker = start_worker(env, tmp / f"{broker.name}.log")
    raw = tmp / f"{broker.name}-{prefix}.txt"
    try:
        if not counter.wait(1, 60):
            raise RuntimeError(f"{broker.name}: worker did not start (see {tmp})")
        # The rate first, unsampled: py-spy pauses the process for each sample (its
        # non-blocking mode tears the stacks), which slows the drain it samples.
        started = time.perf_counter()
        early = len(counter.wait(tasks - 1, seconds))
        rate_per_s = early / (time.perf_counter() - started)
        argv = [py_spy(), "record", "-p", str(worker.pid), "-d", str(seconds)]
        argv += ["-r", str(rate), "--idle", "--format", "raw", "-o", str(raw)]
        spy = subprocess.run(argv, capture_output=True, timeout=60 + seconds, check=False)
        if spy.returncode != 0:
            raise RuntimeError(f"py-spy failed: {spy.stderr.decode(errors='replace')}")
        rest = counter.wait(tasks - 1 - early, 600)
    finally:
        stop_worker(worker)
    if early + len(rest) < tasks - 1:
        raise RuntimeError(f"{broker.name}: the drain ended early (see {tmp}); more --tasks?")
    packages, ours, total = attribute(raw)
    # The drain's rate is steady (no phases), so the unsampled tasks/s turns a share of the
    # samples into microseconds per task.
    per_task = 1e6 / rate_per_s / total if rate_per_s and total else 0.0
    return {
        "broker": broker.name,
        "tasks_per_s": round(rate_per_s, 1),
        "samples": total,
        "idle_share": round(packages["idle"] / total, 3) if total else None,
        "us_per_task": {k: round(v * per_task, 1) for k, v in packages.most_common()},
        "busy_us_per_task": round((total - packages["idle"]) * per_task, 1),
        "sqlease_frames_us_per_task": {k: round(v * per_task, 1) for k, v in ours.most_common(15)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=30_000)
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="sqlease-pg,rabbitmq,redis")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    py_spy()
    tmp = Path(tempfile.mkdtemp(prefix="sqlease-drain-profile-"))
    names = args.only.split(",")
    chosen = [b for name in names for b in brokers(tmp, "unused") if b.name == name]
    counter = Counter()
    found: list[dict[str, Any]] = []
    for number in range(args.rounds):
        for broker in chosen if number % 2 == 0 else list(reversed(chosen)):
            prefix = f"dp{os.getpid()}r{number}b{chosen.index(broker)}_"
            try:
                row = run(broker, counter, tmp, prefix, args.tasks, args.seconds, args.rate)
            finally:
                drop_tables(prefix, kombu=False)
            row["round"] = number + 1
            found.append(row)
            print(json.dumps(row), flush=True)
    packages = sorted({p for r in found for p in r["us_per_task"]} - {"idle"})
    print("| broker | tasks/s | main thread busy, us/task | idle | " + " | ".join(packages) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(packages))
    medians = []
    for name in names:
        runs = [r for r in found if r["broker"] == name]
        row = {
            "broker": name,
            "tasks_per_s": statistics.median(r["tasks_per_s"] for r in runs),
            "busy_us_per_task": statistics.median(r["busy_us_per_task"] for r in runs),
            "idle_share": statistics.median(r["idle_share"] for r in runs),
            "us_per_task": {
                p: statistics.median(r["us_per_task"].get(p, 0.0) for r in runs) for p in packages
            },
        }
        medians.append(row)
        print(
            f"| {name} | {row['tasks_per_s']:,.0f} | {row['busy_us_per_task']:.0f} | "
            f"{row['idle_share']:.0%} | "
            + " | ".join(f"{row['us_per_task'][p]:.0f}" for p in packages)
            + " |"
        )
    for r in found:
        if r["sqlease_frames_us_per_task"]:
            print(f"round {r['round']} {r['broker']}: sqlease's heaviest frames, us/task")
            for frame, us in list(r["sqlease_frames_us_per_task"].items())[:10]:
                print(f"  {us:6.1f}  {frame}")
    write_results(
        "drain-profile",
        args.output,
        tasks=args.tasks,
        seconds=args.seconds,
        rate=args.rate,
        runs=found,
        medians=medians,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
