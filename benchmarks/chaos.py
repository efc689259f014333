"""Chaos run: real prefork workers under faults, then a check that nothing was lost or done
twice.

While the workers run, it SIGKILLs a random worker every few seconds (and starts a new one),
SIGSTOPs one past its lease and SIGCONTs it, terminates the workers' PostgreSQL connections
(``pg_terminate_backend``) and restarts PostgreSQL once. At the end it checks and prints:
every task finished exactly once in its fenced result; no run ever had two tasks executing at
once; checkpoints never went backwards; no task exceeded its attempt budget except the
poisoned ones, which ended ``attempts_exhausted``; nothing left leased or ready; and how many
kills, stalls, disconnects and restarts were survived.

    python benchmarks/chaos.py --db pg --short        # what CI runs (about a minute)
    python benchmarks/chaos.py --db pg                # the long run (explanation/reliability.md)
    python benchmarks/chaos.py --db sqlite --short    # one machine: worker kills only
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
PG = os.environ.get("CHAOS_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


@dataclass
class Config:
    db: str
    runs: int
    tasks_per_run: int
    steps: int
    step_seconds: float
    workers: int
    lease: float
    kill_every: float
    disconnect_every: float
    poisoned: int
    timeout: float
    restart_pg: bool
    stall: bool


def config(db: str, short: bool) -> Config:
    if short:
        return Config(
            db,
            runs=20,
            tasks_per_run=8,
            steps=3,
            step_seconds=0.05,
            workers=3,
            lease=2.0,
            kill_every=4.0,
            disconnect_every=5.0,
            poisoned=2,
            timeout=240.0,
            restart_pg=db == "pg",
            stall=True,
        )
    return Config(
        db,
        runs=200,
        tasks_per_run=15,
        steps=4,
        step_seconds=0.05,
        workers=4,
        lease=2.0,
        kill_every=5.0,
        disconnect_every=7.0,
        poisoned=5,
        timeout=1800.0,
        restart_pg=db == "pg",
        stall=True,
    )


@dataclass
class Chaos:
    cfg: Config
    url: str
    prefix: str
    tmp: Path
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def env(self) -> dict[str, str]:
        return dict(
            os.environ,
            CHAOS_URL=self.url,
            CHAOS_PREFIX=self.prefix,
            CHAOS_LEASE=str(self.cfg.lease),
            PYTHONPATH=str(HERE),
        )

    def start_worker(self) -> subprocess.Popen[bytes]:
        log = (self.tmp / "workers.log").open("ab")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "chaos_app",
                "worker",
                "--pool",
                "prefork",
                "-c",
                "2",
                "-l",
                "warning",
                "-n",
                f"chaos-{uuid.uuid4().hex[:6]}@%h",
                "--without-mingle",
                "--without-gossip",
            ],
            env=self.env(),
            cwd=HERE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.workers.append(proc)
        return proc

    def kill_random(self) -> None:
        alive = [w for w in self.workers if w.poll() is None]
        if not alive:
            return
        victim = random.choice(alive)
        try:
            os.killpg(victim.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        victim.wait()
        self.counts["kills"] += 1
        self.start_worker()

    def stall_one(self) -> None:
        alive = [w for w in self.workers if w.poll() is None]
        if not alive:
            return
        victim = random.choice(alive)
        os.killpg(victim.pid, signal.SIGSTOP)
        time.sleep(self.cfg.lease * 1.6)
        os.killpg(victim.pid, signal.SIGCONT)
        self.counts["stalls"] += 1

    def disconnect(self) -> None:
        import psycopg

        with psycopg.connect(PG, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name LIKE 'sqlease%%' AND pid <> pg_backend_pid() "
                "AND datname = current_database()"
            ).fetchall()
        self.counts["disconnects"] += 1
        self.counts["connections_terminated"] += len(rows)

    def restart_pg(self) -> None:
        version = sorted(os.listdir("/etc/postgresql"))[0]
        subprocess.run(
            [
                "pg_ctlcluster",
                "--skip-systemctl-redirect",
                version,
                "main",
                "restart",
                "-m",
                "fast",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        self.counts["restarts"] += 1

    def stop_all(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()


def check(store: Any, cfg: Config, task_ids: dict[str, tuple[str, int, bool]]) -> dict[str, Any]:
    """Verify the guarantees from the database alone."""
    from sqlalchemy import select

    from sqlease._core import exhausted_results
    from sqlease.admin import Admin
    from sqlease.store import expand_event_rows

    # A worker killed between marking a task exhausted and writing its FAILURE leaves the
    # result to the next maintenance pass; run that repair now rather than wait a pass.
    exhausted_results.write_missing(store)
    t = store.tables
    admin = Admin("x", store=store)
    problems: list[str] = []
    finished = exhausted = reexecuted = 0
    with store.driver.reading() as conn:
        results = {
            r.task_id: r
            for r in conn.execute(select(t.results.c.task_id, t.results.c.state, t.results.c.value))
        }
        leftovers = conn.execute(
            select(t.messages.c.task_id, t.messages.c.state, t.messages.c.reason)
        ).fetchall()
        rows = conn.execute(select(t.events).order_by(t.events.c.id))
        events = [SimpleNamespace(**e) for e in expand_event_rows(r._mapping for r in rows)]
    by_task: dict[str, list[Any]] = defaultdict(list)
    for event in events:
        by_task[event.task_id].append(event)
    for task_id, (_run_id, _seq, poison) in task_ids.items():
        row = results.get(task_id)
        if poison:
            if row is None or row.state != "FAILURE":
                problems.append(f"poisoned {task_id}: result {row and row.state}")
            kinds = [e.kind for e in by_task[task_id]]
            if "attempts_exhausted" not in kinds:
                problems.append(f"poisoned {task_id} did not end attempts_exhausted")
            exhausted += 1
            continue
        if row is None or row.state != "SUCCESS":
            problems.append(f"task {task_id} has no SUCCESS result ({row and row.state})")
            continue
        value = json.loads(bytes(row.value))["result"]
        if value["i"] != cfg.steps:
            problems.append(f"task {task_id} finished at step {value['i']}")
        finished += 1
        checkpoints = [
            json.loads(e.data)["checkpoint"]["i"]
            for e in by_task[task_id]
            if e.kind == "checkpoint"
        ]
        if checkpoints != sorted(checkpoints):
            problems.append(f"task {task_id}: checkpoints went backwards {checkpoints}")
        attempts = max((e.attempt or 0) for e in by_task[task_id])
        if attempts > store.max_attempts:
            problems.append(f"task {task_id} exceeded its budget: attempt {attempts}")
        # The delivery that stored the result completed under its lease. A delivery that
        # completed and then died before storing its result is re-run (at-least-once) and
        # resumes from its last checkpoint: counted, not a failure.
        ends = [e.attempt for e in by_task[task_id] if e.kind == "exec_end"]
        if value["attempt"] not in ends:
            problems.append(f"task {task_id}: its result's delivery recorded no completion")
        if any(a > value["attempt"] for a in ends):
            problems.append(f"task {task_id}: a delivery completed after the result was stored")
        reexecuted += len(ends) - 1
    # No run had two tasks executing at once: fenced activity intervals of different tasks of
    # one run (first fenced write of a delivery .. its last) never overlap.
    intervals: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for task_id, (run_id, _, _poison) in task_ids.items():
        per_attempt: dict[int, list[int]] = defaultdict(list)
        for e in by_task[task_id]:
            if e.kind in ("exec_start", "checkpoint", "exec_end") and e.attempt:
                per_attempt[e.attempt].append(e.at_ms)
        for stamps in per_attempt.values():
            intervals[run_id].append((min(stamps), max(stamps), task_id))
    overlaps = 0
    for run_id, spans in intervals.items():
        spans.sort()
        for (_s1, e1, t1), (s2, _e2, t2) in itertools.pairwise(spans):
            if t1 != t2 and s2 < e1:
                overlaps += 1
                problems.append(f"run {run_id}: {t1} and {t2} overlapped")
    left = [r for r in leftovers if not (r.state == "dead" and r.reason == "attempts_exhausted")]
    if left:
        problems.append(f"{len(left)} messages left leased or ready: {left[:5]}")
    return {
        "finished_once": finished,
        "reexecuted_after_crash_before_result": reexecuted,
        "poisoned_exhausted": exhausted,
        "run_overlaps": overlaps,
        "lost": len([1 for tid, v in task_ids.items() if not v[2] and tid not in results]),
        "problems": problems[:20],
        "admin_stats": admin.stats(),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", choices=("pg", "sqlite"), default="pg")
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    cfg = config(args.db, args.short)
    random.seed(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="sqlease-chaos-"))
    prefix = f"chaos{os.getpid()}_"
    url = f"sqlease+{PG}" if cfg.db == "pg" else f"sqlease+sqlite:///{tmp}/chaos.db"
    os.environ.update(CHAOS_URL=url, CHAOS_PREFIX=prefix, CHAOS_LEASE=str(cfg.lease))
    sys.path.insert(0, str(HERE))
    import chaos_app
    from sqlalchemy import func, select
    from sqlalchemy.exc import OperationalError

    from sqlease import Store
    from sqlease.urls import strip_prefix

    store = Store(strip_prefix(url), table_prefix=prefix, max_attempts=8)
    chaos = Chaos(cfg, url, prefix, tmp)
    started = time.monotonic()
    task_ids: dict[str, tuple[str, int, bool]] = {}
    poison_at = set(random.sample(range(cfg.runs), cfg.poisoned))
    for seq in range(cfg.tasks_per_run):  # interleaved across runs: claimers really race
        for run in range(cfg.runs):
            run_id = f"run-{run}"
            poison = run in poison_at and seq == cfg.tasks_per_run - 1
            result = chaos_app.work.apply_async(
                (run_id, seq, cfg.steps, cfg.step_seconds, poison),
                headers={"run_id": run_id},
            )
            task_ids[result.id] = (run_id, seq, poison)
    for _ in range(cfg.workers):
        chaos.start_worker()
    last_kill = last_disconnect = time.monotonic()
    did_stall = did_restart = False
    total = len(task_ids)
    outcome = "timeout"
    try:
        while time.monotonic() - started < cfg.timeout:
            time.sleep(0.5)
            try:
                with store.driver.reading() as conn:
                    remaining = conn.execute(
                        select(func.count())
                        .select_from(store.tables.messages)
                        .where(store.tables.messages.c.state == "ready")
                    ).scalar_one()
            except OperationalError:  # our own connection was terminated too: look again
                continue
            elapsed = time.monotonic() - started
            if remaining == 0:
                outcome = "drained"
                break
            now = time.monotonic()
            if now - last_kill >= cfg.kill_every:
                chaos.kill_random()
                last_kill = now
            if cfg.db == "pg" and now - last_disconnect >= cfg.disconnect_every:
                chaos.disconnect()
                last_disconnect = now
            # Faults are scheduled by time and by progress, whichever comes first, so a fast
            # machine that drains the backlog early still sees every one of them.
            if (
                cfg.stall
                and not did_stall
                and (elapsed > cfg.kill_every * 1.5 or remaining <= total * 3 // 4)
            ):
                chaos.stall_one()
                did_stall = True
            if (
                cfg.restart_pg
                and not did_restart
                and (elapsed > cfg.kill_every * 3 or remaining <= total // 2)
            ):
                chaos.restart_pg()
                did_restart = True
    finally:
        chaos.stop_all()
    from sqlease._db.engine import dispose_all

    dispose_all()
    report = check(store, cfg, task_ids)
    report.update(
        db=cfg.db,
        tasks=total,
        runs=cfg.runs,
        outcome=outcome,
        seconds=round(time.monotonic() - started, 1),
        **dict(chaos.counts),
    )
    print(json.dumps(report, indent=2, default=str))
    ok = outcome == "drained" and not report["problems"] and report["lost"] == 0
    print("CHAOS OK" if ok else f"CHAOS FAILED (logs in {tmp})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
