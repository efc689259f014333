"""Soak: 30 minutes of steady Celery load on a throwaway PostgreSQL cluster with production
defaults, to show that sqlease's tables stop growing and its throughput holds.

What it does:

1. **Its own cluster.** ``initdb`` (PostgreSQL 15, trust auth, UTF-8) into a temporary
   directory and ``pg_ctl start`` on a free port from 55433 (127.0.0.1 and a socket in that
   directory). Its ``postgresql.conf`` is initdb's, autovacuum on, except the address lines.
   The cluster is stopped (``pg_ctl stop -m fast``, then its postmaster's pid) and the
   directory removed when the run ends, also on Ctrl-C, SIGTERM or an error; a watchdog
   process does the same if this process is killed. Run as root, initdb and the server run
   as the ``postgres`` user (``runuser``). The system cluster on 5432 is never touched.
2. **Load.** A real ``celery worker`` (prefork ``-c 2``, Celery's defaults otherwise:
   mingle, gossip and heartbeats on) on ``sqlease+postgresql://`` with the sqlease result
   backend, consuming ``celery`` and ``soak.backlog``. Before the soak a capacity batch
   measures what it drains (recorded, so that ``--rate`` can be judged). Then, for
   ``--minutes``:

   - ``--publishers`` processes (2) offer ``--rate`` tasks/s between them (default 250) on
     ``celery``: of them 2% raise, 0.5% raise ``Reject`` (dead messages), 1% retry once, 5%
     are ETA tasks (countdown 5-60 s);
   - a **standing backlog**: ``--backlog`` ready tasks (2,000) on ``soak.backlog``, which a
     cluster rate limit (``{"queue:soak.backlog": "20/s"}``, ``--backlog-rate``) drains
     slowly and the first publisher refills every second. On the stream's own queue a backlog
     would either drain (the offered load is below capacity) or make the run a saturated
     drain; on its own queue it stays in the table while the stream is served at once;
   - ``app.control.inspect().ping()`` and ``.active()`` every ``--inspect-seconds`` (15), and
     every fourth time a ``celery inspect ping`` process killed mid-call, whose reply queue
     only the idle-queue expiry removes;
   - a rolling restart of the worker every ``--restart-minutes`` (10): a new worker, then the
     old one's warm shutdown, leaving its ``*.celery.pidbox`` and ``celeryev.*`` queues behind.

   **Retention is short** so that pruning runs within the run: ``result_expires`` 180 s,
   ``event_retention_days`` and ``dead_retention_days`` 180 s, ``idle_queue_expiry`` 120 s,
   ``maintenance_interval`` 30 s (each a flag). Rows older than about 3.5 minutes go.
3. **Samples** every ``--sample-seconds`` (30): per sqlease table its total, heap and index
   size (``pg_total_relation_size``, ``pg_relation_size``, ``pg_indexes_size``), exact rows,
   ``n_live_tup``/``n_dead_tup``, autovacuum counts and ``last_autovacuum``, each index's
   size; the messages by queue and state; connections, the oldest open transaction and the
   running autovacuums; and in the window: completions (one UDP datagram per task
   execution), tasks/s, what each maintenance pass pruned, **claim latency** p50/p99 (a
   probe that five times a second enqueues one message on a queue of its own and times
   ``Store.claim`` and ``Store.ack``, under the load), the stream's **delay()-to-start**
   p50/p99, ``delay()`` time, ETA lateness and the ``inspect`` calls' replies.
4. **Output.** JSON (``--output``, default ``benchmarks/results/soak-<date>.json``): the
   settings, every sample, and a summary: throughput of the first five minutes against the
   last five (goal >= 0.9), each table's size at 10 minutes against the end (plateau), claim
   p99 per window. A plot (``--plot``, default ``docs/images/soak.png``): size per table,
   throughput, claim latency and start latency over time. A Markdown summary is printed.
   ``--keep-logs DIR`` keeps the workers' and the server's logs.

Runs shorter than 30 minutes scale the windows: the head and tail are min(5 min, a third
of the run), the plateau check compares the size at min(10 min, a third) with the end.

Usage (as root or as a user who may run initdb; takes ``--minutes`` plus about a minute)::

    python benchmarks/soak.py                                  # the 30-minute soak
    python benchmarks/soak.py --rate 150 --keep-logs /tmp/soak-logs   # a slower machine
    python benchmarks/soak.py --minutes 3 --sample-seconds 10 \\
        --output /tmp/soak.json --plot /tmp/soak.png           # a smoke run
    python benchmarks/soak.py --replot benchmarks/results/soak-DATE.json   # plot again
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PG_BIN = Path(os.environ.get("SOAK_PG_BIN", "/usr/lib/postgresql/15/bin"))
PREFIX = "sqlease_"  # sqlease's default table prefix (the cluster is ours alone)
BACKLOG_QUEUE = "soak.backlog"
PROBE_QUEUE = "soak.probe"
TAGS = {"m": "stream", "e": "eta", "b": "backlog", "t": "retried", "c": "capacity"}
OUTCOMES = {"s": "succeeded", "f": "failed", "j": "rejected", "r": "retry"}


# ---- the cluster -------------------------------------------------------------------------


def _as_postgres(*cmd: str) -> list[str]:
    """Run as the postgres user when we are root (initdb and postgres refuse root)."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else list(cmd)


