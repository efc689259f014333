"""The Celery app that the end-to-end tests run under real ``celery worker`` processes.

A worker loads it with ``celery -A e2e_app worker`` (this folder on ``PYTHONPATH``) and reads
its configuration from the environment (``E2E_*`` below); the test process builds the same app
with :func:`make_app` to send tasks. Every task records each execution (task id, sqlease
attempt and message id, pid, start and end times …) as one row of an ``executions`` table in a
separate SQLite file, which the tests assert on."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from kombu import Queue
from kombu.common import Broadcast

import sqlease  # noqa: F401  (registers the sqlease transport, as the docs tell users)

try:
    from . import records
except ImportError:  # loaded by ``celery -A e2e_app`` from this folder
    import records  # type: ignore[no-redef]


def make_app(
    broker: str,
    *,
    prefix: str,
    lease_seconds: float = 10.0,
    polling_interval: float = 0.2,
    prefetch_multiplier: int = 4,
    backend: str | None = None,
    broadcast: str | None = None,
    worker_direct: bool = False,
    transport_options: dict[str, Any] | None = None,
    conf: dict[str, Any] | None = None,
) -> Celery:
    """The e2e app. Nothing about acknowledgement is configured: sqlease's defaults apply.
    The lease is 10 s unless a test is about leases: long enough that a loaded machine never
    lets a running task's lease lapse between heartbeats."""
    # shared=False below: the test process builds many apps, each with its own tasks.
    app = Celery("e2e", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        broker_transport_options={
            "lease_seconds": lease_seconds,
            "polling_interval": polling_interval,
            "table_prefix": prefix,
            **(transport_options or {}),
        },
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=prefetch_multiplier,
        worker_hijack_root_logger=True,
        task_routes={"e2e.route_a": {"queue": "a"}, "e2e.route_b": {"queue": "b"}},
        result_extended=backend is not None,
        enable_utc=True,
        worker_direct=worker_direct,
    )
    app.conf.update(conf or {})  # a test's own Celery settings (E2E_CONF, JSON)
    if broadcast:  # the default queue plus a broadcast one: every worker gets a copy
        app.conf.task_queues = (Queue("celery"), Broadcast(broadcast))

    @app.task(name="e2e.add", bind=True, shared=False)
    def add(self: Any, x: int, y: int, label: str | None = None) -> int:
        row = records.start(self, label)
        records.end(row)
        return x + y

    @app.task(name="e2e.sleep", bind=True, shared=False)
    def sleep(self: Any, seconds: float, label: str | None = None) -> float:
        row = records.start(self, label)
        time.sleep(seconds)
        records.end(row)
        return seconds

    @app.task(name="e2e.sleep_requeued", bind=True, shared=False, acks_on_failure_or_timeout=False)
    def sleep_requeued(self: Any, seconds: float, label: str | None = None) -> float:
        # Celery rejects it with requeue when it hits its hard time limit.
        row = records.start(self, label)
        time.sleep(seconds)
        records.end(row)
        return seconds

    @app.task(
        name="e2e.tenant_sleep",
        bind=True,
        shared=False,
        concurrency_key="tenant:{tenant}",
        concurrency_limit=1,
    )
    def tenant_sleep(self: Any, tenant: str, seconds: float, label: str | None = None) -> None:
        row = records.start(self, label or tenant)
        time.sleep(seconds)
        records.end(row)

    @app.task(name="e2e.report", bind=True, shared=False, unique_key="report:{user}")
    def report(self: Any, user: str, seconds: float = 0.0) -> str:
        row = records.start(self, user)
        time.sleep(seconds)
        records.end(row)
        return f"report for {user} by {self.request.id}"

    @app.task(name="e2e.rated", bind=True, shared=False, rate_limit="5/s")
    def rated(self: Any) -> None:
        records.end(records.start(self, None))

    @app.task(name="e2e.block", bind=True, shared=False)
    def block(self: Any, path: str, limit: float = 60.0) -> None:
        """Runs until the file ``path`` exists (the test says when), at most ``limit`` s."""
        row = records.start(self, None)
        deadline = time.monotonic() + limit
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        records.end(row)

    @app.task(name="e2e.retry_always", bind=True, shared=False)
    def retry_always(self: Any, countdown: float, max_retries: int) -> None:
        row = records.start(self, None)
        records.end(row)
        raise self.retry(countdown=countdown, max_retries=max_retries)

    @app.task(name="e2e.kill_own_process", bind=True, shared=False)
    def kill_own_process(self: Any) -> None:
        records.start(self, None)
        os.kill(os.getpid(), signal.SIGKILL)

    @app.task(name="e2e.soft_limited", bind=True, shared=False, soft_time_limit=0.5)
    def soft_limited(self: Any, seconds: float) -> str:
        row = records.start(self, None)
        try:
            time.sleep(seconds)
            outcome = "finished"
        except SoftTimeLimitExceeded:
            outcome = "cleaned up"
        records.end(row)
        return outcome

    @app.task(
        name="e2e.flaky",
        bind=True,
        shared=False,
        autoretry_for=(ValueError,),
        max_retries=2,
        default_retry_delay=0,
    )
    def flaky(self: Any) -> None:
        records.end(records.start(self, str(self.request.retries)))
        raise ValueError(f"failure number {self.request.retries + 1}")

    @app.task(name="e2e.properties", bind=True, shared=False)
    def properties(self: Any) -> dict[str, Any]:
        records.end(records.start(self, None))
        info = self.request.delivery_info or {}
        return {
            "properties": {
                k: v
                for k, v in (self.request.properties or {}).items()
                if isinstance(v, str | int | float | bool)
            },
            "delivery_info": {
                k: info.get(k) for k in ("exchange", "routing_key", "priority", "redelivered")
            },
        }

    @app.task(name="e2e.route_a", bind=True, shared=False)
    def route_a(self: Any) -> None:
        records.end(records.start(self, "a"))

    @app.task(name="e2e.route_b", bind=True, shared=False)
    def route_b(self: Any) -> None:
        records.end(records.start(self, "b"))

    return app


def _from_env() -> Celery:
    env = os.environ
    if "E2E_BROKER" not in env:  # imported by the test process: it calls make_app itself
        return Celery("e2e", set_as_current=False)
    return make_app(
        env["E2E_BROKER"],
        prefix=env["E2E_PREFIX"],
        lease_seconds=float(env.get("E2E_LEASE_SECONDS", "10")),
        polling_interval=float(env.get("E2E_POLLING_INTERVAL", "0.2")),
        prefetch_multiplier=int(env.get("E2E_PREFETCH_MULTIPLIER", "4")),
        backend=env.get("E2E_BACKEND") or None,
        broadcast=env.get("E2E_BROADCAST") or None,
        worker_direct=env.get("E2E_WORKER_DIRECT") == "1",
        transport_options=json.loads(env.get("E2E_TRANSPORT_OPTIONS") or "{}"),
        conf=json.loads(env.get("E2E_CONF") or "{}"),
    )


app = _from_env()
