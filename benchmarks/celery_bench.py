"""Celery end-to-end benchmark: sqlease (PostgreSQL, SQLite) beside Redis, RabbitMQ and Kombu's
SQLAlchemy transport, in one run, same worker settings (prefork -c 2, prefetch multiplier 4).

The like-for-like anchors of a durable publish run beside them: ``rabbitmq-confirms``
(RabbitMQ with publisher confirms, ``broker_transport_options={"confirm_publish": True}``,
persistent messages: Celery's default delivery mode) and ``redis-fsync`` (a throwaway
``redis-server`` of the benchmark's own, its own port and directory, ``--appendonly yes
--appendfsync always --save ''``, started for each round and stopped after it). And for the
drain, ``rabbitmq-acks-late``: RabbitMQ acking as sqlease does by default (``task_acks_late``
and ``task_reject_on_worker_lost``: a worker killed mid-task loses nothing), where the other
brokers run Celery's default (the ack before the task runs).

For each broker:
- ``delay()`` rate: N no-op tasks published from one process (no worker running);
- drain: a worker started on that backlog, tasks/s until the N completions arrive;
- idle latency: ``delay()``-to-start p50/p99, one task at a time with the worker idle;
- back-to-back latency: ``delay()``-to-start p50/p99 with the worker hot, each ``delay()``
  made as soon as the previous task has started (its UDP datagram received);
- with ``--producers P``: the ``delay()`` rate of P publishers (``--producer-kind threads``,
  ``processes`` or both) splitting N tasks, total publishes/s (then the queue is purged);
- with ``--group G``: the wall time of ``group(noop.s() for _ in range(G)).apply_async()``
  after a warm-up group (benchmarks/group_publish.py measures groups in more detail);
and, for result backends (sqlease's beside Redis's and RabbitMQ's ``rpc://``): a backlog of
N/3 tasks drained with each result stored (tasks/s, counted after each result's write), the
round trip ``add.delay(2, 2).get()`` p50/p99 back to back with the worker hot, then the idle
latency again with the result backend configured in the worker and the client.

Per round, the ratios the targets are stated in (``GOALS``) and their medians, printed as a
Markdown table and written to the JSON. Completions are counted by UDP datagrams from the tasks
(tests/benchmarks only).
Usage: python benchmarks/celery_bench.py [--tasks 10000] [--rounds 3] [--only sqlease-pg,redis]
[--producers 4 --producer-kind threads,processes] [--group 1000] [--quick] [--output FILE.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
    broker_options: dict[str, Any] | None = None  # another broker's transport options
    throwaway_redis: bool = False  # runs on the round's own redis-server (url: its port)
    acks_late: bool = False  # another broker's app acks late, as sqlease's does by default


def brokers(tmp: Path, prefix: str, fsync_port: int = 0) -> list[Broker]:
    """Every broker; ``fsync_port``: the port of the round's throwaway ``redis-server``."""
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
        # The like-for-like anchors of a durable publish: the broker confirms each persistent
        # message (Kombu waits for each confirm in turn); Redis writes and fsyncs its AOF
        # before it replies, on a server of its own (the machine's Redis is left as it is).
        Broker(
            "rabbitmq-confirms",
            "amqp://guest:guest@127.0.0.1:5672//",
            broker_options={"confirm_publish": True},
        ),
        Broker("rabbitmq-acks-late", "amqp://guest:guest@127.0.0.1:5672//", acks_late=True),
        Broker(
            "redis-fsync",
            f"redis://127.0.0.1:{fsync_port}/0",
            backend=f"redis://127.0.0.1:{fsync_port}/1",
            throwaway_redis=True,
        ),
        Broker("kombu-sqla-pg", f"sqla+postgresql+psycopg://{pg_host}", latency_samples=20),
        # Kombu's SQLAlchemy transport on the same kind of file as sqlease's SQLite run: the
        # fair denominator for the SQLite ratio.
        Broker("kombu-sqla-sqlite", f"sqla+sqlite:///{tmp}/kombu.db", latency_samples=20),
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ThrowawayRedis:
    """A ``redis-server`` of the benchmark's own: ``appendfsync always``, no RDB snapshots,
    its own port and directory; stopped by its pid."""

    def __init__(self, where: Path) -> None:
        self.port = free_port()
        self.dir = where / f"redis-fsync-{self.port}"
        self.dir.mkdir(parents=True)
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        argv += ["--dir", str(self.dir), "--logfile", str(self.dir / "redis.log")]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start (see {self.dir}/redis.log)")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


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
    if "BENCH_ACKS_LATE" not in env:  # an earlier broker's, in this process
        os.environ.pop("BENCH_ACKS_LATE", None)
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


