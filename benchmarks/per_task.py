"""What one task costs a Celery worker, counted rather than timed: two versions of sqlease,
paired in one run, with Redis and RabbitMQ as baselines.

On two shared cores a drain rate moves by 10-30 % from one minute to the next, so a small
change in what a task costs is lost in wall-clock numbers. The work a task causes does not
depend on the load: SQL statements, rows, Python function calls, and (nearly) CPU time. This
counts them per task of a worker draining a backlog of no-op tasks.

**A drain.** N no-op tasks are published first (no worker running), then a worker starts on
the backlog (``bench_app.py``'s app and ``celery_bench.py``'s settings: prefork ``-c 2``,
prefetch multiplier 4, no mingle or gossip); completions are counted by UDP. At the N-th
completion the counters are read, then the worker is stopped. Every drain has a fresh
database (PostgreSQL: a new database in the cluster below; SQLite: a new file).

**Per task = difference of two drains.** Each measurement is taken on drains of N1 and N2
tasks (``--tasks``, default 3,000 and 10,000) and reported as (value(N2) - value(N1)) /
(N2 - N1): the worker's start (imports, connections, declarations) and the tail after the
last task cancel.

What is counted, per version and broker:

- **SQL** (sqlease on PostgreSQL): ``pg_stat_statements`` of the drain's database, reset
  right before the worker starts and read at the last completion: statements (calls),
  rows retrieved or affected, total execution time in the server, and WAL bytes. The
  cluster is the run's own (``initdb`` into the run's temporary directory, its own port,
  ``shared_preload_libraries = pg_stat_statements``, initdb's defaults otherwise, autovacuum
  on), so no other client's statements are counted; ``soak.py``'s cluster, run as the
  ``postgres`` user when this runs as root (initdb and postgres refuse root). A combined
  ack + claim statement carries as many acks as have gathered, so statements per task move
  a little with the timing; rows and WAL bytes only with the tail at the last completion.
- **CPU**: utime + stime (``/proc/<pid>/stat``) of the worker's main process (all its
  threads) and the sum over its pool processes, read at the last completion. This one moves
  with the load (cache misses, the clock tick of 10 ms, a start-up of about a second whose
  cost varies): it needs the default sizes, and the rounds' median steadies it.
- **Python function calls** in the worker's main process: a second pair of drains runs that
  process under ``cProfile``, a profiler per thread (cProfile sees only the thread that
  enables it; sqlease's side threads and Celery's would be missed), the pool processes not
  profiled (turned off as they fork). SIGUSR2 makes the main process write its counts so
  far, at the last completion, so the shutdown is not counted. A third pair does the same
  with ``--pool solo``, where the tasks run in that process too (one at a time, prefetch 4).
  Idle threads that wake on a timer (heartbeats) add calls in proportion to the drain's
  duration: few, but not zero.

Redis and RabbitMQ (``celery_bench.py``'s URLs) get the CPU and call counts only, run on the
after version's interpreter (the app imports sqlease whatever the broker: a start-up cost,
which cancels).

**Versions.** As in ``paired.py``: ``--before REF`` is checked out into a temporary
``git worktree``; ``--after`` is a REF or a PATH (default: this tree) whose ``src/`` is
copied at the start. Each version runs on a throwaway venv whose site-packages is the shared
venv's, so its ``src/`` is the only sqlease on the path; the harness (this directory's
``bench_app.py``) is the same for both. Each publisher reports which ``sqlease`` it imported
and the run stops if it is not the version's own. Each round runs before, the baselines and
after, the next round after, the baselines and before; the report gives the rounds' medians.

Cleanup: every worker runs in a session of its own and is stopped after its drain; the
cluster is stopped and the temporary directory (cluster, worktree, venvs, SQLite files,
logs) removed at the end, also on Ctrl-C or SIGTERM, and by ``soak.py``'s watchdog if this
process is killed.

    .venv/bin/python benchmarks/per_task.py                 # HEAD~1 vs this tree, 3 rounds
    .venv/bin/python benchmarks/per_task.py --before main --after HEAD --rounds 7
    .venv/bin/python benchmarks/per_task.py --brokers sqlease-pg --tasks 2000,8000
    nice -n 10 .venv/bin/python benchmarks/per_task.py --quick   # validation: 300,1000, 1 round

Prints a table (one row per measurement and sqlease broker; columns before, after, the
difference, Redis, RabbitMQ) and writes ``benchmarks/results/per-task-<date>-<before>-
<after>[-quick].json``: the medians and each round's values, per version the functions and
statements per task with the largest before -> after differences, and every drain's raw
counts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg
from beat_bench import cpu_seconds
from celery_bench import PG, Counter, broker_env, brokers, stop_worker
from paired import Version, interpreter, materialise
from soak import PG_BIN, Cluster, free_port, start_watchdog

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BASELINES = ("redis", "rabbitmq")
DEFAULT_BROKERS = "sqlease-pg,sqlease-sqlite,redis,rabbitmq"
PREFIX = "pertask_"  # every drain has a database or file of its own: one prefix will do
#: The kinds of drain: {kind: (pool, profiled)}.
KINDS = {"cpu": ("prefork", False), "calls": ("prefork", True), "calls-solo": ("solo", True)}

#: Publishes argv[1] no-op tasks and prints which sqlease it imported.
PUBLISH = """
import json, sys, bench_app, sqlease
try:
    bench_app.app.control.purge()