def free_port(start: int) -> int:
    for port in range(start, start + 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # as PostgreSQL binds: a port left in TIME_WAIT by a previous run is free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}..{start + 199}")


class Cluster:
    """A throwaway PostgreSQL cluster in ``root``."""

    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.data = root / "data"
        self.port = port
        self.log = root / "postgres.log"
        self.started = False

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *cmd: str, timeout: float = 120) -> None:
        done = subprocess.run(
            _as_postgres(*cmd),
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,  # a Ctrl-C meant for us does not reach the server
        )
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed: {done.stdout}{done.stderr}")

    def start(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self._run(
            str(PG_BIN / "initdb"),
            "-D",
            str(self.data),
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
        )
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# benchmarks/soak.py: its own address; everything else is initdb's default\n"
                "listen_addresses = '127.0.0.1'\n"
                f"port = {self.port}\n"
                f"unix_socket_directories = '{self.root}'\n"
            )
        self.started = True
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "start")

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        if not self.started:
            return
        try:
            self._run(
                str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop", timeout=90
            )
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            pid = self.postmaster_pid()
            print(f"pg_ctl stop: {exc}; signalling postmaster {pid}", file=sys.stderr)
            if pid:
                for sig, wait in ((signal.SIGQUIT, 10), (signal.SIGKILL, 5)):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
                    deadline = time.monotonic() + wait
                    while time.monotonic() < deadline and _alive(pid):
                        time.sleep(0.2)
        self.started = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_watchdog(main: int, root: Path) -> None:
    """Run in a process of its own: once ``main`` is gone without cleaning up (SIGKILL), stop
    the process groups it started (their ids in ``root/pgids``), then the cluster, and
    remove ``root``."""
    while _alive(main):
        time.sleep(2)
    if not root.exists():
        return  # main cleaned up
    try:
        groups = [int(g) for g in (root / "pgids").read_text().split()]
    except (OSError, ValueError):
        groups = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(3)
    cluster = Cluster(root, 0)
    cluster.started = (cluster.data / "postmaster.pid").exists()
    cluster.stop()
    shutil.rmtree(root, ignore_errors=True)


