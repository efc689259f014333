"""Celery end-to-end benchmark: sqlease (PostgreSQL, SQLite) beside Redis, RabbitMQ and Kombu's
SQLAlchemy transport, in one run, same worker settings (prefork -c 2, prefetch multiplier 4).

For each broker:
- ``delay()`` rate: N no-op tasks published from one process (no worker running);
- drain: a worker started on that backlog, tasks/s until the N completions arrive;
- idle latency: ``delay()``-to-start p50/p99, one task at a time with the worker idle;
and, for result backends, the round trip ``add.delay(2, 2).get()`` p50/p99 with sqlease's
backend on PostgreSQL beside Redis's and RabbitMQ's ``rpc://``, then the idle latency again
with the result backend configured in the worker and the client.

Completions are counted by UDP datagrams from the tasks (tests/benchmarks only).
Usage: python benchmarks/celery_bench.py [--tasks 10000] [--rounds 3] [--only sqlease-pg,redis]
[--quick] [--output FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PG = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
#: sqlease transport options given to every sqlease run (JSON), before a run's own.
BASE_OPTIONS: dict[str, Any] = json.loads(os.environ.get("BENCH_TRANSPORT_OPTIONS") or "{}")


@dataclass
class Broker:
    name: str
    url: str
    backend: str | None = None  # for the round-trip measurement
    latency_samples: int = 200
    options: dict[str, Any] | None = None  # sqlease transport options of this run


def brokers(tmp: Path, prefix: str) -> list[Broker]:
    pg_host = PG.split("://", 1)[1]
    return [
        Broker("sqlease-pg", f"sqlease+{PG}", backend=f"sqlease+{PG}"),
        # Publishes that do not wait for the WAL flush (an opt-in, publish_sync_commit in
        # docs/reference/transport-options.md): its delay() and start latency; the drain is
        # the default's.
        Broker(
            "sqlease-pg-publish-nowait", f"sqlease+{PG}", options={"publish_sync_commit": False}
        ),
        Broker(
            "sqlease-sqlite",
            f"sqlease+sqlite:///{tmp}/bench.db",
            backend=f"sqlease+sqlite:///{tmp}/bench.db",
        ),
        Broker("redis", "redis://127.0.0.1:6379/15", backend="redis://127.0.0.1:6379/14"),
        Broker("rabbitmq", "amqp://guest:guest@127.0.0.1:5672//", backend="rpc://"),
        Broker("kombu-sqla-pg", f"sqla+postgresql+psycopg://{pg_host}", latency_samples=20),
        # Kombu's SQLAlchemy transport on the same kind of file as sqlease's SQLite run: the
        # fair denominator for the SQLite ratio.
        Broker("kombu-sqla-sqlite", f"sqla+sqlite:///{tmp}/kombu.db", latency_samples=20),
    ]


class Counter:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * 1024 * 1024)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

    def drain(self) -> None:
        self.sock.setblocking(False)
        try:
            while True:
                self.sock.recv(64)
        except BlockingIOError:
            pass
        finally:
            self.sock.setblocking(True)

    def wait(self, count: int, timeout: float) -> list[bytes]:
        got: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self.sock.settimeout(remaining)
            try:
                got.append(self.sock.recv(64))
            except TimeoutError:
                break
        return got


def start_worker(
    env: dict[str, str], log: Path, *, queues: str | None = None, name: str = "bench"
) -> subprocess.Popen[bytes]:
    """``celery worker -P prefork -c 2`` of bench_app (``queues``: its ``-Q``)."""
    handle = log.open("ab")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench_app",
            "worker",
            "--pool",
            "prefork",
            "-c",
            "2",
            "-l",
            "warning",
            "-n",
            f"{name}-{uuid.uuid4().hex[:6]}@%h",
            "--without-mingle",
            "--without-gossip",
            *(["-Q", queues] if queues else []),
        ],
        env=env,
        cwd=HERE,
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def app_for(broker: Broker, backend: str | None, env: dict[str, str]) -> Any:
    os.environ.update({k: v for k, v in env.items() if k.startswith("BENCH_")})
    if backend:
        os.environ["BENCH_BACKEND"] = backend
    else:
        os.environ.pop("BENCH_BACKEND", None)
    sys.path.insert(0, str(HERE))
    for name in list(sys.modules):
        if name == "bench_app":
            del sys.modules[name]
    import bench_app

    return bench_app


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def broker_env(broker: Broker, counter: Counter, prefix: str) -> dict[str, str]:
    """The environment of bench_app (this process's and the worker's) for ``broker``,
    without a result backend."""
    env = dict(
        os.environ,
        BENCH_BROKER=broker.url,
        BENCH_UDP=str(counter.port),
        BENCH_PREFIX=prefix,
        # bench_app first, then the caller's path (e.g. benchmarks/paired.py's src/)
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        BENCH_TRANSPORT_OPTIONS=json.dumps({**BASE_OPTIONS, **(broker.options or {})}),
    )
    env.pop("BENCH_BACKEND", None)
    return env


def run_broker(
    broker: Broker, tasks: int, counter: Counter, tmp: Path, prefix: str, quick: bool
) -> dict[str, Any]:
    env = broker_env(broker, counter, prefix)
    log = tmp / f"{broker.name}.log"
    mod = app_for(broker, None, env)
    app = mod.app
    out: dict[str, Any] = {"broker": broker.name}
    try:
        app.control.purge()
    except Exception:
        pass
    # 1. delay() rate on an idle broker
    mod.noop.delay()  # connect and declare first
    started = time.perf_counter()
    for _ in range(tasks):
        mod.noop.delay()
    out["delay_per_s"] = round(tasks / (time.perf_counter() - started), 1)
    # 2. drain the backlog (tasks + 1)
    counter.drain()
    worker = start_worker(env, log)
    try:
        first = counter.wait(1, 60)
        if not first:
            raise RuntimeError(f"{broker.name}: worker did not start (see {log})")
        t0 = time.perf_counter()
        rest = counter.wait(tasks, 600)
        elapsed = time.perf_counter() - t0
        out["drained"] = len(rest) + 1
        out["drain_per_s"] = round(len(rest) / elapsed, 1) if elapsed > 0 else None
        # 3. idle latency, one at a time
        out.update(idle_start(mod, counter, broker, quick, "start"))
    finally:
        stop_worker(worker)
    # 4. round trip through the result backend
    if broker.backend:
        env_rt = dict(env, BENCH_BACKEND=broker.backend)
        mod = app_for(broker, broker.backend, env_rt)
        worker = start_worker(env_rt, log)
        try:
            mod.add.delay(1, 1).get(timeout=60)
            rtts = []
            for _ in range(20 if quick else 200):
                t = time.perf_counter()
                assert mod.add.delay(2, 2).get(timeout=10) == 4
                rtts.append((time.perf_counter() - t) * 1000)
            out["get_p50_ms"] = round(percentile(rtts, 0.5), 2)
            out["get_p99_ms"] = round(percentile(rtts, 0.99), 2)
            out["backend"] = broker.backend.split(":")[0]
            # 5. idle latency again, the worker and the client with the result backend set
            out.update(idle_start(mod, counter, broker, quick, "start_backend"))
        finally:
            stop_worker(worker)
    return out


def idle_start(
    mod: Any, counter: Counter, broker: Broker, quick: bool, key: str
) -> dict[str, float]:
    """``delay()`` to task start, one task at a time with the worker idle: p50/p99 in ms."""
    samples: list[float] = []
    n = min(broker.latency_samples, 20 if quick else broker.latency_samples)
    counter.drain()
    for _ in range(n):
        time.sleep(0.05)
        mod.stamp.delay(time.time())
        got = counter.wait(1, 10)
        if got and got[0].startswith(b"l"):
            samples.append(float(got[0][1:]) * 1000)
    if not samples:
        return {}
    return {
        f"{key}_p50_ms": round(percentile(samples, 0.5), 2),
        f"{key}_p99_ms": round(percentile(samples, 0.99), 2),
    }


def drop_tables(prefix: str, *, kombu: bool = True) -> None:
    """Drop this run's sqlease tables (``prefix``) and, with ``kombu``, Kombu SQLAlchemy's from
    the benchmark database: left behind, a few runs' events and bloat made later runs
    measurably slower (the checkpoints' I/O). Kombu creates its tables once per process (its
    engine cache), so they are dropped only when the whole run ends."""
    import psycopg

    like = prefix.replace("_", r"\_") + "%"
    kinds = [
        # (what to drop, how to list them: a query whose %s is the prefix's LIKE pattern)
        (
            "TABLE",
            "SELECT format('%%I', tablename) FROM pg_tables WHERE schemaname = "
            "current_schema() AND (tablename LIKE %s"
            + (" OR tablename LIKE 'kombu_%%')" if kombu else ")"),
            " CASCADE",
        ),
        (
            "SEQUENCE",
            "SELECT format('%%I', sequencename) FROM pg_sequences WHERE schemaname = "
            "current_schema() AND sequencename LIKE %s",
            "",
        ),
    ]
    try:
        with psycopg.connect(PG, autocommit=True) as conn:
            for kind, listing, suffix in kinds:
                names = [row[0] for row in conn.execute(listing, (like,))]
                if names:
                    conn.execute(f"DROP {kind} IF EXISTS {', '.join(names)}{suffix}")
    except psycopg.Error as exc:
        print(f"could not drop the benchmark's tables: {exc}", file=sys.stderr)


#: The ratios the targets are stated in: (name, numerator, denominator, metric).
RATIOS = [
    ("pg_drain_vs_rabbitmq", "sqlease-pg", "rabbitmq", "drain_per_s"),
    ("pg_drain_vs_redis", "sqlease-pg", "redis", "drain_per_s"),
    ("pg_delay_vs_redis", "sqlease-pg", "redis", "delay_per_s"),
    ("pg_publish_nowait_delay_vs_redis", "sqlease-pg-publish-nowait", "redis", "delay_per_s"),
    ("sqlite_drain_vs_redis", "sqlease-sqlite", "redis", "drain_per_s"),
    ("pg_drain_vs_kombu_sqla", "sqlease-pg", "kombu-sqla-pg", "drain_per_s"),
    ("sqlite_drain_vs_kombu_sqla_pg", "sqlease-sqlite", "kombu-sqla-pg", "drain_per_s"),
    ("sqlite_drain_vs_kombu_sqla_sqlite", "sqlease-sqlite", "kombu-sqla-sqlite", "drain_per_s"),
    ("pg_get_p50_vs_redis", "sqlease-pg", "redis", "get_p50_ms"),
    ("pg_start_p50_vs_rabbitmq", "sqlease-pg", "rabbitmq", "start_p50_ms"),
    ("pg_start_backend_p50_vs_rabbitmq", "sqlease-pg", "rabbitmq", "start_backend_p50_ms"),
    ("pg_get_p50_vs_rabbitmq", "sqlease-pg", "rabbitmq", "get_p50_ms"),
]


def ratios_of(by: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, a, b, key in RATIOS:
        x, y = by.get(a, {}).get(key), by.get(b, {}).get(key)
        out[name] = round(x / y, 2) if x and y else None
    return out


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return round((ordered[middle - 1] + ordered[middle]) / 2, 2)


def run_round(
    number: int,
    args: argparse.Namespace,
    tasks: int,
    tmp: Path,
    counter: Counter,
    rounds: list[list[dict[str, Any]]],
) -> None:
    """Every chosen broker once; the results are appended to ``rounds``."""
    # Fresh tables and a fresh SQLite file per round: a round does not inherit the
    # previous rounds' rows.
    prefix = f"bench{os.getpid()}r{number}_"
    where = tmp / f"round{number}"
    where.mkdir()
    chosen = [b for b in brokers(where, prefix) if not args.only or b.name in args.only.split(",")]
    if number % 2 == 0:
        chosen.reverse()
    results = []
    try:
        for broker in chosen:
            try:
                result = run_broker(broker, tasks, counter, where, prefix, args.quick)
            except Exception as exc:  # a missing baseline must not hide the others
                result = {"broker": broker.name, "error": f"{type(exc).__name__}: {exc}"}
            result["round"] = number
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        drop_tables(prefix, kombu=False)
    rounds.append(results)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--only", default="")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON file to write (default: results/celery-<date>[-quick].json)",
    )
    # This machine's speed drifts by tens of percent within minutes, so one pass (brokers
    # one after the other) can favour whichever ran in a fast minute. Rounds run every broker
    # once each, in alternating order; each round's ratios compare neighbours in time, and
    # the reported ratio is their median.
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    tasks = 300 if args.quick else args.tasks
    tmp = Path(tempfile.mkdtemp(prefix="sqlease-bench-"))
    counter = Counter()
    rounds: list[list[dict[str, Any]]] = []
    try:
        for number in range(1, args.rounds + 1):
            run_round(number, args, tasks, tmp, counter, rounds)
    finally:
        drop_tables(f"bench{os.getpid()}r", kombu=True)  # every round's, and Kombu's
    per_round = [ratios_of({r["broker"]: r for r in results}) for results in rounds]
    ratios: dict[str, Any] = {}
    for name, *_ in RATIOS:
        values = [r[name] for r in per_round if r[name] is not None]
        ratios[name] = median(values) if values else None
    # Per broker, the median of each measurement over the rounds.
    summary: list[dict[str, Any]] = []
    names = list(dict.fromkeys(r["broker"] for results in rounds for r in results))
    for name in names:
        runs = [r for results in rounds for r in results if r["broker"] == name]
        row: dict[str, Any] = {"broker": name}
        for key in (
            "delay_per_s",
            "drain_per_s",
            "start_p50_ms",
            "start_p99_ms",
            "start_backend_p50_ms",
            "start_backend_p99_ms",
            "get_p50_ms",
            "get_p99_ms",
        ):
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                row[key] = median(values)
        summary.append(row)
    if args.rounds > 1:
        for row in summary:
            print(json.dumps({"median": row}), flush=True)
    print(json.dumps({"ratios": ratios, "per_round": per_round}), flush=True)
    stamp = time.strftime("%Y-%m-%d")
    path = args.output or HERE / "results" / f"celery-{stamp}{'-quick' if args.quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "tasks": tasks,
                "rounds": args.rounds,
                "results": summary,
                "ratios": ratios,
                "ratios_per_round": per_round,
                "runs": [r for results in rounds for r in results],
            },
            indent=2,
        )
    )
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
