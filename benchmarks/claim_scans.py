"""What a claim costs when its index scan has rows to pass over: delayed messages on its
queue, and a claim over several queues with a deep backlog.

For SQLite (a WAL file in a temporary directory) and PostgreSQL (a database made for each
round and dropped at its end), ``--rounds`` times, each case on fresh tables:

- **delayed**: ``--delayed`` messages (default 100,000) due in an hour, spread over
  priorities 0, 3 and 7, on queue ``q``. Then, ``--calls`` times: publish 3 due messages,
  ``claim(["q"], limit=32)`` (it gets those 3, fewer than it asked for: an idle or lightly
  loaded worker's claim), ack them. Timed: the claim call.
- **queues**: ``--due`` ready messages (default 200,000) on queue ``q``, nothing on
  ``other``. Then ``--calls`` claims of 32 + acks over ``["q"]`` and as many over
  ``["q", "other"]`` (a worker started with ``-Q q,other``), interleaved. Timed: the claim.

- **analyzed**: ``--analyzed`` ready messages (default 40,000) on queue ``q``, then
  ``ANALYZE`` (what autovacuum does on PostgreSQL once 2% of the table changed). Then
  ``--calls`` claims of 1 and as many of 32, interleaved, with their acks. Timed: the claim.
  On PostgreSQL the hot path's prepared statements then run on generic plans built from
  these statistics (5,000 to 50,000 rows is where a claim used to read the whole table).

- **held_by_rate**, **held_by_gate**: ``--held`` ready messages (default 20,000) on queue
  ``b`` that a limit holds back: a queue rate limit of 1/h whose one delivery is spent
  (``held_by_rate``), or a queue concurrency limit of 1 whose slot is taken
  (``held_by_gate``). Then ``--calls`` times: publish 3 messages on ``a``,
  ``claim(["a", "b"], limit=32)`` (it gets those 3), ack them. Timed: the claim, which
  passes every held row of ``b``.

- **held_by_run**: ``--runs`` runs (default 10,000) on queue ``b``, each with a head that a
  holder has claimed (a lease of an hour) and ``--waiting`` messages behind it (default 10);
  then as above, the claim over ``["a", "b"]``. The waiting messages are parked behind their
  runs, outside the claim index; the running heads are in it, as every running task is.
- **held_by_run_waiting**: the same, but each head then waits for a person (parked, as
  ``ctx.wait_for_input`` leaves it): nothing of ``b`` is in the claim index.
- **held_none**: the same claims with ``b`` empty: what the held cases are compared with.
- **running_none**: ``--runs`` messages on ``b`` without runs, all claimed by a holder (a
  lease of an hour) and nothing waiting: the running heads of ``held_by_run`` without their
  runs, so ``held_by_run`` against it is what the waiting messages and the runs add.

Messages are published with ``Store.enqueue_many`` (batches of 5,000), as the transport
does. Reported: the claim's p50 and p99 in milliseconds, medians over the rounds.

    .venv/bin/python benchmarks/claim_scans.py                 # both databases, 3 rounds
    .venv/bin/python benchmarks/claim_scans.py --backends sqlite --rounds 1

JSON in ``benchmarks/results/claim-scans-<date>.json``; see docs/performance.md §6.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine

from sqlease import NewMessage, Store

HERE = Path(__file__).resolve().parent
DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
LEASE_MS = 60_000
BATCH = 5_000


@contextmanager
def database(backend: str, pg_url: str) -> Iterator[str]:
    """A fresh database's URL, dropped (or deleted) afterwards."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="sqlease-scans-") as tmp:
            yield f"sqlite:///{tmp}/scans.db"
        return
    name = f"sqlease_scans_{uuid.uuid4().hex[:8]}"
    admin = create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield pg_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def fill(store: Store, count: int) -> None:
    for start in range(0, count, BATCH):
        store.enqueue_many(
            [
                NewMessage("q", "{}", task_id=str(uuid.uuid4()), task_name="scan.noop")
                for _ in range(min(BATCH, count - start))
            ]
        )


def fill_delayed(store: Store, count: int) -> None:
    for start in range(0, count, BATCH):
        store.enqueue_many(
            [
                NewMessage(
                    "q",
                    "{}",
                    priority=(0, 3, 7)[i % 3],
                    delay_ms=3_600_000 + i,
                    task_id=str(uuid.uuid4()),
                    task_name="scan.later",
                )
                for i in range(start, min(count, start + BATCH))
            ]
        )


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3),
        "calls": len(ordered),
    }


