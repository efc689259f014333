"""Chaos run: real prefork workers under faults, then a check that nothing was lost or done
twice, from the database and from what the tasks recorded.

Tasks in runs (``run_id``: serialized) and alone, each checkpointing several times. While the
workers run it SIGKILLs workers (and starts new ones), SIGSTOPs workers past their lease and
SIGCONTs them, and, on PostgreSQL, terminates the connections to its database, restarts the
server once and cuts single workers off from it (a TCP proxy per worker stops forwarding both
ways, sockets open: a partition). PostgreSQL is a throwaway server of the run's own
(tests/e2e/pg_clusters.py), never the machine's; ``--db pgbouncer`` puts a PgBouncer in
transaction mode in front of it. The faults are scheduled by progress (share of tasks done),
so a fast or a slow machine sees every one of them. Most tasks are published before the
workers start; a twentieth more (150 in a short run) are published one by one while the
faults are made, paced by progress as the faults are, so the terminations and the restart
meet publishes too.

At the end it checks: every task has exactly one result (SUCCESS; the poisoned ones FAILURE
after ``attempts_exhausted``); no two live holders of a task or of a run at once (from the
database's fenced timeline and claims, and from the tasks' records); checkpoints never went
backwards; every task cut off by a partition learned ``LeaseLost`` within the lease plus the
margin of the cut, before the network healed, and its writes held by the partition were
refused; every task stopped past its lease learned it on waking; every task was stored by
one publish (one ``enqueued`` event); nothing left leased or ready.

    python benchmarks/chaos.py --db pg --short          # what CI runs (about a minute)
    python benchmarks/chaos.py --db sqlite --short      # SQLite: worker kills and stalls
    python benchmarks/chaos.py --db pg --scale 10 --out benchmarks/results/chaos-pg.json
    python benchmarks/chaos.py --db pgbouncer --scale 10
    python benchmarks/chaos.py --db sqlite --scale 10
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from chaos_check import check_database, check_records, load_records  # noqa: E402
from chaos_faults import Chaos  # noqa: E402


@dataclass
class Config:
    db: str
    runs: int
    tasks_per_run: int
    alone: int
    steps: int
    step_seconds: float
    workers: int
    lease: float
    kills: int
    stalls: int
    partitions: int
    restarts: int
    disconnect_every: float
    poisoned: int
    timeout: float
    #: Tasks published alone while the faults are made (LatePublisher), besides the others.
    late: int


def config(db: str, short: bool, scale: int) -> Config:
    pg = db != "sqlite"
    if short:
        return Config(
            db, runs=20, tasks_per_run=8, alone=40, steps=3, step_seconds=0.05, workers=3,
            lease=2.0, kills=5, stalls=1, partitions=int(pg), restarts=int(pg),
            disconnect_every=5.0, poisoned=2, timeout=240.0, late=150,
        )  # fmt: skip
    # --scale 1 is the earlier long run's size (3,000 tasks), 10 is 10,000 tasks: 60 % in
    # runs of 15, 40 % alone; faults at least those the reliability page promises.
    tasks = 1000 * scale if scale > 1 else 3000
    runs = tasks * 6 // 10 // 15
    return Config(
        db, runs=runs, tasks_per_run=15, alone=tasks - runs * 15, steps=3, step_seconds=0.03,
        workers=4, lease=2.0, kills=max(20, 3 * scale + 6), stalls=max(1, scale // 2),
        partitions=max(1, scale // 2) if pg else 0, restarts=int(pg), disconnect_every=7.0,
        poisoned=5, timeout=600.0 * max(1, scale), late=tasks // 20,
    )  # fmt: skip


def plan(cfg: Config) -> list[tuple[float, str]]:
    """The faults, by the share of tasks done at which each is made: spread evenly over the
    first nine tenths, the restart half-way."""

    def spread(n: int, kind: str, lo: float = 0.03, hi: float = 0.9) -> list[tuple[float, str]]:
        return [(lo + (hi - lo) * (i + 0.5) / n, kind) for i in range(n)]

    faults = spread(cfg.kills, "kill") + spread(cfg.stalls, "stall", 0.08, 0.85)
    faults += spread(cfg.partitions, "partition", 0.1, 0.8)
    faults += [(0.5, "restart")] * cfg.restarts
    return sorted(faults)


def remaining(store: Any) -> int | None:
    """Messages not yet acked and not dead (None while the database cannot be read)."""
    from sqlalchemy import func, select
    from sqlalchemy.exc import OperationalError

    m = store.tables.messages
    try:
        with store.driver.reading() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(m).where(m.c.state != "dead")
                ).scalar_one()
            )
    except OperationalError:  # our own connection was terminated too, or a restart: again
        return None


def enqueue(cfg: Config) -> dict[str, tuple[str | None, int, bool]]:
    import chaos_app

    task_ids: dict[str, tuple[str | None, int, bool]] = {}
    poison_at = set(random.sample(range(cfg.runs), cfg.poisoned))
    args = (cfg.steps, cfg.step_seconds)
    for seq in range(cfg.tasks_per_run):  # interleaved across runs: claimers really race
        for run in range(cfg.runs):
            run_id = f"run-{run}"
            poison = run in poison_at and seq == cfg.tasks_per_run - 1
            sent = chaos_app.work.apply_async(
                (run_id, seq, *args, poison), headers={"run_id": run_id}
            )
            task_ids[sent.id] = (run_id, seq, poison)
        for n in range(
            cfg.alone * seq // cfg.tasks_per_run, cfg.alone * (seq + 1) // cfg.tasks_per_run
        ):
            sent = chaos_app.work.apply_async((None, n, *args))
            task_ids[sent.id] = (None, n, False)
    return task_ids


class LatePublisher(threading.Thread):
    """Publishes ``cfg.late`` tasks alone while the faults are made, paced by the run's
    progress as the faults are (``allow``: the n-th goes once the drive has seen the share
    of tasks done that n stands for, the last at ``LATE_UNTIL``), so the connection
    terminations and the restart meet publishes at any scale. A publish that raises after
    the store's and Kombu's retries is a problem: the faults here are ones a publish is to
    ride out."""

    def __init__(self, cfg: Config, task_ids: dict[str, tuple[str | None, int, bool]]) -> None:
        super().__init__(name="late-publisher", daemon=True)
        self.cfg, self.task_ids = cfg, task_ids
        self.failed: list[str] = []
        #: When each late publish began and ended (wall clock, as the faults' times).
        self.spans: list[tuple[float, float]] = []
        self._allowed = 0
        self._turn = threading.Condition()
        self._stopped = False

    def allow(self, done: float) -> None:
        """The drive's share of tasks done: publish as many as that share stands for."""
        n = self.cfg.late if done >= LATE_UNTIL else int(self.cfg.late * done / LATE_UNTIL) + 1
        with self._turn:
            if n > self._allowed:
                self._allowed = n
                self._turn.notify()

    def stop(self) -> None:
        with self._turn:
            self._stopped = True
            self._turn.notify()

    def run(self) -> None:
        import chaos_app

        args = (self.cfg.steps, self.cfg.step_seconds)
        for n in range(self.cfg.late):
            with self._turn:
                self._turn.wait_for(lambda n=n: self._allowed > n or self._stopped)
                if self._stopped:
                    return
            time.sleep(LATE_SPACING)  # one by one, not a burst
            task_id = str(uuid.uuid4())
            self.task_ids[task_id] = (None, self.cfg.alone + n, False)
            began = time.time()
            try:
                chaos_app.work.apply_async((None, self.cfg.alone + n, *args), task_id=task_id)
            except Exception as exc:  # counted, and the run fails
                del self.task_ids[task_id]
                self.failed.append(f"late publish {n}: {type(exc).__name__}: {exc}"[:300])
            else:
                self.spans.append((began, time.time()))

    @property
    def published(self) -> int:
        return len(self.spans)

    def figures(self, faults: list[dict[str, Any]]) -> dict[str, Any]:
        """How the late publishes met the faults: the slowest (a retry rode something out),
        and how many ran across a connection termination round or the restart (published
        from the second before it to the second after)."""
        near: Counter[str] = Counter()
        for fault in faults:
            if fault["kind"] in ("disconnect", "restart"):
                t = fault["t"]
                near[fault["kind"]] += sum(1 for b, e in self.spans if b - 1 <= t <= e + 1)
        slowest = max((e - b for b, e in self.spans), default=0.0)
        return {
            "published": self.published,
            "slowest_publish_seconds": round(slowest, 3),
            "published_within_a_second_of_a_termination_round": near["disconnect"],
            "published_within_a_second_of_the_restart": near["restart"],
        }


