"""Lease store micro-benchmark: tasks claimed and acked per second through ``sqlease.Store``.

For SQLite (a WAL file in a temporary directory, ``synchronous=NORMAL``) and PostgreSQL (a
database made for the run and dropped at its end), with 1, 2 and 4 worker *processes* and
claim batches of 1 and 32:

1. pre-enqueue N tasks with ``Store.enqueue_many`` into fresh tables, then ``ANALYZE`` and
   ``CHECKPOINT`` (PostgreSQL) so that neither stale statistics nor a checkpoint triggered by
   the set-up lands in the measured window;
2. start the worker processes (multiprocessing, spawn); each opens its connection, waits at a
   barrier, then loops ``claim(["q"], owner, lease_ms=60000, limit=B)`` +
   ``ack([m.fence for m in batch])`` until a claim comes back empty;
3. throughput = tasks acked / (last worker's finish - first worker's start after the barrier).
   A configuration that has not drained after ``--max-seconds`` stops there (marked ``*``):
   the rate is then what was acked in that time.

Beside each PostgreSQL configuration, in the same run and right before it, ``pgbench`` measures
the ceiling of the same work done bare: claim B rows with ``FOR UPDATE SKIP LOCKED`` in one
statement (one commit), delete them in a second statement (a second commit), on a minimal table
that is pre-filled so that it never runs empty. ``pgbench`` tps x B = rows/s.

Each configuration is measured ``--repeat`` times (interleaved, so a slow spell of the machine
hits sqlease and pgbench alike); the table shows medians and the median of the per-repeat
sqlease/pgbench ratios.

    .venv/bin/python benchmarks/store.py            # full run, 3 repeats: 10-20 minutes
    .venv/bin/python benchmarks/store.py --quick    # smoke test, about a minute

Results: a Markdown table on stdout, progress on stderr, and everything (environment, each run,
the pgbench script) as JSON in ``benchmarks/results/store-<date>[-quick].json``. See
docs/performance.md for the numbers and how to read them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import queue
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, Engine, make_url

import sqlease
from sqlease import NewMessage, Store
from sqlease._db.engine import dispose_all

HERE = Path(__file__).resolve().parent
DEFAULT_PG_URL = os.environ.get(
    "SQLEASE_BENCH_PG_URL",
    os.environ.get("SQLEASE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"),
)
QUEUE = "q"
LEASE_MS = 60_000
ENQUEUE_CHUNK = 5_000

# Tasks per configuration (the backlog the workers drain): several seconds of work for a fast
# store on 2 cores; a slow configuration stops at --max-seconds instead.
FULL_TASKS = {
    ("sqlite", 1): 6_000,
    ("sqlite", 32): 40_000,
    ("postgresql", 1): 2_000,
    ("postgresql", 32): 20_000,
}
QUICK_TASKS = {
    ("sqlite", 1): 300,
    ("sqlite", 32): 2_000,
    ("postgresql", 1): 200,
    ("postgresql", 32): 2_000,
}


@dataclass
class WorkerResult:
    owner: str
    start: float
    end: float
    acked: int
    batches: int
    timed_out: bool = False
    error: str | None = None


@dataclass
class StoreRun:
    backend: str
    processes: int
    batch: int
    repeat: int
    tasks: int
    acked: int
    drained: bool
    seconds: float
    tasks_per_s: float
    per_worker_acked: list[int] = field(default_factory=list)
    mode: str = "separate"


@dataclass
class PgbenchRun:
    clients: int
    batch: int
    repeat: int
    seconds: int
    prefill_rows: int
    remaining_rows: int
    transactions: int
    failed: int
    tps: float
    rows_per_s: float


# ---- worker process -------------------------------------------------------------------------


def _worker(
    url: str,
    prefix: str,
    owner: str,
    batch: int,
    max_seconds: float,
    barrier: Any,
    results: Any,
    mode: str = "separate",
) -> None:
    """Claim and ack until the queue is empty (or ``max_seconds`` have passed); report
    timings through ``results``. ``separate``: ``claim`` then ``ack`` of the same batch (two
    statements, two commits); ``combined``: ``ack_and_claim``, the ack of the previous batch
    with the claim of the next, as a busy worker's event loop does (one statement)."""
    start = end = 0.0
    acked = batches = 0
    timed_out = False
    try:
        store = Store(url, table_prefix=prefix, auto_migrate=False)
        store.now_ms()  # open the pooled connection before the start line
        barrier.wait()
        # time.monotonic is CLOCK_MONOTONIC on Linux: comparable across processes.
        start = time.monotonic()
        deadline = start + max_seconds
        held: list[Any] = []
        while True:
            if mode == "combined":
                done, claimed = store.ack_and_claim(
                    [m.fence for m in held], [QUEUE], owner, lease_ms=LEASE_MS, limit=batch
                )
                acked += len(done)
                held = claimed
            else:
                claimed = store.claim([QUEUE], owner, lease_ms=LEASE_MS, limit=batch)
                if claimed:
                    acked += len(store.ack([m.fence for m in claimed]))
            if not claimed:
                break
            batches += 1
            if time.monotonic() >= deadline:
                timed_out = True
                break
        if held:  # stopped at the time limit with a batch in hand
            acked += len(store.ack([m.fence for m in held]))
        end = time.monotonic()
        results.put(WorkerResult(owner, start, end, acked, batches, timed_out))
    except BaseException as exc:  # reported to the parent, which fails the run
        barrier.abort()
        results.put(WorkerResult(owner, start, end, acked, batches, timed_out, repr(exc)))