def timed_claim(store: Store, queues: list[str], expect: int, *, limit: int = 32) -> float:
    started = time.perf_counter()
    got = store.claim(queues, "scanner", lease_ms=LEASE_MS, limit=limit)
    elapsed = time.perf_counter() - started
    if len(got) != expect:
        raise RuntimeError(f"claim over {queues} returned {len(got)} messages, not {expect}")
    store.ack([m.fence for m in got])
    return elapsed


def case_delayed(url: str, delayed: int, calls: int) -> dict[str, Any]:
    store = Store(url)
    try:
        fill_delayed(store, delayed)
        times = []
        for _ in range(calls):
            store.enqueue_many([NewMessage("q", "{}", task_id=str(uuid.uuid4())) for _ in range(3)])
            times.append(timed_claim(store, ["q"], 3))
        return {"claim_one_queue_3_due": summary(times)}
    finally:
        store.engine.dispose()


def case_queues(url: str, due: int, calls: int) -> dict[str, Any]:
    store = Store(url)
    try:
        fill(store, due)
        one: list[float] = []
        two: list[float] = []
        for _ in range(calls):
            one.append(timed_claim(store, ["q"], 32))
            two.append(timed_claim(store, ["q", "other"], 32))
        return {"claim_one_queue": summary(one), "claim_two_queues": summary(two)}
    finally:
        store.engine.dispose()


def case_analyzed(url: str, due: int, calls: int) -> dict[str, Any]:
    store = Store(url)
    try:
        fill(store, due)
        with store.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE")
        one: list[float] = []
        batch: list[float] = []
        for _ in range(calls):
            one.append(timed_claim(store, ["q"], 1, limit=1))
            batch.append(timed_claim(store, ["q"], 32))
        return {"analyzed_claim_of_1": summary(one), "analyzed_claim_of_32": summary(batch)}
    finally:
        store.engine.dispose()


def case_held(url: str, held: int, calls: int, by: str) -> dict[str, Any]:
    store = Store(url)
    try:
        for start in range(0, held, BATCH):
            store.enqueue_many(
                [
                    NewMessage("b", "{}", task_id=str(uuid.uuid4()), task_name="scan.held")
                    for _ in range(min(BATCH, held - start))
                ]
            )
        if by == "rate":
            store.set_rate_limits({"queue:b": "1/h"})
        else:
            store.set_limits({"queue:b": 1})
        first = store.claim(["b"], "holder", lease_ms=3_600_000, limit=5)
        if len(first) != 1:
            raise RuntimeError(f"the {by} limit let {len(first)} messages through, not 1")
        swept: dict[str, Any] = {}
        # What a worker's sweep does within a second of its first claim: park them at the
        # full gate, or give each its turn under the rate as its due time.
        began = time.perf_counter()
        parked = store.park_held(["b"])
        swept = {"sweep_ms": round((time.perf_counter() - began) * 1000, 1)}
        swept["parked"] = len(parked)
        times = []
        for _ in range(calls):
            store.enqueue_many([NewMessage("a", "{}", task_id=str(uuid.uuid4())) for _ in range(3)])
            times.append(timed_claim(store, ["a", "b"], 3))
        out = {f"held_by_{by}": {**summary(times), **swept}}
        if store.engine.dialect.name == "postgresql":
            # Then as autovacuum leaves it: the moved rows' old index entries gone.
            with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
                c.exec_driver_sql(f"VACUUM {store.tables.messages.name}")
            times = []
            for _ in range(calls):
                store.enqueue_many(
                    [NewMessage("a", "{}", task_id=str(uuid.uuid4())) for _ in range(3)]
                )
                times.append(timed_claim(store, ["a", "b"], 3))
            out[f"held_by_{by}_vacuumed"] = summary(times)
        return out
    finally:
        store.engine.dispose()


def case_runs(url: str, runs: int, waiting: int, calls: int, heads: str) -> dict[str, Any]:
    """``heads``: ``running`` (leased for an hour) or ``waiting`` (then parked, waiting for a
    person, as ``ctx.wait_for_input`` leaves them)."""
    store = Store(url)
    try:
        for round_ in range(waiting + 1):  # the heads first, then the waiting messages
            for start in range(0, runs, BATCH):
                store.enqueue_many(
                    [
                        NewMessage("b", "{}", run_id=f"run-{i}", task_id=str(uuid.uuid4()))
                        for i in range(start, min(runs, start + BATCH))
                    ]
                )
            if round_ == 0:
                held = 0
                while held < runs:
                    got = store.claim(["b"], "holder", lease_ms=3_600_000, limit=1_000)
                    held += len(got)
                    if heads == "waiting":
                        for m in got:
                            store.park(m.fence, "waiting_input")
        times = []
        for _ in range(calls):
            store.enqueue_many([NewMessage("a", "{}", task_id=str(uuid.uuid4())) for _ in range(3)])
            times.append(timed_claim(store, ["a", "b"], 3))
        return {"held_by_run" if heads == "running" else "held_by_run_waiting": summary(times)}
    finally:
        store.engine.dispose()