def start_watchdog(cluster: Cluster) -> subprocess.Popen[bytes]:
    """If this process dies without cleaning up (SIGKILL), stop what it started."""
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--watchdog", str(os.getpid())],
        env=dict(os.environ, SOAK_ROOT=str(cluster.root)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


# ---- processes ---------------------------------------------------------------------------


class Children:
    """Every process this run starts, each in a session of its own (stopped by its group id;
    the watchdog reads their ids from ``root/pgids``)."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root = root
        self.env = env
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as handle:
            proc = subprocess.Popen(
                args,
                env=self.env,
                cwd=HERE,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        with self.lock:
            self.procs.append(proc)
            with (self.root / "pgids").open("a") as f:
                f.write(f"{proc.pid}\n")
        return proc

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def stop_all(self) -> None:
        with self.lock:
            procs = list(self.procs)
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in procs:
            self.stop(proc, timeout=30)


class Workers:
    """The celery workers; a rolling restart starts a new one before the old one stops."""

    def __init__(self, children: Children, app: Any, concurrency: int) -> None:
        self.children = children
        self.app = app
        self.concurrency = concurrency
        self.current: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.events: list[dict[str, Any]] = []
        self.number = 0

    def spawn(self) -> tuple[str, subprocess.Popen[bytes]]:
        self.number += 1
        name = f"soak{self.number}-{uuid.uuid4().hex[:4]}@{socket.gethostname()}"
        proc = self.children.start(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "soak_app",
                "worker",
                "--pool",
                "prefork",
                "-c",
                str(self.concurrency),
                "-l",
                "warning",
                "-n",
                name,
                "-Q",
                f"celery,{BACKLOG_QUEUE}",
            ],
            self.children.root / f"worker{self.number}.log",
        )
        return name, proc

    def start(self, count: int) -> None:
        for _ in range(count):
            self.current.append(self.spawn())

    def wait_ready(self, name: str, timeout: float = 90) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.app.control.ping(destination=[name], timeout=1.0):
                    return True
            except Exception:
                time.sleep(1)
        return False

    def rolling_restart(self, t0: float) -> None:
        """Each worker in turn: a new one, ready, then the old one's warm shutdown."""
        for index, (old_name, old) in enumerate(list(self.current)):
            name, proc = self.spawn()
            ready = self.wait_ready(name)
            self.current[index] = (name, proc)
            stopping = time.time()
            Children.stop(old)
            self.events.append(
                {
                    "t_s": round(stopping - t0, 1),
                    "event": "restart",
                    "old": old_name,
                    "new": name,
                    "new_ready": ready,
                    "old_stop_s": round(time.time() - stopping, 1),
                }
            )

    def check(self, t0: float) -> None:
        """A worker that exited by itself is recorded and replaced."""
        for index, (name, proc) in enumerate(list(self.current)):
            if proc.poll() is not None:
                self.events.append(
                    {"t_s": round(time.time() - t0, 1), "event": "exited", "worker": name}
                )
                self.current[index] = self.spawn()


# ---- completions (UDP) -------------------------------------------------------------------


class Window:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.late: dict[str, list[float]] = defaultdict(list)
        self.maintenance: Counter[str] = Counter()
        self.passes = 0
        self.warnings: list[str] = []
        self.warning_count = 0


_PAIR = re.compile(r"(\w+)=(\d+)")


class Completions:
    """Counts the datagrams the tasks send, by window of the run (before t0: the capacity
    batch's, kept whole)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * 1024 * 1024)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.window = Window()
        self.capacity_times: list[float] = []
        self.capacity_mode = True
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="udp")
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self._take(data.decode(errors="replace"), time.time())

    def _take(self, text: str, now: float) -> None:
        kind, _, rest = text.partition(" ")
        with self.lock:
            w = self.window
            if kind == "M":
                w.passes += 1
                for key, value in _PAIR.findall(rest):
                    w.maintenance[key] += int(value)
                return
            if kind == "W":
                w.warning_count += 1
                if len(w.warnings) < 5:
                    w.warnings.append(rest[:300])
                return
            tag, _, late = rest.partition(" ")
            if tag == "c" and self.capacity_mode:
                self.capacity_times.append(now)
                return
            w.counts[f"{kind}{tag}"] += 1
            try:
                w.late[tag if kind != "r" else "r"].append(float(late))
            except ValueError:
                pass

    def swap(self) -> Window:
        with self.lock:
            done, self.window = self.window, Window()
        return done

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


# ---- the roles (subprocesses of this script) ---------------------------------------------


def _percentiles(values: list[float], scale: float = 1.0) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * scale, 3)

    return {
        "n": len(ordered),
        "p50": at(0.5),
        "p99": at(0.99),
        "max": round(ordered[-1] * scale, 3),
    }


def _jsonl(path: Path) -> Any:
    return path.open("a", buffering=1)


def role_publisher(cfg: dict[str, Any], index: int = 0) -> None:
    """Publisher ``index`` of ``publishers``: its share of the stream's ``rate`` until
    ``end``; publisher 0 also refills the backlog every second. Writes one line per window:
    what it published, its ``delay()`` times and how far it fell behind its schedule."""
    import soak_app

    from sqlease import Store

    store = Store(cfg["db_url"])
    rng = random.Random(cfg["seed"] * 1000 + index)
    mix = cfg["mix"]
    t0, end, sample = cfg["t0"], cfg["end"], cfg["sample_seconds"]
    rate = cfg["rate"] / cfg["publishers"]
    out = _jsonl(Path(cfg["root"]) / f"publisher{index}.jsonl")
    published = 0
    state: dict[str, Any] = {"window": 0, "behind": 0, "backlog_ready": None}
    stats: Counter[str] = Counter()
    delays: list[float] = []

    def flush() -> None:
        line = {
            "w": state["window"],
            "published": dict(stats),
            "delay_s": list(delays),
            "behind_max": state["behind"],
            "backlog_ready": state["backlog_ready"],
        }
        out.write(json.dumps(line) + "\n")
        stats.clear()
        delays.clear()
        state["behind"] = 0

    def publish(due: float, kind: str, tag: str, **options: Any) -> None:
        started = time.perf_counter()
        soak_app.work.apply_async((due, kind, tag), **options)
        delays.append(round(time.perf_counter() - started, 5))
        stats[f"{kind}{tag}"] += 1
        window = int((time.time() - t0) // sample)
        if window != state["window"]:
            flush()
            state["window"] = window

    while time.time() < t0:
        time.sleep(0.01)
    next_refill = t0
    while time.time() < end:
        if index == 0 and time.time() >= next_refill:
            next_refill += 1.0
            ready = state["backlog_ready"] = store.size(BACKLOG_QUEUE)
            for _ in range(max(0, min(cfg["backlog"] - ready, cfg["refill_cap"]))):
                publish(time.time(), "ok", "b", queue=BACKLOG_QUEUE)
        due = int((time.time() - t0) * rate)
        state["behind"] = max(state["behind"], due - published)
        while published < due and time.time() < end:
            published += 1
            u = rng.random()
            kind = "ok"
            for name in ("fail", "reject", "retry"):
                if u < mix[name]:
                    kind = name
                    break
                u -= mix[name]
            if rng.random() < mix["eta"]:
                countdown = rng.uniform(*mix["eta_countdown"])
                publish(time.time() + countdown, kind, "e", countdown=countdown)
            else:
                publish(time.time(), kind, "m")
            if index == 0 and time.time() >= next_refill:
                break  # the backlog's refill is due
        time.sleep(0.005)
    flush()


def role_probe(cfg: dict[str, Any]) -> None:
    """Claim latency under the load: enqueue, claim and ack one message of a queue no
    worker reads, every ``probe_seconds``."""
    from sqlease import Store

    store = Store(cfg["db_url"])
    owner = f"soak-probe-{os.getpid()}"
    out = _jsonl(Path(cfg["root"]) / "probe.jsonl")
    while time.time() < cfg["t0"]:
        time.sleep(0.01)
    while time.time() < cfg["end"]:
        began = time.perf_counter()
        row: dict[str, Any] = {"t": time.time()}
        try:
            store.enqueue(PROBE_QUEUE, '{"probe": true}', record=False)
            enqueued = time.perf_counter()
            got = store.claim([PROBE_QUEUE], owner, lease_ms=30_000, limit=1)
            claimed = time.perf_counter()
            store.ack([m.fence for m in got])
            acked = time.perf_counter()
            row.update(
                enqueue_ms=(enqueued - began) * 1000,
                claim_ms=(claimed - enqueued) * 1000,
                ack_ms=(acked - claimed) * 1000,
                got=len(got),
            )
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out.write(json.dumps(row) + "\n")
        time.sleep(max(0.0, cfg["probe_seconds"] - (time.perf_counter() - began)))


def role_inspector(cfg: dict[str, Any]) -> None:
    """``inspect().ping()`` and ``.active()`` every ``inspect_seconds``; every fourth round
    also a ``celery inspect ping`` process killed mid-call (its reply queue stays behind)."""
    import soak_app

    out = _jsonl(Path(cfg["root"]) / "inspector.jsonl")
    while time.time() < cfg["t0"]:
        time.sleep(0.01)
    round_number = 0
    while time.time() < cfg["end"] - 5:
        began = time.time()
        for call in ("ping", "active"):
            started = time.perf_counter()
            try:
                replies = getattr(soak_app.app.control.inspect(timeout=1.0), call)()
                row = {"replies": len(replies or {})}
            except Exception as exc:
                row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            row.update(t=time.time(), call=call, ms=(time.perf_counter() - started) * 1000)
            out.write(json.dumps(row) + "\n")
        round_number += 1
        if cfg["interrupted_every"] and round_number % cfg["interrupted_every"] == 0:
            cli = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "soak_app", "inspect", "ping", "-t", "10"],
                cwd=HERE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(cfg["interrupt_after"])
            cli.kill()
            cli.wait()
            out.write(json.dumps({"t": time.time(), "call": "killed_cli"}) + "\n")
        time.sleep(max(0.0, cfg["inspect_seconds"] - (time.time() - began)))


ROLES = {"publisher": role_publisher, "probe": role_probe, "inspector": role_inspector}


# ---- sampling ----------------------------------------------------------------------------

TABLES_SQL = """
SELECT c.relname,
       pg_total_relation_size(c.oid), pg_relation_size(c.oid), pg_indexes_size(c.oid),
       s.n_live_tup, s.n_dead_tup, s.last_autovacuum, s.autovacuum_count,
       s.autoanalyze_count, s.n_tup_ins, s.n_tup_upd, s.n_tup_hot_upd, s.n_tup_del
FROM pg_tables t
JOIN pg_class c ON c.relname = t.tablename
JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = t.schemaname
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE t.schemaname = current_schema() AND t.tablename LIKE %s
ORDER BY c.relname
"""

INDEXES_SQL = """
SELECT t.relname, i.relname, pg_relation_size(i.oid)
FROM pg_index x
JOIN pg_class t ON t.oid = x.indrelid
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_namespace n ON n.oid = t.relnamespace AND n.nspname = current_schema()
WHERE t.relname LIKE %s
"""

ACTIVITY_SQL = """
SELECT count(*),
       max(extract(epoch FROM clock_timestamp() - xact_start))::float8,
       count(*) FILTER (WHERE state LIKE 'idle in transaction%%'),
       max(age(backend_xmin))
FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
"""

AUTOVACUUMS_SQL = """
SELECT query FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'
"""

MESSAGES_SQL = """
WITH now AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS ms)
SELECT queue,
       CASE WHEN state <> 'ready' THEN state
            WHEN lease_owner IS NOT NULL AND lease_expires_at_ms > now.ms THEN 'leased'
            WHEN available_at_ms > now.ms THEN 'scheduled'
            ELSE 'ready' END,
       count(*)
