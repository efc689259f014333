"""End-to-end harness: real ``celery worker`` subprocesses on a sqlease broker.

Each test gets an :class:`E2E` (fixture ``e2e``) bound to its database (``db_url``: SQLite and
PostgreSQL), a fresh table prefix and its own executions file. ``e2e.start_worker(...)`` runs
``python -m celery -A <app> worker`` in a new session (so the worker and its pool children are
one process group that can be killed at once), logs to a file, and waits for ``ready``. Every
worker is killed when the test ends, whatever happened; when a test fails, its workers' logs
are attached to the report.
"""

from __future__ import annotations

import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from sqlease import Store
from sqlease._celery import registry
from sqlease._db.engine import dispose_all
from sqlease._db.postgresql import listener as listener_module
from sqlease.admin import Admin

from .apps.e2e_app import make_app
from .apps.records import connect_records, init_records

APPS = Path(__file__).parent / "apps"
READY_TIMEOUT = 30.0
LOG_TAIL = 20_000  # characters of each worker log attached to a failure report

_prefixes = itertools.count()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """Poll until ``predicate()`` is truthy and return its value; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


@dataclass
class Worker:
    """One ``celery worker`` process (the leader of its own process group)."""

    name: str
    nodename: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while f"{self.nodename} ready." not in self.log():
            if not self.alive():
                pytest.fail(f"worker {self.name} exited with {self.proc.returncode} before ready")
            if time.monotonic() > deadline:
                pytest.fail(f"worker {self.name} not ready after {timeout}s")
            time.sleep(0.05)

    def wait_log(self, text: str, timeout: float) -> None:
        wait_for(lambda: text in self.log(), timeout, f"{text!r} in the log of {self.name}")

    def warm_shutdown(self, timeout: float = 30.0) -> int:
        """SIGTERM to the main process (Celery's warm shutdown); returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"worker {self.name} did not finish its warm shutdown in {timeout}s")

    def kill(self) -> None:
        """SIGKILL the whole process group: the main process and its pool children at once."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            pass


@dataclass
class E2E:
    """Everything one end-to-end test needs: workers, a sending app, the store, records."""

    db_url: str
    prefix: str
    tmp: Path
    workers: list[Worker] = field(default_factory=list)
    _apps: list[Celery] = field(default_factory=list)
    _store: Store | None = None

    @property
    def broker(self) -> str:
        return f"sqlease+{self.db_url}"

    @property
    def records_path(self) -> Path:
        return self.tmp / "executions.db"

    @property
    def is_postgresql(self) -> bool:
        return self.db_url.startswith("postgresql")

    # ---- processes ---------------------------------------------------------------------

    def env(self, **overrides: Any) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTEST_CURRENT_TEST", None)
        env.update(
            E2E_BROKER=self.broker,
            E2E_PREFIX=self.prefix,
            E2E_RECORDS=str(self.records_path),
            PYTHONPATH=os.pathsep.join([str(APPS), *filter(None, [env.get("PYTHONPATH")])]),
            PYTHONUNBUFFERED="1",
        )
        env.update({k: str(v) for k, v in overrides.items()})
        return env

    def stall(self, worker: Worker, attempts: int = 40) -> None:
        """SIGSTOP ``worker``'s process group. On SQLite a process stopped inside a write
        transaction keeps the file's only write lock until it resumes, and no other worker
        could take over (docs/howto/sqlite.md, "Limits and behaviour"): such a stop is undone
        and tried again a moment later, so the test stalls the worker between transactions."""
        for _ in range(attempts):
            os.killpg(worker.pid, signal.SIGSTOP)
            time.sleep(0.05)  # the signal has landed
            if self.is_postgresql or self._sqlite_writable():
                return
            os.killpg(worker.pid, signal.SIGCONT)
            time.sleep(0.03)
        raise AssertionError(f"{worker.nodename} held the SQLite write lock at every stop")

    def _sqlite_writable(self) -> bool:
        path = self.db_url.split("sqlite:///", 1)[1]
        conn = sqlite3.connect(path, timeout=0.2, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            conn.close()

    def start_worker(
        self,
        *,
        app: str = "e2e_app",
        pool: str = "prefork",
        concurrency: int = 1,
        queues: str | None = None,
        events: bool = False,
        wait: bool = True,
        args: Sequence[str] = (),
        **env: Any,
    ) -> Worker:
        """Start ``celery -A app worker``; ``env`` sets ``E2E_*`` variables, e.g.
        ``E2E_LEASE_SECONDS=1``, ``E2E_PREFETCH_MULTIPLIER=1``; ``args`` are more of the
        worker's command-line options."""
        name = f"w{len(self.workers) + 1}-{uuid.uuid4().hex[:6]}"
        nodename = f"{name}@e2e"
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            "-l",
            "info",
            "--pool",
            pool,
            "-c",
            str(concurrency),
            "-n",
            nodename,
            "--without-mingle",
            "--without-gossip",
        ]
        if queues:
            command += ["-Q", queues]
        if events:
            command.append("-E")
        command += list(args)
        log_path = self.tmp / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                command,
                env=self.env(**env),
                cwd=self.tmp,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = Worker(name, nodename, proc, log_path)
        self.workers.append(worker)
        if wait:
            worker.wait_ready()
        return worker

    def celery(self, *args: str, timeout: float = 60.0, **env: Any) -> str:
        """Run a ``celery -A e2e_app …`` command to completion; returns its output."""
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "e2e_app", *args],
            env=self.env(**env),
            cwd=self.tmp,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        output = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        assert done.returncode == 0, f"celery {' '.join(args)} exited {done.returncode}:\n{output}"
        return output

    # ---- the test process's side ---------------------------------------------------------

    def app(self, **kwargs: Any) -> Celery:
        """The e2e app in the test process (to send tasks, inspect, control, read events)."""
        app = make_app(self.broker, prefix=self.prefix, **kwargs)
        self._apps.append(app)
        return app

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = Store(self.db_url, table_prefix=self.prefix)
        return self._store

    @property
    def admin(self) -> Admin:
        return Admin(self.broker, table_prefix=self.prefix, store=self.store)

    def executions(self, **where: Any) -> list[dict[str, Any]]:
        """Rows of the executions table (filtered by equality), in insertion order."""
        conn = connect_records(str(self.records_path))
        conn.row_factory = sqlite3.Row
        try:
            clause = " AND ".join(f"{k} = ?" for k in where) or "1"
            rows = conn.execute(
                f"SELECT * FROM executions WHERE {clause} ORDER BY id", tuple(where.values())
            ).fetchall()
        finally:
            conn.close()
        return [dict(r) for r in rows]

    def finished(self, **where: Any) -> list[dict[str, Any]]:
        return [r for r in self.executions(**where) if r["ended"] is not None]

    def kinds(self, task_id: str) -> list[str]:
        """The kinds of a task's timeline events, in order."""
        return [e.kind for e in self.store.events(task_id=task_id)]

    def assert_first_starts(self, rows: list[dict[str, Any]]) -> None:
        """Each execution in ``rows`` is its task's first start: attempt 1, or a later
        attempt whose every earlier delivery was given back unstarted (released with its
        attempt refunded: a handoff that reached a worker out of prefetch credit, a claim
        that brought more than the credit). A lost lease or a second run fails it."""
        for row in rows:
            if row["attempt"] == 1:
                continue
            events = self.store.events(task_id=row["task_id"])
            refunded = [e for e in events if e.kind == "released" and (e.data or {}).get("refund")]
            timeline = [(e.kind, e.attempt, e.data) for e in events]
            assert len(refunded) == row["attempt"] - 1, (row, timeline)

    def wait_acked(self, task_id: str, timeout: float = 15.0) -> None:
        """Wait for the ack, which the worker's main process sends after the task body (and
        its execution record) finished."""
        wait_for(lambda: "acked" in self.kinds(task_id), timeout, f"the ack of {task_id}")

    def message_id(self, task_id: str) -> int:
        """The sqlease message id of a task's (first) message, from its timeline."""
        for event in self.store.events(task_id=task_id):
            if event.message_id is not None:
                return event.message_id
        raise AssertionError(f"no message recorded for task {task_id}")

    # ---- teardown ----------------------------------------------------------------------

    def logs(self) -> list[tuple[str, str]]:
        return [(f"{w.name} (pid {w.pid})", w.log()[-LOG_TAIL:]) for w in self.workers]

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        for app in self._apps:
            app.close()
        release_connections(self.prefix)


def release_connections(prefix: str) -> None:
    """Close what this process kept open for a test's tables: the stores Celery's apps
    registered for them (each with its LISTEN connections) and the pooled connections. A
    process keeps its stores and pools for its life; a test process runs dozens of tests, each
    with tables and leases of its own, and the server's 100 connections ran out."""
    with registry._stores_lock:
        gone = [key for key in registry._stores if key[1] == prefix]
        for key in gone:
            del registry._stores[key]
    for listener in list(listener_module._listeners):
        if listener._channel.startswith(prefix):
            listener.close()
    dispose_all(close=True)


@pytest.fixture
def e2e(db_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[E2E]:
    prefix = f"e{os.getpid()}_{next(_prefixes)}_"
    env = E2E(db_url=db_url, prefix=prefix, tmp=tmp_path)
    init_records(str(env.records_path))
    request.node._e2e = env
    try:
        yield env
    finally:
        env.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    env = getattr(item, "_e2e", None)
    if env is not None and report.failed:
        for title, text in env.logs():
            report.sections.append((f"worker log {title}", text))
    return report