except Exception:
    pass
for _ in range(int(sys.argv[1])):
    bench_app.noop.delay()
print(json.dumps({"sqlease": sqlease.__file__}))
"""

#: ``celery`` with its main process under cProfile: a profiler per thread, none in the pool
#: processes; SIGUSR2 writes {thread: {function: calls}} so far to argv[1].
PROFILED = """
import cProfile, gc, json, os, re, signal, sys, threading
out, pid, profiles = sys.argv.pop(1), os.getpid(), []

def key(code):
    if isinstance(code, str):  # a builtin: without the address of its type, per process
        return re.sub(r" at 0x[0-9a-f]+", "", code)
    path = re.sub(r".*/(site-packages|src|python3[.][0-9]+)/", "", code.co_filename)
    return f"{path}:{code.co_qualname}"

def profile(name):
    prof = cProfile.Profile()
    profiles.append((name, prof))
    prof.enable()

def thread_started(frame, event, arg):
    profile(threading.current_thread().name)

def forked():
    sys.setprofile(None)
    threading.setprofile(None)

def snapshot(signum, frame):
    if os.getpid() != pid:
        return
    # getstats() runs no Python code; without a collection no finalizer or thread switch
    # runs while a thread's table is read.
    gc.disable()
    try:
        taken = [(name, prof.getstats()) for name, prof in list(profiles)]
    finally:
        gc.enable()
    threads = {}
    for name, entries in taken:
        calls = {}
        for entry in entries:
            calls[key(entry.code)] = calls.get(key(entry.code), 0) + entry.callcount
        while name in threads:
            name += "+"
        threads[name] = calls
    with open(out + ".part", "w") as f:
        json.dump(threads, f)
    os.replace(out + ".part", out)

os.register_at_fork(after_in_child=forked)
signal.signal(signal.SIGUSR2, snapshot)
threading.setprofile(thread_started)
sys.argv[0] = "celery"
from celery.__main__ import main
profile("MainThread")
main()
"""


@dataclass(frozen=True)
class Metric:
    label: str
    kind: str  # the drains it is read from (KINDS)
    path: tuple[str, ...]  # where in a drain's result
    scale: float = 1.0
    sql: bool = False  # sqlease on PostgreSQL only

    def read(self, drain: dict[str, Any]) -> float | None:
        value: Any = drain
        for part in self.path:
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        return float(value) * self.scale


METRICS = [
    Metric("SQL statements", "cpu", ("sql", "statements"), sql=True),
    Metric("rows written and read", "cpu", ("sql", "rows"), sql=True),
    Metric("statement execution time, us", "cpu", ("sql", "exec_ms"), 1000, sql=True),
    Metric("WAL bytes", "cpu", ("sql", "wal_bytes"), sql=True),
    Metric("Python calls, main process", "calls", ("calls",)),
    Metric("Python calls, solo pool", "calls-solo", ("calls",)),
    Metric("CPU main process, us", "cpu", ("cpu_main_s",), 1e6),
    Metric("CPU pool processes, us", "cpu", ("cpu_pool_s",), 1e6),
]


class StatsCluster(Cluster):
    """soak.py's throwaway cluster, restarted with pg_stat_statements loaded."""

    def start(self) -> None:
        super().start()
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write("shared_preload_libraries = 'pg_stat_statements'  # per_task.py\n")
        self._run(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "restart"
        )

    def database_url(self, name: str) -> str:
        return f"{self.url.rsplit('/', 1)[0]}/{name}"