FROM {table}, now GROUP BY 1, 2
"""


def _queue_label(name: str) -> str:
    if name.endswith(".reply.celery.pidbox"):
        return "*.reply.celery.pidbox"
    if name.endswith(".celery.pidbox"):
        return "*.celery.pidbox"
    if name.startswith("celeryev."):
        return "celeryev.*"
    return name


def sample_db(conn: Any) -> dict[str, Any]:
    like = PREFIX.replace("_", r"\_") + "%"
    tables: dict[str, Any] = {}
    for row in conn.execute(TABLES_SQL, (like,)):
        name = row[0][len(PREFIX) :]
        tables[name] = {
            "total_bytes": row[1],
            "heap_bytes": row[2],
            "index_bytes": row[3],
            "n_live_tup": row[4],
            "n_dead_tup": row[5],
            "last_autovacuum": row[6].isoformat() if row[6] else None,
            "autovacuum_count": row[7],
            "autoanalyze_count": row[8],
            "n_tup_ins": row[9],
            "n_tup_upd": row[10],
            "n_tup_hot_upd": row[11],
            "n_tup_del": row[12],
        }
    for table, index, size in conn.execute(INDEXES_SQL, (like,)):
        indexes = tables.get(table[len(PREFIX) :], {}).setdefault("indexes", {})
        indexes[index[len(PREFIX) :]] = size
    for name, info in tables.items():
        info["rows"] = conn.execute(f'SELECT count(*) FROM "{PREFIX}{name}"').fetchone()[0]
    messages: dict[str, dict[str, int]] = defaultdict(dict)
    for queue, state, count in conn.execute(MESSAGES_SQL.format(table=f'"{PREFIX}messages"')):
        label = _queue_label(queue)
        messages[label][state] = messages[label].get(state, 0) + count
    queues: Counter[str] = Counter()
    if "queues" in tables:
        for (name,) in conn.execute(f'SELECT name FROM "{PREFIX}queues"'):
            queues[_queue_label(name)] += 1
    activity = conn.execute(ACTIVITY_SQL).fetchone()
    vacuums = [row[0] for row in conn.execute(AUTOVACUUMS_SQL)]
    database = conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]
    return {
        "tables": tables,
        "messages": dict(messages),
        "queues": dict(queues),
        "connections": activity[0],
        # what holds vacuum back: the oldest open transaction and snapshot among clients
        "oldest_xact_s": None if activity[1] is None else round(activity[1], 2),
        "idle_in_transaction": activity[2],
        "oldest_xmin_age": activity[3],
        "autovacuum_running": vacuums,
        "database_bytes": database,
    }


class Tail:
    """New JSON lines of a file another process appends to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class Published:
    """The publishers' lines, merged by window."""

    def __init__(self, root: Path, count: int) -> None:
        self.tails = [Tail(root / f"publisher{i}.jsonl") for i in range(count)]
        self.lines: dict[int, list[dict[str, Any]]] = defaultdict(list)

    def window(self, index: int) -> dict[str, Any] | None:
        for tail in self.tails:
            for line in tail.read():
                self.lines[line["w"]].append(line)
        lines = self.lines.get(index)
        if not lines:
            return None
        counts: Counter[str] = Counter()
        for line in lines:
            counts.update(line["published"])
        ready = [line["backlog_ready"] for line in lines if line["backlog_ready"] is not None]
        return {
            "published": dict(counts),
            "delay_ms": _percentiles([d for line in lines for d in line["delay_s"]], 1000),
            "behind_max": max(line["behind_max"] for line in lines),
            "backlog_ready": ready[-1] if ready else None,
            "publishers": len(lines),
        }