#: The share of tasks done by which every late task is published (the faults' last is made
#: by 0.9), and the pause before each of them.
LATE_UNTIL = 0.85
LATE_SPACING = 0.01


def drive(
    cfg: Config, chaos: Chaos, store: Any, before: int, started: float, late: LatePublisher
) -> str:
    """Make the planned faults as the tasks get done; until none is left and the late
    publisher is done, or the timeout."""
    schedule = plan(cfg)
    last_disconnect = time.monotonic()
    while time.monotonic() - started < cfg.timeout:
        time.sleep(0.25)
        chaos.tick()
        left = remaining(store)
        if left is None:
            continue
        if left == 0 and not schedule and not chaos.pending and not late.is_alive():
            return "drained"
        # The share done of what has been published so far (``before``: the tasks published
        # before the workers started).
        done = 1 - left / (before + late.published)
        late.allow(done)
        while schedule and schedule[0][0] <= done:
            kind = schedule[0][1]
            if not getattr(chaos, kind)():  # no worker free for it now: at the next look
                break
            schedule.pop(0)
        now = time.monotonic()
        if chaos.server is not None and now - last_disconnect >= cfg.disconnect_every:
            chaos.disconnect()
            last_disconnect = now
    return "timeout"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", choices=("pg", "pgbouncer", "sqlite"), default="pg")
    parser.add_argument("--short", action="store_true", help="what CI runs")
    parser.add_argument("--scale", type=int, default=1, help="10: 10,000 tasks")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--margin",
        type=float,
        default=0.5,
        help="seconds past the lease a cut-off task may take to learn LeaseLost (a shared "
        "machine's scheduling; the lease clock keeps its own margin inside the lease)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    args = parser.parse_args()
    cfg = config(args.db, args.short, args.scale)
    random.seed(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="sqlease-chaos-"))
    prefix = f"chaos{os.getpid()}_"
    chaos = Chaos(cfg.db, cfg.lease, prefix, tmp, sqlite_url=f"sqlite:///{tmp}/chaos.db")
    try:
        return run(cfg, chaos, args)
    finally:
        chaos.teardown()