def statement_key(query: str) -> str:
    """A statement's text, a long one cut short and told apart by a hash of the whole."""
    text = " ".join(query.split())
    if len(text) <= 120:
        return text
    return f"{text[:100]} ... [{hashlib.sha1(text.encode()).hexdigest()[:8]}]"


def pool_children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


@dataclass
class Bench:
    tmp: Path
    cluster: StatsCluster
    counter: Counter = field(default_factory=Counter)
    admin: psycopg.Connection[Any] | None = None  # the cluster's postgres database
    serial: int = 0

    def drain(self, version: Version, name: str, n: int, kind: str) -> dict[str, Any]:
        """Publish ``n`` tasks, drain them with a worker of ``kind``, return its counts."""
        self.serial += 1
        where = self.tmp / f"drain{self.serial}-{name}-{kind}-{n}"
        where.mkdir()
        broker = next(b for b in brokers(where, PREFIX) if b.name == name)
        database = None
        if PG in broker.url:
            assert self.admin is not None
            database = f"drain{self.serial}"
            self.admin.execute(f"CREATE DATABASE {database}")
            broker = replace(
                broker, url=broker.url.replace(PG, self.cluster.database_url(database))
            )
        # Only this directory on PYTHONPATH: bench_app, and the version's sqlease by its venv.
        env = dict(broker_env(broker, self.counter, PREFIX), PYTHONPATH=str(HERE))
        try:
            self.publish(version, env, n)
            return self.consume(version, env, n, kind, where, database)
        finally:
            if database and self.admin is not None:
                self.admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
            for db_file in where.glob("*.db*"):
                db_file.unlink()

    def publish(self, version: Version, env: dict[str, str], n: int) -> None:
        done = subprocess.run(
            [str(version.python), "-c", PUBLISH, str(n)],
            env=env,
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=60 + n / 20,
            check=False,
        )
        if done.returncode:
            raise RuntimeError(f"publishing failed: {done.stderr[-2000:]}")
        seen = json.loads(done.stdout.strip().splitlines()[-1])["sqlease"]
        if not Path(seen).resolve().is_relative_to((version.root / "src").resolve()):
            raise SystemExit(f"{version.name} imported {seen}, not its own src/")
        version.seen = seen

    def consume(
        self,
        version: Version,
        env: dict[str, str],
        n: int,
        kind: str,
        where: Path,
        database: str | None,
    ) -> dict[str, Any]:
        pool, profiled = KINDS[kind]
        snapshot = where / "calls.json"
        main = ["-c", PROFILED, str(snapshot)] if profiled else ["-m", "celery"]
        argv = [str(version.python), *main, "-A", "bench_app", "worker", "--pool", pool]
        argv += ["-c", "2", "-l", "warning", "-n", f"pertask{self.serial}@%h"]
        argv += ["--without-mingle", "--without-gossip"]
        self.counter.drain()
        if database:
            assert self.admin is not None
            self.admin.execute("SELECT pg_stat_statements_reset()")
        with (where / "worker.log").open("ab") as log:
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=HERE,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        with (self.tmp / "pgids").open("a") as pgids:  # for soak.py's watchdog
            pgids.write(f"{proc.pid}\n")
        try:
            started, got = time.monotonic(), 0
            deadline = started + 120 + n / (50 if profiled else 200)
            while got < n and proc.poll() is None and time.monotonic() < deadline:
                got += len(self.counter.wait(n - got, 1.0))
            out: dict[str, Any] = {"n": n, "seconds": round(time.monotonic() - started, 3)}
            if got < n:
                tail = (where / "worker.log").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{got} of {n} completions, worker log:\n{tail}")
            out["cpu_main_s"] = cpu_seconds(proc.pid)
            out["cpu_pool_s"] = sum(cpu_seconds(c) for c in pool_children(proc.pid))
            if profiled:
                os.kill(proc.pid, signal.SIGUSR2)
            if database:
                out["sql"] = self.statements(database)
            if profiled:
                out.update(self.calls(snapshot, proc))
            return out
        finally:
            stop_worker(proc)

    def statements(self, database: str) -> dict[str, Any]:
        assert self.admin is not None
        rows = self.admin.execute(
            "SELECT query, calls, rows, total_exec_time, wal_bytes FROM pg_stat_statements s "
            "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s",
            (database,),
        ).fetchall()
        by_query: dict[str, int] = {}
        for query, calls, *_ in rows:
            text = statement_key(query)
            by_query[text] = by_query.get(text, 0) + calls
        return {
            "statements": sum(r[1] for r in rows),
            "rows": sum(r[2] for r in rows),
            "exec_ms": sum(r[3] for r in rows),
            "wal_bytes": int(sum(r[4] for r in rows)),
            "by_query": by_query,
        }

    @staticmethod
    def calls(snapshot: Path, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
        deadline = time.monotonic() + 60
        while not snapshot.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the profiled worker wrote no call counts")
            time.sleep(0.05)
        threads: dict[str, dict[str, int]] = json.loads(snapshot.read_text())
        functions: dict[str, int] = {}
        for calls in threads.values():
            for name, count in calls.items():
                functions[name] = functions.get(name, 0) + count
        return {
            "calls": sum(functions.values()),
            "calls_by_thread": {name: sum(calls.values()) for name, calls in threads.items()},
            "functions": functions,
        }


def per_task(small: dict[str, Any], large: dict[str, Any], metric: Metric) -> float | None:
    a, b = metric.read(small), metric.read(large)
    if a is None or b is None:
        return None
    return (b - a) / (large["n"] - small["n"])


def counts_per_task(
    rounds: list[dict[str, Any]], side: str, broker: str, kind: str, path: tuple[str, ...]
) -> dict[str, float]:
    """{function or statement: per task}, summed over the rounds' drain pairs."""
    total: dict[str, float] = {}
    pairs = 0
    for result in rounds:
        drains = result.get(side, {}).get(broker, {}).get(kind, [])
        if len(drains) != 2 or any("error" in d for d in drains):
            continue
        small, large = sorted(drains, key=lambda d: d["n"])
        pairs += 1
        for sign, drain in ((-1, small), (1, large)):
            table: Any = drain
            for step in path:
                table = table.get(step, {})
            for name, count in table.items():
                total[name] = total.get(name, 0) + sign * count / (large["n"] - small["n"])
    return {k: v / pairs for k, v in total.items()} if pairs else {}


def differences(
    rounds: list[dict[str, Any]], broker: str, kind: str, path: tuple[str, ...]
) -> dict[str, Any]:
    """Per version the largest per-task counts, and the largest before -> after changes."""
    sides = {s: counts_per_task(rounds, s, broker, kind, path) for s in ("before", "after")}
    changed = {
        name: round(sides["after"].get(name, 0) - sides["before"].get(name, 0), 3)
        for name in set(sides["before"]) | set(sides["after"])
    }
    return {
        "changed": dict(
            sorted(
                ((k, v) for k, v in changed.items() if abs(v) >= 0.05), key=lambda x: -abs(x[1])
            )[:30]
        ),
        **{
            f"top_{side}": {
                k: round(v, 3)
                for k, v in sorted(values.items(), key=lambda x: -x[1])[:30]
                if v >= 0.001
            }
            for side, values in sides.items()
        },
    }


def number(value: float | None, sign: str = "") -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:{sign},.0f}"
    return f"{value:{sign}.1f}" if abs(value) >= 10 else f"{value:{sign}.3f}"


