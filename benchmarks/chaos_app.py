"""The Celery app of benchmarks/chaos.py: tasks that checkpoint several times under their lease
and record every side effect through fenced writes (checkpoints, timeline events, the result)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from celery import Celery

import sqlease

URL = os.environ.get("CHAOS_URL", "sqlease://")
app = Celery("chaos", broker=URL, backend=URL)
app.conf.update(
    broker_transport_options={
        "lease_seconds": float(os.environ.get("CHAOS_LEASE", "2")),
        "polling_interval": 0.5,
        "max_attempts": int(os.environ.get("CHAOS_MAX_ATTEMPTS", "8")),
        "table_prefix": os.environ.get("CHAOS_PREFIX", "sqlease_"),
    },
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    result_backend_always_retry=True,
    result_backend_max_retries=20,
)


@app.task(name="chaos.work", bind=True)
def work(
    self: Any, run_id: str, seq: int, steps: int, step_seconds: float, poison: bool = False
) -> dict[str, Any]:
    ctx = sqlease.context()
    if poison:
        os.kill(os.getpid(), signal.SIGKILL)  # dies on every delivery
    start = int(ctx.state.get("i", 0))
    ctx.event("exec_start", {"run": run_id, "seq": seq, "from": start})
    for i in range(start, steps):
        time.sleep(step_seconds)
        ctx.checkpoint({"i": i + 1})
    ctx.event("exec_end", {"run": run_id, "seq": seq})
    return {"run": run_id, "seq": seq, "i": steps, "attempt": ctx.attempt}