def write_results(name: str, output: Path | None, **fields: Any) -> Path:
    """A benchmark's JSON: ``output``, else ``results/<name>-<today>.json``, with the load
    average at the end beside ``fields``."""
    path = output or HERE / "results" / f"{name}-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps({**fields, "load_average_end": os.getloadavg()}, indent=2))
    return path


def server_cpu(name: str) -> float:
    """CPU seconds (user + system) of every process named ``name`` now (``postgres``: the
    server's backends and its background processes). A process that exited is no longer
    counted: read it while the connections measured are open."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if comm.read().strip() != name:
                    continue
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


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
        BENCH_BROKER_OPTIONS=json.dumps(broker.broker_options or {}),
    )
    env.pop("BENCH_BACKEND", None)
    env.pop("BENCH_ACKS_LATE", None)
    if broker.acks_late:
        env["BENCH_ACKS_LATE"] = "1"
    return env


def shares(count: int, producers: int) -> list[int]:
    return [count // producers + (i < count % producers) for i in range(producers)]


def _publish_process(env: dict[str, str], count: int, barrier: Any) -> None:
    """One publishing process: connects (a first ``delay()``), waits for the others, then
    publishes ``count`` tasks."""
    os.environ.update(env)
    sys.path.insert(0, str(HERE))
    import bench_app

    bench_app.noop.delay()
    barrier.wait()
    for _ in range(count):
        bench_app.noop.delay()


def publish_parallel(mod: Any, env: dict[str, str], count: int, producers: int, kind: str) -> float:
    """Total ``delay()``/s of ``producers`` threads (sharing this process's app, as a threaded
    web server's requests do) or processes (each with its own app) splitting ``count`` tasks:
    timed from the moment all of them are connected and released to the last one's end."""
    if kind == "threads":
        barrier: Any = threading.Barrier(producers + 1)

        def work(n: int) -> None:
            mod.noop.delay()
            barrier.wait()
            for _ in range(n):
                mod.noop.delay()

        workers: list[Any] = [
            threading.Thread(target=work, args=(n,)) for n in shares(count, producers)
        ]
    else:
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(producers + 1)
        workers = [
            context.Process(target=_publish_process, args=(env, n, barrier))
            for n in shares(count, producers)
        ]
    for worker in workers:
        worker.start()
    barrier.wait(120)
    started = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    if kind == "processes" and any(w.exitcode for w in workers):
        raise RuntimeError("a publishing process failed")
    return round(count / elapsed, 1)


def group_publish(mod: Any, size: int) -> float:
    """ms of one ``group`` of ``size`` no-op tasks published (after a warm-up group of 10)."""
    from celery import group

    group(mod.noop.s() for _ in range(10)).apply_async()
    started = time.perf_counter()
    group(mod.noop.s() for _ in range(size)).apply_async()
    return round((time.perf_counter() - started) * 1000, 1)


def back_to_back(mod: Any, counter: Counter, n: int, key: str = "b2b_start") -> dict[str, float]:
    """``delay()`` to task start with the worker hot: each ``delay()`` made as soon as the
    previous task has reported its start. p50/p99 in ms."""
    counter.drain()
    samples: list[float] = []
    for i in range(n + 10):  # the first 10: warm-up
        mod.stamp.delay(time.time())
        got = counter.wait(1, 10)
        if got and got[0].startswith(b"l") and i >= 10:
            samples.append(float(got[0][1:]) * 1000)
    if not samples:
        return {}
    return {
        f"{key}_p50_ms": round(percentile(samples, 0.5), 2),
        f"{key}_p99_ms": round(percentile(samples, 0.99), 2),
    }


def run_broker(
    broker: Broker,
    tasks: int,
    counter: Counter,
    tmp: Path,
    prefix: str,
    quick: bool,
    producers: int = 0,
    kinds: tuple[str, ...] = (),
    group_size: int = 0,
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
        # 3b. back to back, the worker hot
        b2b = 20 if quick else 500 if broker.latency_samples >= 200 else broker.latency_samples
        out.update(back_to_back(mod, counter, b2b))
    finally:
        stop_worker(worker)
    # 3c. several publishers, then a group (no worker running); the queue purged after
    if producers or group_size:
        for kind in kinds if producers else ():
            out["producers"] = producers
            out[f"delay_{kind}_per_s"] = publish_parallel(mod, env, tasks, producers, kind)
        if group_size:
            out["group_size"] = group_size
            out["group_ms"] = group_publish(mod, group_size)
        mod.app.control.purge()
    # 4. round trip through the result backend
    if broker.backend:
        env_rt = dict(env, BENCH_BACKEND=broker.backend)
        mod = app_for(broker, broker.backend, env_rt)
        # 4a. a backlog drained with each result stored (counted after each result's write)
        backlog = max(1, tasks // 3)
        for n in range(backlog):
            mod.stored.delay(n)
        counter.drain()
        worker = start_worker(env_rt, log)
        try:
            first = counter.wait(1, 60)
            if first:
                t0 = time.perf_counter()
                rest = counter.wait(backlog - 1, 600)
                elapsed = time.perf_counter() - t0
                out["drain_backend_tasks"] = len(rest) + 1
                if rest and elapsed > 0:
                    out["drain_backend_per_s"] = round(len(rest) / elapsed, 1)
            mod.add.delay(1, 1).get(timeout=60)
            rtts = []
            for _ in range(20 if quick else 200):
                t = time.perf_counter()
                assert mod.add.delay(2, 2).get(timeout=10) == 4
                rtts.append((time.perf_counter() - t) * 1000)
            # back to back, the worker hot (each delay() once the previous get() returned)
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
    # Draining a backlog with each result stored, each with its own backend (RabbitMQ's rpc://).
    ("pg_drain_backend_vs_redis", "sqlease-pg", "redis", "drain_backend_per_s"),
    ("pg_drain_backend_vs_rabbitmq", "sqlease-pg", "rabbitmq", "drain_backend_per_s"),
    ("pg_drain_backend_vs_redis_fsync", "sqlease-pg", "redis-fsync", "drain_backend_per_s"),
    ("pg_start_p50_vs_rabbitmq", "sqlease-pg", "rabbitmq", "start_p50_ms"),
    ("pg_start_backend_p50_vs_rabbitmq", "sqlease-pg", "rabbitmq", "start_backend_p50_ms"),
    ("pg_get_p50_vs_rabbitmq", "sqlease-pg", "rabbitmq", "get_p50_ms"),
    # Like for like: a durable publish against the anchors that are durable too.
    ("pg_delay_vs_rabbitmq_confirms", "sqlease-pg", "rabbitmq-confirms", "delay_per_s"),
    ("pg_delay_vs_redis_fsync", "sqlease-pg", "redis-fsync", "delay_per_s"),
    ("pg_drain_vs_rabbitmq_confirms", "sqlease-pg", "rabbitmq-confirms", "drain_per_s"),
    ("pg_drain_vs_rabbitmq_acks_late", "sqlease-pg", "rabbitmq-acks-late", "drain_per_s"),
    ("pg_drain_vs_redis_fsync", "sqlease-pg", "redis-fsync", "drain_per_s"),
    ("pg_get_p50_vs_redis_fsync", "sqlease-pg", "redis-fsync", "get_p50_ms"),
    # Back to back, the worker hot.
    ("pg_b2b_start_p50_vs_rabbitmq", "sqlease-pg", "rabbitmq", "b2b_start_p50_ms"),
    ("pg_b2b_start_p50_vs_redis", "sqlease-pg", "redis", "b2b_start_p50_ms"),
    (
        "pg_b2b_start_p50_vs_rabbitmq_confirms",
        "sqlease-pg",
        "rabbitmq-confirms",
        "b2b_start_p50_ms",
    ),
    # Several publishers (--producers): the same number of threads or processes each side.
    ("pg_threads_delay_vs_redis_threads", "sqlease-pg", "redis", "delay_threads_per_s"),
    ("pg_threads_delay_vs_redis_fsync_threads", "sqlease-pg", "redis-fsync", "delay_threads_per_s"),
    (
        "pg_threads_delay_vs_rabbitmq_confirms_threads",
        "sqlease-pg",
        "rabbitmq-confirms",
        "delay_threads_per_s",
    ),
    ("pg_processes_delay_vs_redis_processes", "sqlease-pg", "redis", "delay_processes_per_s"),
    (
        "pg_processes_delay_vs_redis_fsync_processes",
        "sqlease-pg",
        "redis-fsync",
        "delay_processes_per_s",
    ),
    # A group's publish time (--group): the anchor's over sqlease's would be a speed ratio;
    # kept as the others' latency ratios, sqlease's over the anchor's (below 1: faster).
    ("pg_group_ms_vs_redis", "sqlease-pg", "redis", "group_ms"),
    ("pg_group_ms_vs_rabbitmq", "sqlease-pg", "rabbitmq", "group_ms"),
    ("pg_group_ms_vs_rabbitmq_confirms", "sqlease-pg", "rabbitmq-confirms", "group_ms"),
    ("pg_group_ms_vs_redis_fsync", "sqlease-pg", "redis-fsync", "group_ms"),
]

#: The targets of issue 37 (ratio, what it says, ">=" or "<=", the goal, the figure then).
GOALS = [
    ("pg_drain_vs_rabbitmq", "drain / RabbitMQ", ">=", 1.0, 0.87),
    (
        "pg_delay_vs_rabbitmq_confirms",
        "durable `delay()` / RabbitMQ with confirms",
        ">=",
        1.0,
        1.14,
    ),
    (
        "pg_delay_vs_redis_fsync",
        "durable `delay()` / Redis with `appendfsync always`",
        ">=",
        1.0,
        0.78,
    ),
    (
        "pg_publish_nowait_delay_vs_redis",
        "`delay()` with `publish_sync_commit: False` / Redis",
        ">=",
        0.9,
        0.64,
    ),
    (
        "pg_threads_delay_vs_redis_threads",
        "{producers} threads durable / Redis {producers} threads",
        ">=",
        1.0,
        0.89,
    ),
    ("pg_b2b_start_p50_vs_rabbitmq", "start p50, back-to-back / RabbitMQ", "<=", 1.5, 2.85),
    (
        "pg_get_p50_vs_redis",
        "`delay().get()` p50 with sqlease's backend / Redis's",
        "<=",
        1.0,
        1.78,
    ),
]


def ratios_of(by: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, a, b, key in RATIOS:
        x, y = by.get(a, {}).get(key), by.get(b, {}).get(key)
        out[name] = round(x / y, 2) if x and y else None
    return out


def goals_table(
    per_round: list[dict[str, float | None]], ratios: dict[str, Any], producers: int
) -> tuple[str, list[dict[str, Any]]]:
    """The targets' ratios per round, their medians and whether each goal is met: a Markdown
    table and its rows."""
    lines = [
        "| ratio (sqlease PostgreSQL / anchor) | rounds | median | goal | met? |",
        "|---|---|---:|---:|---|",
    ]
    rows = []
    for name, label, op, goal, then in GOALS:
        rounds = [r.get(name) for r in per_round]
        value = ratios.get(name)
        met = None if value is None else value >= goal if op == ">=" else value <= goal
        text = label.format(producers=producers or "N")
        rows.append(
            {
                "ratio": name,
                "label": text,
                "rounds": rounds,
                "median": value,
                "goal": f"{op} {goal}",
                "then": then,
                "met": met,
            }
        )
        cells = ", ".join("-" if v is None else f"{v:.2f}" for v in rounds)
        verdict = "-" if met is None else "yes" if met else "**no**"
        shown = "-" if value is None else f"{value:.2f}"
        lines.append(f"| {text} | {cells} | {shown} | {op} {goal} | {verdict} |")
    return "\n".join(lines), rows


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
    wanted = args.only.split(",") if args.only else None
    chosen = [b for b in brokers(where, prefix) if not wanted or b.name in wanted]
    # redis-fsync: a fresh server (empty AOF) for the round, stopped when the round ends
    server = None
    if any(b.throwaway_redis for b in chosen):
        try:
            server = ThrowawayRedis(where)
        except (OSError, RuntimeError) as exc:  # no redis-server: the other brokers still run
            print(f"redis-fsync left out: {exc}", file=sys.stderr, flush=True)
            chosen = [b for b in chosen if not b.throwaway_redis]
    if server:
        chosen = [b for b in brokers(where, prefix, server.port) if not wanted or b.name in wanted]
    if number % 2 == 0:
        chosen.reverse()
    kinds = tuple(k for k in args.producer_kind.split(",") if k)
    results = []
    try:
        for broker in chosen:
            try:
                result = run_broker(
                    broker,
                    tasks,
                    counter,
                    where,
                    prefix,
                    args.quick,
                    args.producers,
                    kinds,
                    args.group,
                )
            except Exception as exc:  # a missing baseline must not hide the others
                result = {"broker": broker.name, "error": f"{type(exc).__name__}: {exc}"}
            result["round"] = number
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        drop_tables(prefix, kombu=False)
        if server:
            server.stop()
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
    parser.add_argument(
        "--producers", type=int, default=0, help="also the delay() rate of N publishers"
    )
    parser.add_argument(
        "--producer-kind",
        default="threads",
        help="threads, processes, or threads,processes (both, one after the other)",
    )
    parser.add_argument(
        "--group", type=int, default=0, help="also the publish time of a group of G tasks"
    )
    args = parser.parse_args()
    if any(k not in ("threads", "processes") for k in args.producer_kind.split(",")):
        parser.error("--producer-kind: threads, processes or threads,processes")
    tasks = 300 if args.quick else args.tasks
    tmp = Path(tempfile.mkdtemp(prefix="sqlease-bench-"))
    load_before = os.getloadavg()  # a shared machine: what else was running, start and end
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
            "delay_threads_per_s",
            "delay_processes_per_s",
            "group_ms",
            "drain_per_s",
            "drain_backend_per_s",
            "start_p50_ms",
            "start_p99_ms",
            "b2b_start_p50_ms",
            "b2b_start_p99_ms",
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
    table, goals = goals_table(per_round, ratios, args.producers)
    print(table, flush=True)
    stamp = time.strftime("%Y-%m-%d")
    path = args.output or HERE / "results" / f"celery-{stamp}{'-quick' if args.quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "command": " ".join(["python", *sys.argv]),
                "tasks": tasks,
                "rounds": args.rounds,
                "producers": args.producers,
                "producer_kind": args.producer_kind if args.producers else None,
                "group": args.group,
                "load_average": {"start": load_before, "end": os.getloadavg()},
                "goals": goals,
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