def report(rounds: list[dict[str, Any]], chosen: list[str]) -> list[dict[str, Any]]:
    """Print the table; return its rows (medians over the rounds and each round's value)."""

    def values(side: str, broker: str, metric: Metric) -> list[float | None]:
        got = []
        for result in rounds:
            drains = result.get(side, {}).get(broker, {}).get(metric.kind, [])
            ok = len(drains) == 2 and not any("error" in d for d in drains)
            got.append(per_task(*sorted(drains, key=lambda d: d["n"]), metric) if ok else None)
        return got

    def median(got: list[float | None]) -> float | None:
        known = [x for x in got if x is not None]
        return statistics.median(known) if known else None

    sqlease = [b for b in chosen if b not in BASELINES]
    baselines = [b for b in chosen if b in BASELINES]
    rows: list[dict[str, Any]] = []
    title = f"per task (median of {len(rounds)} round{'s' * (len(rounds) > 1)})"
    print(
        f"\n{title:<46}{'before':>10}{'after':>10}{'after-before':>14}{'%':>8}"
        + "".join(f"{b:>10}" for b in baselines)
    )
    for broker in sqlease or [""]:
        print(broker or "(baselines only)")
        for metric in METRICS:
            if metric.sql and not broker.startswith("sqlease-pg"):
                continue
            row: dict[str, Any] = {"broker": broker, "metric": metric.label}
            for side in ("before", "after") if broker else ():
                row[f"{side}_rounds"] = got = values(side, broker, metric)
                row[side] = median(got)
            for base in baselines:
                if not metric.sql:
                    row[f"{base}_rounds"] = got = values("baseline", base, metric)
                    row[base] = median(got)
            before, after = row.get("before"), row.get("after")
            row["difference"] = diff = None if before is None or after is None else after - before
            row["percent"] = pct = (
                round(100 * diff / before, 2) if diff is not None and before else None
            )
            rows.append(row)
            print(
                f"  {metric.label:<44}{number(before):>10}{number(after):>10}"
                f"{number(diff, '+'):>14}{'-' if pct is None else f'{pct:+.1f}':>8}"
                + "".join(f"{number(row.get(b)):>10}" for b in baselines)
            )
    return rows