def window_record(
    index: int,
    window: Window,
    seconds: float,
    probes: list[dict[str, Any]],
    published: dict[str, Any] | None,
    inspects: list[dict[str, Any]],
) -> dict[str, Any]:
    counts = window.counts
    completed = sum(v for k, v in counts.items() if k[0] in "sfj")
    ok_probes = [p for p in probes if "claim_ms" in p]
    calls = [i for i in inspects if i.get("call") in ("ping", "active")]
    return {
        "window": index,
        "t_min": round((index + 1) * seconds / 60, 3),
        "completed": completed,
        "tasks_per_s": round(completed / seconds, 1),
        "by_outcome": {
            f"{OUTCOMES.get(k[0], k[0])}/{TAGS.get(k[1:], k[1:])}": v
            for k, v in sorted(counts.items())
        },
        "start_latency_ms": _percentiles(window.late.get("m", []), 1000),
        "eta_late_ms": _percentiles(window.late.get("e", []), 1000),
        "backlog_wait_s": _percentiles(window.late.get("b", [])),
        "claim_ms": _percentiles([p["claim_ms"] for p in ok_probes]),
        "ack_ms": _percentiles([p["ack_ms"] for p in ok_probes]),
        "probe_enqueue_ms": _percentiles([p["enqueue_ms"] for p in ok_probes]),
        "probe_errors": [p["error"] for p in probes if "error" in p][:3],
        "probe_misses": sum(1 for p in ok_probes if not p["got"]),
        "published": published,
        "inspect": {
            "calls": len(calls),
            "ms": _percentiles([i["ms"] for i in calls]),
            "min_replies": min((i.get("replies", 0) for i in calls), default=None),
            "errors": [i["error"] for i in calls if "error" in i][:3],
            "killed_cli": sum(1 for i in inspects if i.get("call") == "killed_cli"),
        },
        "maintenance": {"passes": window.passes, **dict(window.maintenance)},
        "warnings": {"count": window.warning_count, "first": window.warnings},
    }


# ---- the run -----------------------------------------------------------------------------


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    transport = {
        "maintenance_interval": args.maintenance_interval,
        "event_retention_days": args.retention_seconds / 86_400,
        "dead_retention_days": args.retention_seconds / 86_400,
        "idle_queue_expiry": args.idle_queue_expiry,
    }
    return {
        "minutes": args.minutes,
        "sample_seconds": args.sample_seconds,
        "rate": args.rate,
        "backlog": args.backlog,
        "backlog_rate": args.backlog_rate,
        "workers": args.workers,
        "publishers": args.publishers,
        "concurrency": args.concurrency,
        "restart_minutes": args.restart_minutes,
        "inspect_seconds": args.inspect_seconds,
        "capacity_tasks": args.capacity_tasks,
        "probe_seconds": args.probe_seconds,
        "mix": {
            "fail": 0.02,
            "reject": 0.005,
            "retry": 0.01,
            "eta": 0.05,
            "eta_countdown": [5.0, 60.0],
        },
        "result_expires": args.retention_seconds,
        "broker_transport_options": transport,
        # Written with Store.set_rate_limits before the worker starts: the rate_limits
        # transport option would do the same, but a dict in the options makes every
        # connection fail (TransportOptions, a registry key, is then unhashable).
        "rate_limits": {f"queue:{BACKLOG_QUEUE}": f"{args.backlog_rate}/s"},
        "retention_note": (
            "results expire result_expires after they are written; events, task records, "
            "dead messages and sqlease's own FAILURE results are pruned event/dead_retention "
            "after they were made (once their task has no message left); auto-delete queues "
            "idle_queue_expiry after their last touch; each by the maintenance pass every "
            "maintenance_interval"
        ),
    }


def pg_settings(conn: Any) -> dict[str, str]:
    names = (
        "server_version",
        "autovacuum",
        "autovacuum_naptime",
        "autovacuum_vacuum_scale_factor",
        "autovacuum_vacuum_cost_delay",
        "shared_buffers",
        "max_wal_size",
        "fsync",
        "synchronous_commit",
        "max_connections",
        "work_mem",
    )
    rows = conn.execute(
        "SELECT name, setting || coalesce(unit, '') FROM pg_settings WHERE name = ANY(%s)",
        (list(names),),
    )
    return dict(rows.fetchall())


def reloptions(conn: Any) -> dict[str, list[str]]:
    rows = conn.execute(
        "SELECT relname, reloptions FROM pg_class WHERE relname LIKE %s AND reloptions IS "
        "NOT NULL AND relkind = 'r'",
        (PREFIX.replace("_", r"\_") + "%",),
    )
    return {name[len(PREFIX) :]: opts for name, opts in rows}


def measure_capacity(counter: Completions, tasks: int) -> dict[str, Any]:
    """The worker's drain of ``tasks`` ready tasks (published before it started)."""
    deadline = time.monotonic() + 120 + tasks / 50
    while len(counter.capacity_times) < tasks and time.monotonic() < deadline:
        time.sleep(0.2)
    times = sorted(counter.capacity_times)
    counter.capacity_mode = False
    out: dict[str, Any] = {"tasks": tasks, "completed": len(times)}
    if len(times) > 1 and times[-1] > times[0]:
        out["drain_per_s"] = round((len(times) - 1) / (times[-1] - times[0]), 1)
    return out


