"""The app of the partition and failover end-to-end tests: tasks that record, in the
executions file (a local SQLite file, outside the partition), when each of their database
calls returned and when they learned that their lease was lost."""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from typing import Any

from celery import Celery

import sqlease

TIMELINE = """
CREATE TABLE IF NOT EXISTS timeline (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL, attempt INTEGER, host TEXT, kind TEXT NOT NULL,
    at REAL NOT NULL, detail TEXT
)
"""


def record(task_id: str, attempt: int | None, kind: str, detail: str = "") -> None:
    """One row, stamped with the wall clock (the machine's: the test compares it with the
    database's timeline and with the moment it cut the network)."""
    at = time.time()
    conn = sqlite3.connect(os.environ["E2E_RECORDS"], timeout=30, isolation_level=None)
    try:
        conn.execute(TIMELINE)
        conn.execute(
            "INSERT INTO timeline (task_id, attempt, host, kind, at, detail) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (task_id, attempt, os.environ.get("E2E_HOST", socket.gethostname()), kind, at, detail),
        )
    finally:
        conn.close()


def make_app(
    broker: str,
    *,
    prefix: str,
    lease_seconds: float = 3.0,
    interrupt: bool = False,
    lease_sync: bool = False,
) -> Celery:
    app = Celery("part", broker=broker, backend=broker, set_as_current=False)
    app.conf.update(
        broker_transport_options={
            "lease_seconds": lease_seconds,
            "polling_interval": 0.2,
            "table_prefix": prefix,
            # Every task, not only those that opt in (the failover test).
            **({"interrupt_on_lease_lost": True} if interrupt else {}),
            # Claims that wait for the flush (and a synchronous standby): the failover test.
            **({"lease_sync_commit": True} if lease_sync else {}),
        },
        worker_prefetch_multiplier=1,
        result_extended=True,
    )

    @app.task(name="part.work", bind=True, shared=False)
    def work(self: Any, steps: int, every: float) -> dict[str, Any]:
        """Checkpoints every ``every`` seconds, from where the last delivery got to."""
        ctx = sqlease.context()
        step = int(ctx.state.get("step", 0))
        record(ctx.task_id, ctx.attempt, "start", str(step))
        try:
            while step < steps:
                time.sleep(every)
                step += 1
                ctx.checkpoint({"step": step})
                record(ctx.task_id, ctx.attempt, "checkpoint", str(step))
        except sqlease.LeaseLost as exc:
            record(ctx.task_id, ctx.attempt, "lease_lost", str(exc))
            raise
        record(ctx.task_id, ctx.attempt, "done", str(step))
        return {"steps": step, "attempt": ctx.attempt, "host": os.environ.get("E2E_HOST")}

    @app.task(name="part.block", bind=True, shared=False, interrupt_on_lease_lost=True)
    def block(self: Any, seconds: float) -> dict[str, Any]:
        """Never checkpoints: one long blocking call, which only the interruption cuts short."""
        info = self.request.properties["delivery_info"]
        attempt = int(info["sqlease_attempt"])
        record(self.request.id, attempt, "start")
        try:
            time.sleep(seconds)
        except sqlease.LeaseLost as exc:
            record(self.request.id, attempt, "interrupted", str(exc))
            raise
        record(self.request.id, attempt, "done")
        return {"attempt": attempt, "host": os.environ.get("E2E_HOST")}

    @app.task(name="part.add", bind=True, shared=False)
    def add(self: Any, x: int, y: int) -> int:
        attempt = int(self.request.properties["delivery_info"]["sqlease_attempt"])
        record(self.request.id, attempt, "done")
        return x + y

    @app.task(name="part.quiet", bind=True, shared=False, ignore_result=True)
    def quiet(self: Any, seconds: float) -> None:
        """Stores no result: its ack follows its end at once, with no write of its own
        before it (the outage test ends it as the database goes away)."""
        attempt = int(self.request.properties["delivery_info"]["sqlease_attempt"])
        record(self.request.id, attempt, "start")
        time.sleep(seconds)
        record(self.request.id, attempt, "done")

    @app.task(name="part.hello", shared=False)
    def hello() -> str | None:
        return os.environ.get("E2E_HOST")

    return app


def _from_env() -> Celery:
    env = os.environ
    if "E2E_BROKER" not in env:  # imported by the test process: it calls make_app itself
        return Celery("part", set_as_current=False)
    return make_app(
        env["E2E_BROKER"],
        prefix=env["E2E_PREFIX"],
        lease_seconds=float(env.get("E2E_LEASE_SECONDS", "3.0")),
        interrupt=env.get("E2E_INTERRUPT") == "1",
        lease_sync=env.get("E2E_LEASE_SYNC") == "1",
    )


app = _from_env()