def run_round(
    number: int, bench: Bench, versions: dict[str, Version], chosen: list[str], tasks: list[int]
) -> dict[str, Any]:
    """Every chosen broker's drains: before, the baselines, after (even rounds: after first)."""
    order = ["before", "after"] if number % 2 else ["after", "before"]
    plan = [(order[0], [b for b in chosen if b not in BASELINES])]
    plan.append(("baseline", [b for b in chosen if b in BASELINES]))
    plan.append((order[1], [b for b in chosen if b not in BASELINES]))
    result: dict[str, Any] = {"round": number, "order": order}
    for side, names in plan:
        version = versions["after" if side == "baseline" else side]
        for name in names:
            for kind in KINDS:
                for n in tasks:
                    t0 = time.monotonic()
                    try:
                        got = bench.drain(version, name, n, kind)
                    except Exception as exc:  # a missing baseline must not stop the others
                        got = {"n": n, "error": f"{type(exc).__name__}: {exc}"}
                        print(f"  {side} {name} {kind} {n}: {got['error']}", file=sys.stderr)
                    result.setdefault(side, {}).setdefault(name, {}).setdefault(kind, []).append(
                        got
                    )
                    print(
                        f"[round {number}] {side:<8} {name:<15} {kind:<10} {n:>6} tasks "
                        f"{time.monotonic() - t0:>5.1f} s{'  FAILED' if 'error' in got else ''}",
                        flush=True,
                    )
    return result