def run(cfg: Config, chaos: Chaos, args: argparse.Namespace) -> int:
    url = chaos.setup()
    # The producer publishes directly (not through a worker's proxy) to the run's database.
    os.environ.update(
        CHAOS_URL=f"sqlease+{url}", CHAOS_PREFIX=chaos.prefix, CHAOS_LEASE=str(cfg.lease)
    )
    sys.path.insert(0, str(HERE))
    from sqlease import Store

    store = Store(url, table_prefix=chaos.prefix, max_attempts=8)
    task_ids = enqueue(cfg)
    total = len(task_ids) + cfg.late
    started = time.monotonic()
    for _ in range(cfg.workers):
        chaos.start_worker()
    late = LatePublisher(cfg, task_ids)
    late.start()
    try:
        outcome = drive(cfg, chaos, store, len(task_ids), started, late)
        seconds = time.monotonic() - started
    finally:
        late.stop()
        chaos.stop_all()
    late.join(timeout=60)
    from sqlease._db.engine import dispose_all

    dispose_all()
    db_figures, problems, claims, fenced = check_database(store, cfg.steps, task_ids)
    executions, torn = load_records(chaos.records)
    record_figures, record_problems = check_records(
        executions, chaos.faults, claims, fenced, cfg.lease, args.margin
    )
    problems += record_problems + late.failed
    if torn:
        problems.append(f"{torn} torn record lines")
    kinds = Counter(f["kind"] for f in chaos.faults)
    partitions = [f for f in chaos.faults if f["kind"] == "partition"]
    if any(f.get("held_bytes", 0) == 0 for f in partitions):
        problems.append("a partition held no write: nothing was cut off")
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "db": cfg.db,
        "tasks": total,
        "tasks_in_runs": cfg.runs * cfg.tasks_per_run,
        "tasks_alone": cfg.alone,
        "tasks_published_during_the_faults": late.published,
        "late_publishes": late.figures(chaos.faults),
        "outcome": outcome,
        "seconds": round(seconds, 1),
        "tasks_per_second": round(total / seconds, 1),
        "faults_survived": {
            "sigkills": kinds["kill"],
            "sigstops_past_the_lease": kinds["stall"],
            "partitions_of_one_worker": kinds["partition"],
            "connection_termination_rounds": kinds["disconnect"],
            "connections_terminated": chaos.terminated,
            "postgresql_restarts": kinds["restart"],
        },
        # Bytes the workers sent into each partition, delivered when it healed.
        "partition_held_bytes_delivered_at_heal": [f.get("held_bytes") for f in partitions],
        **db_figures,
        **record_figures,
        "lease_seconds": cfg.lease,
        "margin_seconds": args.margin,
        "config": asdict(cfg),
        "problems": problems[:30],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared with other work",
        "python": platform.python_version(),
        "commit": _commit(),
    }
    print(json.dumps(report, indent=2, default=str))
    # Beside the workers' log and the records, with every fault's times.
    (chaos.tmp / "report.json").write_text(
        json.dumps({**report, "faults": chaos.faults}, indent=2, default=str)
    )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    ok = outcome == "drained" and not problems and report["lost"] == 0
    print("CHAOS OK" if ok else f"CHAOS FAILED (logs in {chaos.tmp})")
    return 0 if ok else 1


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
    )
    return done.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