# ---- sqlease runs -----------------------------------------------------------------------------


def _payload(size: int) -> str:
    body = '{"args": [], "kwargs": {}, "pad": "'
    return body + "x" * max(0, size - len(body) - 2) + '"}'


def _enqueue(store: Store, tasks: int, payload_bytes: int) -> None:
    payload = _payload(payload_bytes)
    for first in range(0, tasks, ENQUEUE_CHUNK):
        count = min(ENQUEUE_CHUNK, tasks - first)
        store.enqueue_many(
            [NewMessage(QUEUE, payload, task_id=str(uuid.uuid4())) for _ in range(count)]
        )


def _settle(store: Store) -> None:
    """PostgreSQL: what autovacuum would have done by now (it may be off on a test server):
    statistics for the planner; and a checkpoint, so that the set-up's dirty pages are not
    written out inside the measured window. (SQLite has no automatic ANALYZE: left as is.)"""
    if not store.is_postgresql:
        return
    with store.engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.exec_driver_sql(f"ANALYZE {store.tables.messages.name}")
        conn.exec_driver_sql("CHECKPOINT")


def _remaining(store: Store) -> int:
    with store.engine.connect() as conn:
        count = conn.execute(text(f"SELECT count(*) FROM {store.tables.messages.name}")).scalar()
        conn.rollback()
    return int(count or 0)