def run(args: argparse.Namespace, root: Path, cluster: Cluster, result: dict[str, Any]) -> None:
    """The soak; fills ``result`` as it goes (an interrupted run keeps its samples)."""
    import psycopg

    settings = settings_of(args)
    broker = f"sqlease+{cluster.url}"
    counter = Completions()
    env = dict(
        os.environ,
        SOAK_BROKER=broker,
        SOAK_TRANSPORT_OPTIONS=json.dumps(settings["broker_transport_options"]),
        SOAK_RESULT_EXPIRES=str(args.retention_seconds),
        SOAK_UDP=str(counter.port),
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    )
    os.environ.update({k: v for k, v in env.items() if k.startswith("SOAK_")})
    sys.path.insert(0, str(HERE))
    import soak_app

    from sqlease import Store

    # the schema, before anyone publishes, and the backlog's rate limit
    Store(cluster.url).set_rate_limits(settings["rate_limits"], replace=True)
    children = Children(root, env)
    workers = Workers(children, soak_app.app, args.concurrency)
    samples: list[dict[str, Any]] = []
    result.update(settings=settings, samples=samples)
    conn = psycopg.connect(cluster.url, autocommit=True)
    try:
        result["postgresql"] = pg_settings(conn)
        # 1. the capacity batch and the standing backlog, then the worker
        for _ in range(args.capacity_tasks):
            soak_app.work.delay(time.time(), "ok", "c")
        for _ in range(args.backlog):
            soak_app.work.apply_async((time.time(), "ok", "b"), queue=BACKLOG_QUEUE)
        workers.start(args.workers)
        result["capacity"] = measure_capacity(counter, args.capacity_tasks)
        result["table_reloptions"] = reloptions(conn)
        print(f"capacity: {json.dumps(result['capacity'])}", flush=True)
        drain = result["capacity"].get("drain_per_s") or 0
        if args.rate + args.backlog_rate > 0.6 * drain:
            print(
                f"warning: --rate {args.rate:g} (+ the backlog's {args.backlog_rate}/s) is more "
                f"than 60% of the measured drain ({drain}/s): the worker may fall behind",
                file=sys.stderr,
                flush=True,
            )
        # 2. the soak
        counter.swap()
        t0 = time.time() + 2
        end = t0 + args.minutes * 60
        result["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t0))
        cfg = {
            **settings,
            "db_url": cluster.url,
            "root": str(root),
            "t0": t0,
            "end": end,
            "seed": args.seed,
            "refill_cap": max(50, args.backlog_rate * 4),
            "interrupted_every": 4,
            "interrupt_after": 3.0,
        }
        (root / "config.json").write_text(json.dumps(cfg))
        me = [sys.executable, str(Path(__file__).resolve()), "--role"]
        for number in range(args.publishers):
            children.start([*me, "publisher", "--index", str(number)], root / "publisher.log")
        for role in ("probe", "inspector"):
            children.start([*me, role], root / f"{role}.log")
        tails = {role: Tail(root / f"{role}.jsonl") for role in ("probe", "inspector")}
        published = Published(root, args.publishers)
        restart_at: list[float] = []
        while args.restart_minutes and (len(restart_at) + 1) * args.restart_minutes < args.minutes:
            restart_at.append(t0 + (len(restart_at) + 1) * args.restart_minutes * 60)
        restarting: threading.Thread | None = None
        while time.time() < t0:
            time.sleep(0.05)
        counter.swap()  # datagrams of the wait
        result["baseline_db"] = sample_db(conn)  # at t0, before the stream
        index = 0
        while t0 + (index + 1) * args.sample_seconds <= end + 0.5:
            boundary = t0 + (index + 1) * args.sample_seconds
            while time.time() < boundary:
                if restart_at and time.time() >= restart_at[0] and restarting is None:
                    restart_at.pop(0)
                    restarting = threading.Thread(target=workers.rolling_restart, args=(t0,))
                    restarting.start()
                if restarting is not None and not restarting.is_alive():
                    restarting = None
                time.sleep(0.05)
            window = counter.swap()
            if restarting is None:
                workers.check(t0)
            record = window_record(
                index,
                window,
                args.sample_seconds,
                tails["probe"].read(),
                published.window(index),
                tails["inspector"].read(),
            )
            db_started = time.perf_counter()
            record["db"] = sample_db(conn)
            record["db_sample_ms"] = round((time.perf_counter() - db_started) * 1000, 1)
            samples.append(record)
            total_mb = sum(t["total_bytes"] for t in record["db"]["tables"].values()) / 2**20
            print(
                f"{record['t_min']:6.2f} min  {record['tasks_per_s']:7.1f} tasks/s  "
                f"claim p99 {record['claim_ms'].get('p99', '-')} ms  "
                f"start p99 {record['start_latency_ms'].get('p99', '-')} ms  "
                f"tables {total_mb:.1f} MB  pruned {record['maintenance']}",
                flush=True,
            )
            index += 1
        # a publisher writes a window's line when it publishes in the next one
        time.sleep(2)
        for record in samples:
            record["published"] = published.window(record["window"])
        if restarting is not None:
            restarting.join()
    finally:
        result["worker_events"] = workers.events
        conn.close()
        children.stop_all()
        counter.close()


# ---- summary, plot -----------------------------------------------------------------------


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 2) if values else None


def _nearest(samples: list[dict[str, Any]], minute: float) -> dict[str, Any]:
    return min(samples, key=lambda s: abs(s["t_min"] - minute))