def slim(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rounds without the per-function and per-statement tables (summarised per
    version in ``detail``)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("functions", "by_query")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return [strip(r) for r in rounds]


def interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--before", default="HEAD~1", help="a git ref of this repository")
    parser.add_argument("--after", default=str(REPO), help="a tree (PATH) or a git ref")
    parser.add_argument("--tasks", default=None, help="N1,N2: 3000,10000; --quick: 300,1000")
    parser.add_argument("--rounds", type=int, default=None, help="3; --quick: 1")
    parser.add_argument("--brokers", default=DEFAULT_BROKERS, help="comma list")
    parser.add_argument("--port", type=int, default=55533, help="the cluster's: first to try")
    parser.add_argument("--quick", action="store_true", help="validation: 300,1000, one round")
    args = parser.parse_args()
    tasks = sorted(
        int(n) for n in (args.tasks or ("300,1000" if args.quick else "3000,10000")).split(",")
    )
    if len(tasks) != 2 or tasks[0] == tasks[1]:
        parser.error("--tasks takes two different numbers, N1,N2")
    rounds_wanted = args.rounds or (1 if args.quick else 3)
    # kombu-sqla-pg is left out: its URL is the system cluster's, not the run's own.
    known = [b.name for b in brokers(Path("/nonexistent"), PREFIX) if b.name != "kombu-sqla-pg"]
    chosen = [b for b in args.brokers.split(",") if b]
    if unknown := [b for b in chosen if b not in known]:
        parser.error(f"unknown brokers {unknown}; known: {', '.join(known)}")
    # SIGINT too: a shell starts background jobs with it ignored, and Python then keeps it so
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="sqlease-per-task-"))
    bench = Bench(tmp, StatsCluster(tmp, free_port(args.port)))
    watchdog = start_watchdog(bench.cluster)
    worktrees: list[Path] = []
    rounds: list[dict[str, Any]] = []
    try:
        versions = {
            "before": materialise("before", args.before, tmp, worktrees),
            "after": materialise("after", args.after, tmp, worktrees),
        }
        for version in versions.values():
            interpreter(version, tmp)
        if any(PG in b.url for b in brokers(tmp, PREFIX) if b.name in chosen):
            bench.cluster.start()
            bench.admin = psycopg.connect(bench.cluster.url, autocommit=True)
            bench.admin.execute("CREATE EXTENSION pg_stat_statements")
            print(f"cluster: {bench.cluster.url} in {bench.cluster.data}", flush=True)
        for number in range(1, rounds_wanted + 1):
            rounds.append(run_round(number, bench, versions, chosen, tasks))
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc}): nothing written", file=sys.stderr)
        return 130
    finally:
        if bench.admin is not None:
            bench.admin.close()
        bench.cluster.stop()
        for tree in worktrees:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False
            )
        shutil.rmtree(tmp, ignore_errors=True)
        watchdog.kill()
        watchdog.wait()
    for version in versions.values():
        print(f"{version.name} {version.label}: {version.seen}")
    rows = report(rounds, chosen)
    detail = {
        broker: {
            "functions": {
                k: differences(rounds, broker, k, ("functions",)) for k in KINDS if k != "cpu"
            },
            **(
                {"statements": differences(rounds, broker, "cpu", ("sql", "by_query"))}
                if broker.startswith("sqlease-pg")
                else {}
            ),
        }
        for broker in chosen
        if broker not in BASELINES
    }
    stamp = time.strftime("%Y-%m-%d")
    b, a = versions["before"], versions["after"]
    path = HERE / "results" / f"per-task-{stamp}-{b.label}-{a.label}{'-quick' * args.quick}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "args": {**vars(args), "tasks": tasks, "rounds": rounds_wanted},
                "versions": {v.name: {"label": v.label, "sqlease_file": v.seen} for v in (b, a)},
                "baselines_run_on": "after",
                "python": sys.version.split()[0],
                "seconds": round(time.monotonic() - started),
                "per_task": rows,
                "detail": detail,
                "rounds": slim(rounds),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"\n{round(time.monotonic() - started)} s; written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
