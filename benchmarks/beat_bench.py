"""Beat benchmark: one real ``celery beat -S sqlease.beat:Scheduler`` leader with N entries on
``crontab()`` (every minute), on SQLite and on PostgreSQL, beside Celery's own default
scheduler (``celery.beat:PersistentScheduler``) sending the same entries to Redis, in one run.

For each target, one after the other:

1. Fresh storage: SQLite, a new file in a temporary directory; PostgreSQL, a new database
   ``sqlease_beat_bench_<pid>`` on ``--pg-url`` (created and dropped here); the baseline, a
   new schedule file and a flushed Redis database (``--redis-url``). The beat app is
   benchmarks/beat_app.py: entries ``e00000``… sending ``bench.noop``; no worker runs.
2. One beat process is started a second after a minute boundary. sqlease: it is ready when it
   holds the leader lease and every entry has its next slot (``next_run_at_ms``) and none is
   due; the baseline: when its CPU stops growing (its schedule set up).
3. The measured window starts 5 s before a minute boundary and lasts ``--minutes`` minutes
   (so it holds that many boundaries, each with 55 s to finish its fires in the window),
   longer for sqlease if the last slot's fires are not all sent by then (up to 2 minutes
   more; the baseline's window is not extended, its fires may never catch up). The
   beat's CPU (utime + stime of /proc/<pid>/stat, all its threads) is read at both ends and
   every half second between; then it is stopped (SIGTERM).

Lateness of a fire = when it was sent minus its slot. sqlease: the message row's
``created_at_ms`` (the database clock at the insert; the row is visible at its transaction's
commit) minus the slot in its ``sqlease_slot`` header. The baseline's messages carry no slot:
the app stamps each publish with the time (header ``bench_sent_at``, set by a
``before_task_publish`` handler in the beat), and a fire's slot is the first minute boundary
after the entry's previous fire (or after the beat's start), the slot Celery's crontab
``is_due`` fires it for; the boundaries it passed over on the way are counted as missed.
"Seen" lateness: when a separate watcher process got the message (sqlease: a poll of the
messages table every 50 ms; Redis: ``RPOP``/``BRPOP`` of the ``celery`` list as fast as it
can) minus the slot. Every complete slot of sqlease's must have exactly N fires, one per
entry, and no task id may repeat; the run fails (exit status 1) if not.

Usage (run it with nothing else heavy on the machine)::

    .venv/bin/python benchmarks/beat_bench.py                 # 10,000 entries, 3 minutes
    .venv/bin/python benchmarks/beat_bench.py --entries 1000 --minutes 1 --only sqlite
    .venv/bin/python benchmarks/beat_bench.py --no-baseline --output /tmp/beat.json

Results: a Markdown table on stdout, progress on stderr, everything (per run: the timings, the
per-slot counts, the CPU samples) in ``benchmarks/results/beat-<date>.json``.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PG = os.environ.get("BENCH_PG_SERVER", "postgresql://postgres@127.0.0.1:5432")
REDIS = os.environ.get("BENCH_BEAT_REDIS", "redis://127.0.0.1:6379/13")
MINUTE_MS = 60_000
TICK = os.sysconf("SC_CLK_TCK")
#: The window starts this many seconds before a minute boundary.
LEAD_S = 5.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "p50_ms": percentile(values, 0.5),
        "p99_ms": percentile(values, 0.99),
        "max_ms": max(values) if values else None,
    }


def iso_ms(text: str) -> int:
    return int(datetime.fromisoformat(text).timestamp() * 1000)


def sleep_until(wall: float) -> None:
    while (left := wall - time.time()) > 0:
        time.sleep(min(left, 1.0))


def start_at_phase(phase: float) -> None:
    """Wait until ``phase`` seconds past a minute boundary (the next one if past it)."""
    now = time.time()
    at = math.floor(now / 60) * 60 + phase
    if at < now:
        at += 60
    sleep_until(at)


# ---- the watcher (a separate process: ``beat_bench.py --watch sqlease|redis``) --------------


def watch(kind: str, url: str, prefix: str, out: Path) -> int:
    """Record when each message is first seen, until SIGTERM; then write them to ``out``."""
    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    status = out.with_suffix(".count")
    last_status = 0.0
    if kind == "redis":
        import redis

        client = redis.Redis.from_url(url)
        raw: list[tuple[int, bytes]] = []
        while not stop:
            items = client.rpop("celery", 1000)
            if not items:
                got = client.brpop(["celery"], timeout=0.5)
                items = [got[1]] if got else []
            now = int(time.time() * 1000)
            raw.extend((now, item) for item in items)
            if time.monotonic() - last_status > 0.5:
                status.write_text(str(len(raw)))
                last_status = time.monotonic()
        records = []
        for seen, item in raw:  # decoded after the run, so that popping is all it does
            message = json.loads(item)
            headers = message["headers"]
            body = json.loads(base64.b64decode(message["body"]))
            records.append([headers["id"], body[0][0], headers.get("bench_sent_at"), seen])
    else:
        from sqlalchemy import create_engine, text

        from sqlease.urls import to_sqlalchemy_url

        engine = create_engine(to_sqlalchemy_url(f"sqlease+{url}"))
        query = text(f"SELECT id, task_id FROM {prefix}messages WHERE id > :last ORDER BY id")
        last = 0
        seen_at: dict[str, int] = {}
        while not stop:
            with engine.connect() as conn:
                rows = conn.execute(query, {"last": last}).all()
            now = int(time.time() * 1000)
            for row_id, task_id in rows:
                seen_at[task_id] = now
                last = row_id
            if time.monotonic() - last_status > 0.5:
                status.write_text(str(len(seen_at)))
                last_status = time.monotonic()
            time.sleep(0.05)
        records = [[task_id, None, None, seen] for task_id, seen in seen_at.items()]
    out.write_text(json.dumps(records))
    return 0


class Watcher:
    def __init__(self, kind: str, url: str, prefix: str, tmp: Path) -> None:
        self.out = tmp / f"watch-{kind}.json"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--watch",
                kind,
                "--watch-url",
                url,
                "--watch-prefix",
                prefix,
                "--watch-out",
                str(self.out),
            ],
            cwd=HERE,
            start_new_session=True,
        )

    def count(self) -> int:
        try:
            return int(self.out.with_suffix(".count").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def stop(self) -> list[list[Any]]:
        self.proc.send_signal(signal.SIGTERM)
        if self.proc.wait(120) != 0:
            raise RuntimeError(f"the watcher failed (exit status {self.proc.returncode})")
        return list(json.loads(self.out.read_text()))


# ---- one beat process ------------------------------------------------------------------------


class Beat:
    def __init__(self, scheduler: str, env: dict[str, str], tmp: Path, name: str) -> None:
        self.log_path = tmp / f"{name}.log"
        handle = self.log_path.open("wb")
        self.launched = time.time()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "beat_app",
                "beat",
                "-S",
                scheduler,
                "-l",
                "warning",
                "--pidfile=",
                "-s",
                str(tmp / f"{name}-schedule"),
            ],
            env=env,
            cwd=tmp,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        handle.close()
        self.samples: list[tuple[float, float]] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"beat exited ({self.proc.returncode}):\n{tail}")

    def cpu(self) -> float:
        self.alive()
        return cpu_seconds(self.pid)

    def sample(self) -> float:
        now, cpu = time.time(), self.cpu()
        self.samples.append((now, cpu))
        return cpu

    def stop(self) -> dict[str, float]:
        """SIGTERM, then the process's whole-life CPU (from wait4)."""
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            if pid:
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                return {
                    "lifetime_cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
                    "exit_status": self.proc.returncode,
                }
            time.sleep(0.1)
        os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait()
        return {"exit_status": self.proc.returncode, "killed": True}

    def kill(self) -> None:
        if self.proc.returncode is None and self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