def case_running(url: str, running: int, calls: int) -> dict[str, Any]:
    store = Store(url)
    try:
        for start in range(0, running, BATCH):
            store.enqueue_many(
                [
                    NewMessage("b", "{}", task_id=str(uuid.uuid4()))
                    for _ in range(min(BATCH, running - start))
                ]
            )
        held = 0
        while held < running:
            held += len(store.claim(["b"], "holder", lease_ms=3_600_000, limit=1_000))
        times = []
        for _ in range(calls):
            store.enqueue_many([NewMessage("a", "{}", task_id=str(uuid.uuid4())) for _ in range(3)])
            times.append(timed_claim(store, ["a", "b"], 3))
        return {"running_none": summary(times)}
    finally:
        store.engine.dispose()


def case_none(url: str, calls: int) -> dict[str, Any]:
    store = Store(url)
    try:
        times = []
        for _ in range(calls):
            store.enqueue_many([NewMessage("a", "{}", task_id=str(uuid.uuid4())) for _ in range(3)])
            times.append(timed_claim(store, ["a", "b"], 3))
        return {"held_none": summary(times)}
    finally:
        store.engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--backends", default="sqlite,postgresql", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delayed", type=int, default=100_000)
    parser.add_argument("--due", type=int, default=200_000)
    parser.add_argument("--analyzed", type=int, default=40_000)
    parser.add_argument("--held", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--waiting", type=int, default=10)
    parser.add_argument(
        "--cases",
        default=(
            "delayed,queues,analyzed,held_none,held_by_rate,held_by_gate,running_none,"
            "held_by_run,held_by_run_waiting"
        ),
        help="comma-separated",
    )
    parser.add_argument("--calls", type=int, default=100, help="timed claims per case")
    parser.add_argument("--pg", default=DEFAULT_PG_URL)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for backend in backends:
            for case in cases:
                with database(backend, args.pg) as url:
                    print(f"[{rnd + 1}/{args.rounds}] {backend} {case}", file=sys.stderr)
                    if case == "delayed":
                        found = case_delayed(url, args.delayed, args.calls)
                    elif case == "analyzed":
                        found = case_analyzed(url, args.analyzed, args.calls)
                    elif case in ("held_by_run", "held_by_run_waiting"):
                        heads = "running" if case == "held_by_run" else "waiting"
                        found = case_runs(url, args.runs, args.waiting, args.calls, heads)
                    elif case == "held_none":
                        found = case_none(url, args.calls)
                    elif case == "running_none":
                        found = case_running(url, args.runs, args.calls)
                    elif case.startswith("held_by_"):
                        found = case_held(url, args.held, args.calls, case.removeprefix("held_by_"))
                    else:
                        found = case_queues(url, args.due, args.calls)
                for name, figures in found.items():
                    runs.append({"round": rnd, "backend": backend, "measure": name, **figures})
    rows = []
    print("| database | claim | p50 ms | p99 ms |\n|---|---|---:|---:|")
    for backend in backends:
        for measure in (
            "claim_one_queue_3_due",
            "claim_one_queue",
            "claim_two_queues",
            "analyzed_claim_of_1",
            "analyzed_claim_of_32",
            "held_none",
            "held_by_rate",
            "held_by_gate",
            "running_none",
            "held_by_run",
            "held_by_run_waiting",
        ):
            mine = [r for r in runs if r["backend"] == backend and r["measure"] == measure]
            if not mine:
                continue
            p50 = statistics.median(r["p50_ms"] for r in mine)
            p99 = statistics.median(r["p99_ms"] for r in mine)
            rows.append({"backend": backend, "measure": measure, "p50_ms": p50, "p99_ms": p99})
            print(f"| {backend} | {measure} | {p50:.2f} | {p99:.2f} |")
    commit = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    output = args.output or HERE / "results" / f"claim-scans-{dt.date.today().isoformat()}.json"
    output.write_text(
        json.dumps(
            {
                "benchmark": "claim_scans",
                "settings": {k: v for k, v in vars(args).items() if k != "output"},
                "environment": {"python": platform.python_version(), "commit": commit},
                "summary": rows,
                "runs": runs,
            },
            indent=1,
            default=str,
        )
        + "\n"
    )
    print(f"wrote {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