def summarize(samples: list[dict[str, Any]], minutes: float, seconds: float) -> dict[str, Any]:
    if not samples:
        return {}
    span = min(5.0, minutes / 3)
    end_min = samples[-1]["t_min"]
    head = [s for s in samples if s["t_min"] <= span + 1e-6]
    tail = [s for s in samples if s["t_min"] > end_min - span + 1e-6]
    head_tp, tail_tp = (_mean([s["tasks_per_s"] for s in part]) for part in (head, tail))
    ratio = round(tail_tp / head_tp, 3) if head_tp and tail_tp else None
    check_min = min(10.0, minutes / 3)
    at_check, last = _nearest(samples, check_min), samples[-1]
    sizes: dict[str, Any] = {}
    growing: list[str] = []
    for name, end_info in last["db"]["tables"].items():
        before = at_check["db"]["tables"].get(name, {})
        a, b = before.get("total_bytes", 0), end_info["total_bytes"]
        plateau = b - a <= max(0.2 * a, 2**20)
        grown = {
            index: round((size - before.get("indexes", {}).get(index, 0)) / 2**20, 3)
            for index, size in end_info.get("indexes", {}).items()
        }
        sizes[name] = {
            "mb_at_check": round(a / 2**20, 3),
            "mb_at_end": round(b / 2**20, 3),
            "mb_max": round(
                max(s["db"]["tables"][name]["total_bytes"] for s in samples) / 2**20, 3
            ),
            "ratio": round(b / a, 3) if a else None,
            "rows_at_check": before.get("rows"),
            "rows_at_end": end_info["rows"],
            "plateau": plateau,
            "heap_mb_growth": round(
                (end_info["heap_bytes"] - before.get("heap_bytes", 0)) / 2**20, 3
            ),
            "index_mb_growth": {k: v for k, v in grown.items() if abs(v) >= 0.1},
        }
        if not plateau:
            growing.append(name)
    total = [sum(t["total_bytes"] for t in s["db"]["tables"].values()) for s in samples]

    def p99s(key: str, part: list[dict[str, Any]]) -> float | None:
        return _mean([s[key]["p99"] for s in part if s[key].get("p99") is not None])

    return {
        "head_tail_minutes": round(span, 2),
        "throughput_head_per_s": head_tp,
        "throughput_tail_per_s": tail_tp,
        "throughput_ratio": ratio,
        "throughput_goal_met": ratio is not None and ratio >= 0.9,
        "completed": sum(s["completed"] for s in samples),
        "published": sum(
            sum((s.get("published") or {}).get("published", {}).values()) for s in samples
        ),
        # what the publishers managed of --rate (the stream and its ETA tasks), how far they
        # fell behind their schedule, and whether the worker kept up with the stream
        "stream_published_per_s": round(
            sum(
                v
                for s in samples
                for k, v in (s.get("published") or {}).get("published", {}).items()
                if not k.endswith("b")
            )
            / (len(samples) * seconds),
            1,
        ),
        "publisher_behind_max": max(
            ((s.get("published") or {}).get("behind_max") or 0 for s in samples), default=None
        ),
        "stream_ready_max": max(
            s["db"]["messages"].get("celery", {}).get("ready", 0) for s in samples
        ),
        "stream_ready_end": samples[-1]["db"]["messages"].get("celery", {}).get("ready", 0),
        "backlog_ready_min": min(
            s["db"]["messages"].get(BACKLOG_QUEUE, {}).get("ready", 0) for s in samples
        ),
        "size_check_minute": at_check["t_min"],
        "tables_mb_at_check": round(total[samples.index(at_check)] / 2**20, 3),
        "tables_mb_at_end": round(total[-1] / 2**20, 3),
        "tables_mb_max": round(max(total) / 2**20, 3),
        "plateau_rule": "end - check <= max(20% of check, 1 MiB)",
        "sizes": sizes,
        "growing_tables": growing,
        "sizes_plateau": not growing,
        "claim_p99_ms_head": p99s("claim_ms", head),
        "claim_p99_ms_tail": p99s("claim_ms", tail),
        "claim_p99_ms_max": max((s["claim_ms"].get("p99", 0) for s in samples), default=None),
        "claim_p99_ms_per_window": [[s["t_min"], s["claim_ms"].get("p99")] for s in samples],
        "start_p99_ms_head": p99s("start_latency_ms", head),
        "start_p99_ms_tail": p99s("start_latency_ms", tail),
        "maintenance": dict(
            sum((Counter(s["maintenance"]) for s in samples), Counter()).most_common()
        ),
        "warnings": sum(s["warnings"]["count"] for s in samples),
        "inspect_min_replies": min(
            (s["inspect"]["min_replies"] for s in samples if s["inspect"]["calls"]), default=None
        ),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """Four panels over the run's minutes: size per table, throughput, the probe's claim
    and ack latency, the stream's start latency; grey lines mark worker restarts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t_min"] for s in samples]
    # sizes from the baseline at t0
    sized = ([(0.0, result["baseline_db"])] if result.get("baseline_db") else []) + [
        (s["t_min"], s["db"]) for s in samples
    ]
    ts = [x for x, _ in sized]

    def mb(db: dict[str, Any], names: list[str]) -> float:
        return sum(db["tables"].get(n, {}).get("total_bytes", 0) for n in names) / 2**20

    names = sorted(samples[-1]["db"]["tables"], key=lambda n: -max(mb(d, [n]) for _, d in sized))
    shown, rest = names[:7], names[7:]
    fig, axes = plt.subplots(4, 1, figsize=(10, 13), sharex=True)
    ax = axes[0]
    for name in shown:
        ax.plot(ts, [mb(d, [name]) for _, d in sized], label=name)
    if rest:
        ax.plot(
            ts, [mb(d, rest) for _, d in sized], linestyle="--", label=f"{len(rest)} other tables"
        )
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    ax.set_title("size per sqlease table, indexes and TOAST included (pg_total_relation_size)")
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    ax = axes[1]
    seconds = result["settings"]["sample_seconds"]
    offered = [
        sum((s.get("published") or {}).get("published", {}).values()) / seconds for s in samples
    ]
    ax.plot(t, [s["tasks_per_s"] for s in samples], label="completed (every outcome)")
    ax.plot(t, offered, linestyle=":", label="published (stream, ETA, backlog refill)")
    ax.set_ylabel("tasks/s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"throughput per {seconds:g} s window")
    ax = axes[2]
    ax.plot(t, [s["claim_ms"].get("p50") for s in samples], linestyle=":", label="claim p50")
    ax.plot(t, [s["claim_ms"].get("p99") for s in samples], label="claim p99")
    ax.plot(t, [s["ack_ms"].get("p99") for s in samples], linestyle="--", label="ack p99")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title("probe: Store.claim and Store.ack of one message on a queue of its own")
    ax = axes[3]
    for q, style in (("p50", ":"), ("p99", "-")):
        values = [s["start_latency_ms"].get(q) for s in samples]
        ax.plot(t, values, linestyle=style, label=f"delay() to start, {q}")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("minutes")
    ax.set_xlim(left=0)
    ax.legend(fontsize=8)
    ax.set_title("the stream's tasks (not ETA, not the backlog): publish to start")
    for event in result.get("worker_events", []):
        for ax in axes:
            ax.axvline(event["t_s"] / 60, color="grey", linewidth=0.8, alpha=0.6)
    settings, summary = result["settings"], result.get("summary", {})
    fig.suptitle(
        f"sqlease soak on PostgreSQL {result.get('postgresql', {}).get('server_version', '')}"
        f": {settings['rate']:g} tasks/s offered, a standing backlog of {settings['backlog']:,}"
        f"\nthroughput last/first {summary.get('head_tail_minutes')} min: "
        f"{summary.get('throughput_ratio')} (grey: worker restarts)",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def markdown(result: dict[str, Any]) -> str:
    s = result.get("summary", {})
    lines = [
        f"| | first {s.get('head_tail_minutes')} min | last {s.get('head_tail_minutes')} min |",
        "|---|---:|---:|",
        f"| tasks/s | {s.get('throughput_head_per_s')} | {s.get('throughput_tail_per_s')} |",
        f"| claim p99 ms | {s.get('claim_p99_ms_head')} | {s.get('claim_p99_ms_tail')} |",
        f"| start p99 ms | {s.get('start_p99_ms_head')} | {s.get('start_p99_ms_tail')} |",
        "",
        f"| table | MB at {s.get('size_check_minute')} min | MB at end | max | rows at end |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, info in sorted(s.get("sizes", {}).items(), key=lambda kv: -kv[1]["mb_max"]):
        lines.append(
            f"| `{name}` | {info['mb_at_check']} | {info['mb_at_end']} | {info['mb_max']} "
            f"| {info['rows_at_end']:,} |"
        )
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sample-seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=250.0, help="stream tasks/s offered")
    parser.add_argument("--backlog", type=int, default=2000, help="ready tasks kept standing")
    parser.add_argument("--backlog-rate", type=int, default=20, help="its rate limit, tasks/s")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--restart-minutes", type=float, default=10.0, help="0: never")
    parser.add_argument("--inspect-seconds", type=float, default=15.0)
    parser.add_argument("--probe-seconds", type=float, default=0.2)
    parser.add_argument("--capacity-tasks", type=int, default=3000)
    parser.add_argument("--retention-seconds", type=float, default=180.0)
    parser.add_argument("--idle-queue-expiry", type=float, default=120.0)
    parser.add_argument("--maintenance-interval", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--port", type=int, default=55433, help="first port to try")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "soak.png")
    parser.add_argument(
        "--keep-logs", type=Path, default=None, help="copy the workers' and server's logs here"
    )
    parser.add_argument("--replot", type=Path, default=None, help="plot a result file again")
    parser.add_argument("--publishers", type=int, default=2, help="processes sharing --rate")
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--watchdog", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.watchdog:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        run_watchdog(args.watchdog, Path(os.environ["SOAK_ROOT"]))
        return 0
    if args.role:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        root = Path(os.environ["SOAK_ROOT"])
        cfg = json.loads((root / "config.json").read_text())
        if args.role == "publisher":
            role_publisher(cfg, args.index)
        else:
            ROLES[args.role](cfg)
        return 0
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot)
        print(f"written {args.plot}")
        return 0
    # SIGINT too: a shell starts background jobs with it ignored, and Python then keeps it so
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    root = Path(tempfile.mkdtemp(prefix="sqlease-soak-"))
    os.environ["SOAK_ROOT"] = str(root)
    cluster = Cluster(root, free_port(args.port))
    watchdog = start_watchdog(cluster)
    result: dict[str, Any] = {}
    interrupted = None
    try:
        cluster.start()
        print(f"cluster: {cluster.url} in {cluster.data}", flush=True)
        run(args, root, cluster, result)
    except KeyboardInterrupt as exc:
        interrupted = str(exc) or "KeyboardInterrupt"
    finally:
        cluster.stop()
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in root.glob("*.log"):
                shutil.copy(log, args.keep_logs / log.name)
        shutil.rmtree(root, ignore_errors=True)
        watchdog.kill()
        watchdog.wait()
    if not result.get("samples"):
        print("interrupted before the first sample: nothing written", file=sys.stderr)
        return 1
    if interrupted:
        result["interrupted"] = interrupted
    samples = result["samples"]
    result["summary"] = summarize(samples, samples[-1]["t_min"], args.sample_seconds)
    stamp = time.strftime("%Y-%m-%d")
    suffix = "-interrupted" if interrupted else ""
    output = args.output or HERE / "results" / f"soak-{stamp}{suffix}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1, default=str))
    print(f"written {output}")
    plot(result, args.plot)
    print(f"written {args.plot}")
    print(json.dumps({k: v for k, v in result["summary"].items() if k != "sizes"}, indent=1))
    print(markdown(result))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