def wait_for(predicate: Any, timeout: float, what: str, beat: Beat, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beat.alive()
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")


def measure_window(beat: Beat, minutes: int, done: Any) -> tuple[float, float, float, float]:
    """From LEAD_S before the next boundary, ``minutes`` minutes (longer, up to 2 more, until
    ``done()``): (wall start, wall end, CPU at start, CPU at end)."""
    start_at_phase(60 - LEAD_S)
    wall0, cpu0 = time.time(), beat.sample()
    end = wall0 + minutes * 60
    while True:
        time.sleep(0.5)
        beat.sample()
        now = time.time()
        if now >= end and done():
            break
        if now >= end + 120:
            log("the last slot's fires were not all sent 2 minutes after the window")
            break
    wall1, cpu1 = time.time(), beat.sample()
    return wall0, wall1, cpu0, cpu1


def cpu_figures(
    wall0: float,
    wall1: float,
    cpu0: float,
    cpu1: float,
    fires: int,
    samples: list[tuple[float, float]],
    busy: list[tuple[float, float]],
) -> dict[str, Any]:
    seconds, cpu = wall1 - wall0, cpu1 - cpu0
    # CPU outside the bursts (from each boundary to its last fire, plus a second): what the
    # beat costs while nothing is due.
    idle_cpu = idle_s = 0.0
    for (t_a, c_a), (t_b, c_b) in itertools.pairwise(samples):
        if t_a < wall0 or t_b > wall1:
            continue
        if any(t_b > lo and t_a < hi + 1.0 for lo, hi in busy):
            continue
        idle_cpu += c_b - c_a
        idle_s += t_b - t_a
    return {
        "window_s": round(seconds, 2),
        "cpu_s": round(cpu, 2),
        "cpu_s_per_minute": round(cpu / (seconds / 60), 3),
        "cpu_ms_per_fire": round(cpu * 1000 / fires, 3) if fires else None,
        "core_percent": round(100 * cpu / seconds, 2),
        "idle_s": round(idle_s, 1),
        "idle_core_percent": round(100 * idle_cpu / idle_s, 3) if idle_s else None,
    }


def window_slots(wall0: float, wall1: float) -> list[int]:
    first = math.floor(wall0 * 1000 / MINUTE_MS) + 1
    last = math.floor(wall1 * 1000 / MINUTE_MS)
    return [m * MINUTE_MS for m in range(first, last + 1)]


# ---- sqlease -----------------------------------------------------------------------------


def run_sqlease(kind: str, db_url: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from sqlalchemy import func, select

    from sqlease.beat import slot_task_id
    from sqlease.store import Store

    n = args.entries
    prefix = f"beat{os.getpid()}_"
    store = Store(db_url, table_prefix=prefix)  # the tables, before the beat starts
    s, m, leaders = store.tables.schedules, store.tables.messages, store.tables.leaders
    env = dict(
        os.environ,
        BEAT_BENCH_BROKER=f"sqlease+{db_url}",
        BEAT_BENCH_PREFIX=prefix,
        BEAT_BENCH_ENTRIES=str(n),
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    )
    env.pop("BEAT_BENCH_STAMP", None)

    def one(query: Any) -> Any:
        with store.driver.reading() as conn:
            return conn.execute(query).first()

    def leads() -> bool:
        row = one(select(leaders.c.owner, leaders.c.expires_at_ms))
        return bool(
            row is not None and row[0].split(":")[1] == str(beat.pid) and row[1] > store.now_ms()
        )

    last_progress = [0.0]

    def planned() -> bool:
        total, unplanned = one(
            select(func.count(), func.count().filter(s.c.next_run_at_ms.is_(None)))
        )
        if time.monotonic() - last_progress[0] > 15:
            log(f"{kind}: {total} entries stored, {unplanned} without a next slot")
            last_progress[0] = time.monotonic()
        return bool(total == n and unplanned == 0)

    def settled() -> bool:  # nothing due: the next slot of every entry is still to come
        earliest = one(select(func.min(s.c.next_run_at_ms)))[0]
        return earliest is not None and earliest > store.now_ms()

    def count() -> int:
        return int(one(select(func.count()).select_from(m))[0])

    start_at_phase(1.0)
    beat = Beat("sqlease.beat:Scheduler", env, tmp, kind)
    watcher: Watcher | None = None
    out: dict[str, Any] = {"target": f"sqlease-{kind}", "entries": n}
    try:
        wait_for(leads, 120, "the beat to lead", beat)
        out["leads_after_s"] = round(time.time() - beat.launched, 2)
        wait_for(planned, args.plan_timeout, "every entry planned", beat, every=1.0)
        out["planned_after_s"] = round(time.time() - beat.launched, 2)
        out["startup_cpu_s"] = round(beat.sample(), 2)
        log(
            f"{kind}: leads after {out['leads_after_s']} s, every entry planned after "
            f"{out['planned_after_s']} s ({out['startup_cpu_s']} s CPU)"
        )
        watcher = Watcher("sqlease", db_url, prefix, tmp)
        wait_for(settled, 180, "no entry due", beat, every=0.5)
        before = [0]

        def done() -> bool:
            return count() >= before[0] + n * args.minutes

        # The window: the count of rows before it is taken at its start (nothing due then).
        start_at_phase(60 - LEAD_S - 1)
        if not settled():
            wait_for(settled, 180, "no entry due", beat, every=0.5)
        before[0] = count()
        wall0, wall1, cpu0, cpu1 = measure_window(beat, args.minutes, done)
        out.update(beat.stop())
        time.sleep(1.0)
        seen = {r[0]: r[3] for r in watcher.stop()}
        watcher = None
    finally:
        beat.kill()
        if watcher is not None:
            watcher.proc.kill()
            watcher.proc.wait()
    with store.driver.reading() as conn:
        rows = conn.execute(
            select(m.c.task_id, m.c.created_at_ms, m.c.payload).order_by(m.c.id)
        ).all()
    slots = window_slots(wall0, wall1)
    per_slot: dict[int, list[tuple[str, str]]] = {slot: [] for slot in slots}
    late, late_seen, problems = [], [], []
    busy: dict[int, float] = {}
    ids: set[str] = set()
    outside = 0
    for task_id, created, payload in rows:
        headers = json.loads(payload)["headers"]
        slot, name = iso_ms(headers["sqlease_slot"]), headers["sqlease_schedule"]
        if task_id in ids:
            problems.append(f"task id {task_id} ({name}, {headers['sqlease_slot']}) repeated")
        ids.add(task_id)
        if task_id != slot_task_id(prefix, name, slot):
            problems.append(f"task id {task_id} is not {name}'s for {headers['sqlease_slot']}")
        if slot not in per_slot:
            outside += 1
            continue
        per_slot[slot].append((name, task_id))
        late.append(created - slot)
        if task_id in seen:
            late_seen.append(seen[task_id] - slot)
        busy[slot] = max(busy.get(slot, 0), created)
    counts = {}
    for slot, fired in per_slot.items():
        names = {name for name, _ in fired}
        counts[datetime.fromtimestamp(slot / 1000).isoformat()] = len(fired)
        if len(fired) != n or len(names) != n:
            problems.append(
                f"slot {datetime.fromtimestamp(slot / 1000)}: {len(fired)} fires, "
                f"{len(names)} entries (expected {n})"
            )
    fires = sum(len(f) for f in per_slot.values())
    windows = [(slot / 1000, busy[slot] / 1000) for slot in busy]
    out.update(
        {
            "slots": counts,
            "fires": fires,
            "fires_outside_window": outside,
            "fires_per_minute": round(fires / ((wall1 - wall0) / 60), 1),
            "lateness": spread(late),
            "lateness_seen": spread(late_seen),
            "burst_s": [round(hi - lo, 2) for lo, hi in windows],
            **cpu_figures(wall0, wall1, cpu0, cpu1, fires, beat.samples, windows),
            "cpu_samples": [(round(t - wall0, 2), round(c, 2)) for t, c in beat.samples],
            "problems": problems[:50],
            "problem_count": len(problems),
            "ok": not problems,
        }
    )
    return out


def sqlite_target(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    where = tmp / "sqlite"
    where.mkdir()
    return run_sqlease("sqlite", f"sqlite:///{where}/beat.db", args, where)


def postgresql_target(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import psycopg

    name = f"sqlease_beat_bench_{os.getpid()}"
    where = tmp / "postgresql"
    where.mkdir()
    with psycopg.connect(f"{args.pg_url}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        return run_sqlease("postgresql", f"{args.pg_url}/{name}", args, where)
    finally:
        from sqlease._db.engine import dispose_all

        dispose_all(close=True)
        with psycopg.connect(f"{args.pg_url}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ---- the baseline: Celery's PersistentScheduler, Redis -----------------------------------


def baseline_target(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import redis

    n = args.baseline_entries or args.entries
    where = tmp / "baseline"
    where.mkdir()
    redis.Redis.from_url(args.redis_url).flushdb()
    env = dict(
        os.environ,
        BEAT_BENCH_BROKER=args.redis_url,
        BEAT_BENCH_ENTRIES=str(n),
        BEAT_BENCH_STAMP="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    )
    watcher = Watcher("redis", args.redis_url, "", where)
    start_at_phase(1.0)
    beat = Beat("celery.beat:PersistentScheduler", env, where, "baseline")
    out: dict[str, Any] = {"target": "celery-persistent-redis", "entries": n}
    try:
        # Ready: its CPU has not grown for a second (the schedule is set up, it sleeps).
        last = [-1.0]

        def idle() -> bool:
            cpu = beat.cpu()
            still = cpu - last[0] < 0.02 and time.time() - beat.launched > 3
            last[0] = cpu
            return still

        wait_for(idle, args.plan_timeout, "the baseline beat to set up", beat, every=1.0)
        out["planned_after_s"] = round(time.time() - beat.launched, 2)
        out["startup_cpu_s"] = round(beat.sample(), 2)
        launch_minute = math.floor(beat.launched / 60)
        if math.floor(time.time() / 60) != launch_minute:
            log(
                "baseline: set-up crossed a minute boundary; first slots may be attributed "
                "a minute early"
            )
        log(f"baseline: set up after {out['planned_after_s']} s ({out['startup_cpu_s']} s CPU)")

        def done() -> bool:
            return True  # its fires of the last slot may never come: the window is fixed

        start_at_phase(60 - LEAD_S - 1)
        wall0, wall1, cpu0, cpu1 = measure_window(beat, args.minutes, done)
        out.update(beat.stop())
        time.sleep(1.0)
        left = redis.Redis.from_url(args.redis_url).llen("celery")
        records = watcher.stop()
        out["left_in_redis"] = left
    finally:
        beat.kill()
        if watcher.proc.poll() is None:
            watcher.proc.kill()
            watcher.proc.wait()
    slots = window_slots(wall0, wall1)
    window_ms = (int(wall0 * 1000), int(wall1 * 1000))
    by_entry: dict[str, list[tuple[int, int, str]]] = {}
    ids: set[str] = set()
    repeated = 0
    for task_id, name, sent, seen in records:
        if task_id in ids:
            repeated += 1
        ids.add(task_id)
        by_entry.setdefault(name, []).append((int(sent * 1000), seen, task_id))
    per_slot = dict.fromkeys(slots, 0)
    late, late_seen, missed_in_window = [], [], 0
    sent_in_window = 0
    busy: dict[int, float] = {}
    launched_ms = int(beat.launched * 1000)
    for fires in by_entry.values():
        fires.sort()
        previous = launched_ms
        for sent, seen, _ in fires:
            slot = (previous // MINUTE_MS + 1) * MINUTE_MS  # the first boundary after it
            passed = sent // MINUTE_MS - previous // MINUTE_MS - 1
            previous = sent
            if window_ms[0] <= sent <= window_ms[1]:
                sent_in_window += 1
                missed_in_window += max(0, passed)
            if slot not in per_slot:
                continue
            per_slot[slot] += 1
            late.append(sent - slot)
            late_seen.append(seen - slot)
            busy[slot] = max(busy.get(slot, 0), sent)
    windows = [(slot / 1000, busy[slot] / 1000) for slot in busy]
    out.update(
        {
            "slots": {datetime.fromtimestamp(s / 1000).isoformat(): c for s, c in per_slot.items()},
            "fires": sent_in_window,
            "fires_of_window_slots": sum(per_slot.values()),
            "fires_per_minute": round(sent_in_window / ((wall1 - wall0) / 60), 1),
            "entries_fired": len(by_entry),
            "slots_passed_over_in_window": missed_in_window,
            "repeated_task_ids": repeated,
            "lateness": spread(late),
            "lateness_seen": spread(late_seen),
            "burst_s": [round(hi - lo, 2) for lo, hi in windows],
            **cpu_figures(wall0, wall1, cpu0, cpu1, sent_in_window, beat.samples, windows),
            "cpu_samples": [(round(t - wall0, 2), round(c, 2)) for t, c in beat.samples],
        }
    )
    return out


# ---- the report --------------------------------------------------------------------------


def number(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| target | fires/min | fires per slot | lateness p50 / p99 / max ms | seen p50 / p99 / max"
        " ms | burst s | leader CPU s/min | CPU ms/fire | % of a core | idle % |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['target']} | error: {r['error']} |")
            continue
        lat, seen = r["lateness"], r["lateness_seen"]
        slots = ", ".join(str(c) for c in r["slots"].values())
        bursts = ", ".join(f"{b:g}" for b in r["burst_s"])
        lines.append(
            f"| {r['target']} | {number(r['fires_per_minute'])} | {slots} | "
            f"{number(lat['p50_ms'])} / {number(lat['p99_ms'])} / {number(lat['max_ms'])} | "
            f"{number(seen['p50_ms'])} / {number(seen['p99_ms'])} / {number(seen['max_ms'])} | "
            f"{bursts} | {r['cpu_s_per_minute']:.2f} | {number(r['cpu_ms_per_fire'], 3)} | "
            f"{r['core_percent']:.1f} | {number(r['idle_core_percent'], 2)} |"
        )
    return "\n".join(lines)


def ratios(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    base = next(
        (r for r in runs if r["target"] == "celery-persistent-redis" and "error" not in r), None
    )
    out: dict[str, dict[str, float | None]] = {}
    if base is None:
        return out

    def ratio(a: Any, b: Any) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    for r in runs:
        if r is base or "error" in r:
            continue
        out[r["target"]] = {
            **{
                f"lateness_{k}": ratio(r["lateness"][k], base["lateness"][k])
                for k in ("p50_ms", "p99_ms", "max_ms")
            },
            "cpu_s_per_minute": ratio(r["cpu_s_per_minute"], base["cpu_s_per_minute"]),
            "cpu_ms_per_fire": ratio(r["cpu_ms_per_fire"], base["cpu_ms_per_fire"]),
        }
    return out


def git(*argv: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *argv], capture_output=True, text=True, check=False
    ).stdout.strip()


def src_state() -> str:
    """The commit and a digest of the uncommitted changes under src/: the code a beat imports
    when it starts (the venv's install is editable)."""
    import hashlib

    diff = git("diff", "HEAD", "--", "src")
    digest = hashlib.sha1(diff.encode()).hexdigest()[:8] if diff else "clean"
    return f"{git('rev-parse', '--short', 'HEAD')}+{digest}"


def environment() -> dict[str, Any]:
    import celery
    import sqlalchemy

    return {
        "commit": git("describe", "--always", "--dirty"),
        "python": sys.version.split()[0],
        "celery": celery.__version__,
        "sqlalchemy": sqlalchemy.__version__,
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "nice": os.nice(0),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--minutes", type=int, default=3, help="minute boundaries measured")
    parser.add_argument(
        "--only",
        default="sqlite,postgresql",
        help="sqlease targets: sqlite, postgresql (comma list)",
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="no Celery PersistentScheduler + Redis run"
    )
    parser.add_argument(
        "--baseline-entries",
        type=int,
        default=None,
        help="entries of the baseline (default: --entries)",
    )
    parser.add_argument("--pg-url", default=PG, help="the PostgreSQL server (no database)")
    parser.add_argument(
        "--redis-url", default=REDIS, help="the baseline's Redis database (flushed)"
    )
    parser.add_argument(
        "--plan-timeout", type=float, default=900, help="seconds a beat may take to be ready"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON file to write (default: results/beat-<date>.json)",
    )
    parser.add_argument("--watch", choices=["sqlease", "redis"], help=argparse.SUPPRESS)
    parser.add_argument("--watch-url", help=argparse.SUPPRESS)
    parser.add_argument("--watch-prefix", help=argparse.SUPPRESS)
    parser.add_argument("--watch-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.watch:
        return watch(args.watch, args.watch_url, args.watch_prefix, args.watch_out)
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    env = environment()
    targets = [("sqlite", sqlite_target), ("postgresql", postgresql_target)]
    chosen = [(name, run) for name, run in targets if name in args.only.split(",")]
    if not args.no_baseline:
        chosen.append(("baseline", baseline_target))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sqlease-beat-bench-") as tmp:
        for name, run in chosen:
            log(f"{name}: starting ({args.entries} entries, {args.minutes} minutes)")
            started, code = time.monotonic(), src_state()
            try:
                result = run(args, Path(tmp))
            except Exception as exc:  # a failed target must not hide the others
                result = {"target": name, "error": f"{type(exc).__name__}: {exc}"}
            result["seconds"] = round(time.monotonic() - started)
            result["src"] = code
            if src_state() != code:
                result["src_changed_during_run"] = src_state()
                log(f"{name}: src/ changed during the run ({code} -> {src_state()})")
            runs.append(result)
            summary = {k: v for k, v in result.items() if k not in ("cpu_samples",)}
            log(json.dumps(summary))
    print(table(runs))
    found = ratios(runs)
    if found:
        print("\nsqlease / baseline:")
        for target, values in found.items():
            print(f"  {target}: " + ", ".join(f"{k} {number(v, 3)}" for k, v in values.items()))
    failed = [r for r in runs if r["target"].startswith("sqlease") and not r.get("ok")]
    for r in failed:
        print(
            f"\nFAILED {r['target']}: {r.get('error') or r.get('problem_count')} "
            f"{r.get('problems', '')}",
            file=sys.stderr,
        )
    stamp = time.strftime("%Y-%m-%d")
    path = args.output or HERE / "results" / f"beat-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "args": {
                    k: str(v) if isinstance(v, Path) else v
                    for k, v in vars(args).items()
                    if not k.startswith("watch")
                },
                "environment": env,
                "runs": runs,
                "ratios": found,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"written {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