def _collect(workers: Sequence[Any], results: Any) -> list[WorkerResult]:
    """Every worker's report; fails fast when a worker dies without one."""
    reports: list[WorkerResult] = []
    while len(reports) < len(workers):
        try:
            reports.append(results.get(timeout=1.0))
        except queue.Empty:
            dead = [p for p in workers if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(
                    f"worker died: exit codes {[p.exitcode for p in dead]}"
                ) from None
    for proc in workers:
        proc.join(timeout=60)
    return reports


def run_store(
    backend: str,
    url: str,
    prefix: str,
    processes: int,
    batch: int,
    tasks: int,
    repeat: int,
    payload_bytes: int,
    max_seconds: float,
    mode: str = "separate",
) -> StoreRun:
    store = Store(url, table_prefix=prefix, sqlite_synchronous="NORMAL")
    _enqueue(store, tasks, payload_bytes)
    _settle(store)

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    workers = [
        ctx.Process(
            target=_worker,
            args=(url, prefix, f"bench-w{i}", batch, max_seconds, barrier, results, mode),
            daemon=True,
        )
        for i in range(processes)
    ]
    for proc in workers:
        proc.start()
    reports = _collect(workers, results)
    errors = [f"{r.owner}: {r.error}" for r in reports if r.error]
    if errors:
        raise RuntimeError("worker failed: " + "; ".join(errors))

    acked = sum(r.acked for r in reports)
    left = _remaining(store)
    if acked + left != tasks or (left and not any(r.timed_out for r in reports)):
        raise RuntimeError(f"{backend} P={processes} B={batch}: acked {acked}/{tasks}, {left} left")
    seconds = max(r.end for r in reports) - min(r.start for r in reports)
    return StoreRun(
        backend=backend,
        processes=processes,
        batch=batch,
        repeat=repeat,
        tasks=tasks,
        acked=acked,
        drained=left == 0,
        seconds=round(seconds, 4),
        tasks_per_s=round(acked / seconds, 1),
        per_worker_acked=sorted((r.acked for r in reports), reverse=True),
        mode=mode,
    )


# ---- pgbench ceiling --------------------------------------------------------------------------

PGBENCH_SCRIPT = """\
UPDATE q SET owner = :client_id WHERE id IN (SELECT id FROM q WHERE owner IS NULL ORDER BY id LIMIT {batch} FOR UPDATE SKIP LOCKED);
DELETE FROM q WHERE owner = :client_id;
"""  # noqa: E501  (pgbench takes one statement per line)


def _expected_rows_per_s(batch: int) -> int:
    # Generous guesses for the ceiling on a small machine; a run that empties the table is
    # repeated with twice the rows anyway.
    return min(5_000 * batch, 50_000)


def _prefill(engine: Engine, rows: int, payload_bytes: int) -> None:
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.exec_driver_sql(
            "CREATE TABLE IF NOT EXISTS q (id bigserial PRIMARY KEY, owner int, payload text)"
        )
        # Without it the DELETE by owner scans the whole table.
        conn.exec_driver_sql(
            "CREATE INDEX IF NOT EXISTS q_owner_ix ON q (owner) WHERE owner IS NOT NULL"
        )
        conn.exec_driver_sql("TRUNCATE q RESTART IDENTITY")
        conn.execute(
            text("INSERT INTO q (payload) SELECT :payload FROM generate_series(1, :rows)"),
            {"payload": _payload(payload_bytes), "rows": rows},
        )
        conn.exec_driver_sql("VACUUM ANALYZE q")
        conn.exec_driver_sql("CHECKPOINT")


def _pgbench_env_args(url: URL) -> tuple[dict[str, str], list[str]]:
    env = dict(os.environ)
    if url.password:
        env["PGPASSWORD"] = str(url.password)
    args = ["-h", url.host or "127.0.0.1", "-p", str(url.port or 5432)]
    if url.username:
        args += ["-U", url.username]
    return env, args


def run_pgbench(
    pgbench: str,
    url: URL,
    engine: Engine,
    workdir: Path,
    clients: int,
    batch: int,
    seconds: int,
    repeat: int,
    payload_bytes: int,
) -> PgbenchRun:
    script = workdir / f"claim-{batch}.sql"
    script.write_text(PGBENCH_SCRIPT.format(batch=batch))
    env, conn_args = _pgbench_env_args(url)
    rows = seconds * _expected_rows_per_s(batch) * 2
    for _ in range(4):
        _prefill(engine, rows, payload_bytes)
        cmd = [pgbench, "-n", "-c", str(clients), "-j", str(clients), "-T", str(seconds)]
        cmd += ["-f", str(script), *conn_args, str(url.database)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"pgbench failed ({proc.returncode}): {proc.stderr.strip()}")
        with engine.connect() as conn:
            remaining = int(conn.exec_driver_sql("SELECT count(*) FROM q").scalar() or 0)
            conn.rollback()
        if remaining > batch * clients:
            break
        rows *= 2  # it ran (nearly) empty: the rate is a lower bound, measure again
    else:
        raise RuntimeError(f"pgbench C={clients} B={batch} ran the table empty 4 times")
    tps = _parse(r"^tps = ([0-9.]+) \(without initial connection time\)", proc.stdout, float)
    return PgbenchRun(
        clients=clients,
        batch=batch,
        repeat=repeat,
        seconds=seconds,
        prefill_rows=rows,
        remaining_rows=remaining,
        transactions=int(
            _parse(r"^number of transactions actually processed: (\d+)", proc.stdout, int)
        ),
        failed=int(_parse(r"^number of failed transactions: (\d+)", proc.stdout, int, 0)),
        tps=round(tps, 1),
        rows_per_s=round(tps * batch, 1),
    )


def _parse(pattern: str, output: str, kind: type[float] | type[int], default: Any = None) -> Any:
    match = re.search(pattern, output, re.MULTILINE)
    if match is None:
        if default is not None:
            return default
        raise RuntimeError(f"pgbench output has no match for {pattern!r}:\n{output}")
    return kind(match.group(1))


# ---- databases --------------------------------------------------------------------------------


@contextmanager
def bench_database(admin_url: str, settings: dict[str, str]) -> Iterator[URL]:
    """A PostgreSQL database made for this run (``sqlease_bench_<pid>``), dropped at the end;
    ``settings`` become the database's defaults for every session (sqlease's and pgbench's)."""
    base = make_url(admin_url).set(drivername="postgresql+psycopg")
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    name = f"sqlease_bench_{os.getpid()}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        for key, value in settings.items():
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" SET {key} = {value}')
    try:
        yield base.set(database=name)
    finally:
        dispose_all(close=True)
        _drop_database(admin, name)
        admin.dispose()


def _drop_database(admin: Engine, name: str) -> None:
    # Retried: on a shared server another client may restart it or end connections meanwhile.
    for attempt in range(5):
        try:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            return
        except sqlalchemy.exc.OperationalError:
            if attempt == 4:
                raise
            admin.dispose()
            time.sleep(2)


def _pg_settings(engine: Engine) -> dict[str, str]:
    names = ("server_version", "fsync", "synchronous_commit", "wal_sync_method", "autovacuum")
    names += ("shared_buffers", "max_wal_size", "jit")
    with engine.connect() as conn:
        values = {n: str(conn.exec_driver_sql(f"SHOW {n}").scalar()) for n in names}
        conn.rollback()
    return values


# ---- reporting --------------------------------------------------------------------------------


@dataclass
class Row:
    backend: str
    mode: str
    processes: int
    batch: int
    tasks: int
    sqlease: list[float]
    pgbench: list[float]
    ratios: list[float]
    drained: bool = True

    @property
    def sqlease_median(self) -> float:
        return statistics.median(self.sqlease)

    @property
    def pgbench_median(self) -> float | None:
        return statistics.median(self.pgbench) if self.pgbench else None

    @property
    def ratio_median(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None


def summarize(store_runs: Sequence[StoreRun], pg_runs: Sequence[PgbenchRun]) -> list[Row]:
    keys = sorted(
        {(r.backend, r.mode, r.processes, r.batch, r.tasks) for r in store_runs},
        key=lambda k: (k[0] != "sqlite", k[3], k[2], k[1] != "separate"),
    )
    rows: list[Row] = []
    for backend, mode, procs, batch, tasks in keys:
        mine = [
            r
            for r in store_runs
            if (r.backend, r.mode, r.processes, r.batch) == (backend, mode, procs, batch)
        ]
        ceiling = {
            p.repeat: p.rows_per_s
            for p in pg_runs
            if backend == "postgresql" and (p.clients, p.batch) == (procs, batch)
        }
        ratios = [r.tasks_per_s / ceiling[r.repeat] for r in mine if ceiling.get(r.repeat)]
        rows.append(
            Row(
                backend,
                mode,
                procs,
                batch,
                tasks,
                sqlease=[r.tasks_per_s for r in mine],
                pgbench=list(ceiling.values()),
                ratios=ratios,
                drained=all(r.drained for r in mine),
            )
        )
    return rows


def _spread(values: Sequence[float]) -> str:
    if len(values) < 2:
        return ""
    return f" ({min(values):,.0f}-{max(values):,.0f})"


def format_table(rows: Sequence[Row]) -> str:
    lines = [
        "| backend | loop | processes | batch | tasks | sqlease tasks/s | pgbench rows/s | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        pg = r.pgbench_median
        ratio = r.ratio_median
        lines.append(
            f"| {r.backend} | {r.mode} | {r.processes} | {r.batch} | "
            f"{r.tasks:,}{'' if r.drained else '*'} | "
            f"{r.sqlease_median:,.0f}{_spread(r.sqlease)} | "
            f"{'-' if pg is None else f'{pg:,.0f}{_spread(r.pgbench)}'} | "
            f"{'-' if ratio is None else f'{ratio:.0%}'} |"
        )
    return "\n".join(lines)


def _git_head() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(HERE.parent), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


# ---- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small smoke run (pgbench -T 2)")
    parser.add_argument("--backends", default="sqlite,postgresql", help="comma-separated")
    parser.add_argument("--processes", default="1,2,4", help="worker processes, comma-separated")
    parser.add_argument("--batches", default="1,32", help="claim batch sizes, comma-separated")
    parser.add_argument(
        "--loops",
        default="separate,combined",
        help="worker loops: separate (claim, then ack: two statements per batch) and/or "
        "combined (ack_and_claim: one statement per batch, as a busy Celery worker)",
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="measurements per configuration (3; quick: 1)"
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply the number of tasks per configuration"
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop a configuration after this long even if tasks are left (15; quick: 5)",
    )
    parser.add_argument("--payload-bytes", type=int, default=256)
    parser.add_argument("--pgbench-seconds", type=int, default=None, help="-T (5; quick: 2)")
    parser.add_argument(
        "--pg-url", default=DEFAULT_PG_URL, help="server to create the benchmark database on"
    )
    parser.add_argument(
        "--pg-set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the benchmark database, for diagnosis (e.g. synchronous_commit=off)",
    )
    parser.add_argument("--pgbench", default=shutil.which("pgbench") or "/usr/bin/pgbench")
    parser.add_argument("--no-pgbench", action="store_true", help="skip the pgbench ceiling")
    parser.add_argument("--output", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--label", default=None, help="free text recorded in the JSON")
    return parser.parse_args(argv)


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[a-z_.]+", name.strip()) or not value.strip():
        raise SystemExit(f"--pg-set takes NAME=VALUE, not {text!r}")
    return name.strip(), "'" + value.strip().replace("'", "''") + "'"


def _loops(value: str) -> list[str]:
    modes = [v.strip() for v in value.split(",") if v.strip()]
    unknown = set(modes) - {"separate", "combined"}
    if not modes or unknown:
        raise SystemExit(f"--loops takes separate and/or combined, not {value!r}")
    return modes


def _ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v.strip()]


def _describe(run: StoreRun) -> str:
    cut = "" if run.drained else f" (stopped at the time limit: {run.acked:,}/{run.tasks:,})"
    return f"{run.tasks_per_s:,.0f} tasks/s{cut}"


def _note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Plan:
    repeat: int
    processes: list[int]
    batches: list[int]
    tasks: dict[tuple[str, int], int]
    scale: float
    payload_bytes: int
    pgbench: str | None
    pgbench_seconds: int
    max_seconds: float
    pg_settings: dict[str, str]
    modes: list[str] = field(default_factory=lambda: ["separate"])

    def tasks_for(self, backend: str, batch: int) -> int:
        base = self.tasks.get((backend, batch), self.tasks[(backend, 32 if batch > 1 else 1)])
        return max(1, int(base * self.scale))

    def configs(self) -> Iterator[tuple[int, int, int]]:
        """(repeat, batch, processes), repeats outermost so that repeats are interleaved."""
        for rep in range(self.repeat):
            for batch in self.batches:
                for procs in self.processes:
                    yield rep, batch, procs


def bench_sqlite(plan: Plan) -> list[StoreRun]:
    runs: list[StoreRun] = []
    with tempfile.TemporaryDirectory(prefix="sqlease-bench-") as tmp:
        for seq, (rep, batch, procs) in enumerate(plan.configs()):
            url = f"sqlite:///{Path(tmp) / f'run{seq}.db'}"
            tasks = plan.tasks_for("sqlite", batch)
            for mode in plan.modes:
                run = run_store(
                    "sqlite",
                    url,
                    f"b_{mode}_",
                    procs,
                    batch,
                    tasks,
                    rep,
                    plan.payload_bytes,
                    plan.max_seconds,
                    mode,
                )
                runs.append(run)
                _note(
                    f"[{rep + 1}/{plan.repeat}] sqlite  {mode} P={procs} B={batch}: "
                    f"{_describe(run)}"
                )
                dispose_all(close=True)
    return runs


def bench_postgresql(
    plan: Plan, admin_url: str, env: dict[str, Any]
) -> tuple[list[StoreRun], list[PgbenchRun]]:
    runs: list[StoreRun] = []
    pg_runs: list[PgbenchRun] = []
    with (
        bench_database(admin_url, plan.pg_settings) as pg_url,
        tempfile.TemporaryDirectory(prefix="sqlease-pgbench-") as tmp,
    ):
        engine = create_engine(pg_url, isolation_level="AUTOCOMMIT")
        env["postgresql"] = {**_pg_settings(engine), "database": pg_url.database}
        url = pg_url.render_as_string(hide_password=False)
        try:
            for seq, (rep, batch, procs) in enumerate(plan.configs()):
                tag = f"[{rep + 1}/{plan.repeat}]"
                if plan.pgbench is not None:
                    pg = run_pgbench(
                        plan.pgbench,
                        pg_url,
                        engine,
                        Path(tmp),
                        procs,
                        batch,
                        plan.pgbench_seconds,
                        rep,
                        plan.payload_bytes,
                    )
                    pg_runs.append(pg)
                    _note(f"{tag} pgbench C={procs} B={batch}: {pg.rows_per_s:,.0f} rows/s")
                tasks = plan.tasks_for("postgresql", batch)
                for mode in plan.modes:
                    run = run_store(
                        "postgresql",
                        url,
                        f"b{seq}_{mode[0]}_",
                        procs,
                        batch,
                        tasks,
                        rep,
                        plan.payload_bytes,
                        plan.max_seconds,
                        mode,
                    )
                    runs.append(run)
                    _note(f"{tag} sqlease {mode} P={procs} B={batch}: {_describe(run)}")
        finally:
            engine.dispose()
    return runs, pg_runs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # A plain ``kill`` still drops the benchmark database (finally blocks run on SystemExit).
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    plan = Plan(
        repeat=args.repeat or (1 if args.quick else 3),
        processes=_ints(args.processes),
        batches=_ints(args.batches),
        tasks=QUICK_TASKS if args.quick else FULL_TASKS,
        scale=args.scale,
        payload_bytes=args.payload_bytes,
        pgbench=None if args.no_pgbench else args.pgbench,
        pgbench_seconds=args.pgbench_seconds or (2 if args.quick else 5),
        max_seconds=args.max_seconds or (5.0 if args.quick else 15.0),
        pg_settings=dict(_setting(s) for s in args.pg_set),
        modes=_loops(args.loops),
    )
    backends = {b.strip() for b in args.backends.split(",") if b.strip()}
    sqlease_dir = Path(sqlease.__file__).resolve().parent
    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "sqlalchemy": sqlalchemy.__version__,
        "sqlite": sqlite3.sqlite_version,
        "sqlite_settings": {"journal_mode": "WAL", "synchronous": "NORMAL"},
        "sqlease": sqlease.__version__,
        "sqlease_path": str(sqlease_dir),
        # The work tree's commit describes the code measured only when sqlease is imported
        # from it (not, e.g., from a snapshot on PYTHONPATH: say which one with --label).
        "repo": _git_head() if sqlease_dir.is_relative_to(HERE.parent) else None,
        "label": args.label,
        "loadavg_start": os.getloadavg(),
    }
    started = time.monotonic()
    store_runs: list[StoreRun] = []
    pg_runs: list[PgbenchRun] = []
    if "sqlite" in backends:
        store_runs += bench_sqlite(plan)
    if "postgresql" in backends:
        more, pg_runs = bench_postgresql(plan, args.pg_url, env)
        store_runs += more
    env["loadavg_end"] = os.getloadavg()
    env["elapsed_s"] = round(time.monotonic() - started, 1)

    rows = summarize(store_runs, pg_runs)
    print()
    print(format_table(rows))
    if not all(r.drained for r in rows):
        print(
            f"* not drained: at least one run stopped after --max-seconds={plan.max_seconds:g} "
            "with tasks left (rate = tasks acked / time taken)"
        )

    output = args.output
    if output is None:
        suffix = "-quick" if args.quick else ""
        output = HERE / "results" / f"store-{dt.date.today().isoformat()}{suffix}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": "sqlease lease store: claim + ack throughput",
        "method": {
            "quick": args.quick,
            "repeat": plan.repeat,
            "tasks": {f"{b}/B={n}": plan.tasks_for(b, n) for b, n in plan.tasks},
            "queue": QUEUE,
            "lease_ms": LEASE_MS,
            "payload_bytes": plan.payload_bytes,
            "pgbench_seconds": plan.pgbench_seconds,
            "pgbench_script": PGBENCH_SCRIPT,
        },
        "environment": env,
        "summary": [
            {
                "backend": r.backend,
                "processes": r.processes,
                "batch": r.batch,
                "tasks": r.tasks,
                "drained": r.drained,
                "sqlease_tasks_per_s": r.sqlease_median,
                "pgbench_rows_per_s": r.pgbench_median,
                "ratio": None if r.ratio_median is None else round(r.ratio_median, 3),
            }
            for r in rows
        ],
        "store_runs": [asdict(r) for r in store_runs],
        "pgbench_runs": [asdict(p) for p in pg_runs],
    }
    output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
