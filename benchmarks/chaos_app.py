"""The Celery app of benchmarks/chaos.py: tasks that checkpoint several times under their lease
and record every side effect through fenced writes (checkpoints, timeline events, the result).

Each execution also writes what it did, and when, to a local file outside the database (so
outside any partition): one JSON line per record, one file per process (``CHAOS_RECORDS``),
appended with one ``write`` each, so a SIGKILL loses nothing already written. A record carries
the wall clock before the call it reports (``t0``) and after it returned (``t``): the checks
compare these bounds with the faults' times and with each other (benchmarks/chaos_check.py)."""

from __future__ import annotations

import json
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

_records: Any = None


def record(task_id: str, attempt: int, run_id: str | None, kind: str, **more: Any) -> None:
    global _records
    folder = os.environ.get("CHAOS_RECORDS")
    if not folder:
        return
    if _records is None:  # one file per process: appends never interleave
        _records = open(  # noqa: SIM115 - kept open for the process's life
            os.path.join(folder, f"{os.getpid()}.jsonl"), "a", buffering=1
        )
    line = {
        "task": task_id,
        "attempt": attempt,
        "run": run_id,
        "worker": os.environ.get("CHAOS_WORKER", ""),
        "kind": kind,
        "t": time.time(),
        **more,
    }
    _records.write(json.dumps(line) + "\n")


@app.task(name="chaos.work", bind=True)
def work(
    self: Any, run_id: str | None, seq: int, steps: int, step_seconds: float, poison: bool = False
) -> dict[str, Any]:
    ctx = sqlease.context()
    if poison:
        os.kill(os.getpid(), signal.SIGKILL)  # dies on every delivery
    task_id, attempt = ctx.task_id, ctx.attempt

    def rec(kind: str, **more: Any) -> None:
        record(task_id, attempt, run_id, kind, **more)

    rec("begin")  # before any call to the database: this execution has started
    try:
        start = int(ctx.state.get("i", 0))
        t0 = time.time()
        ctx.event("exec_start", {"run": run_id, "seq": seq, "from": start})
        rec("start", t0=t0, value=start)
        for i in range(start, steps):
            time.sleep(step_seconds)
            t0 = time.time()
            ctx.checkpoint({"i": i + 1})
            rec("checkpoint", t0=t0, value=i + 1)
        t0 = time.time()
        ctx.event("exec_end", {"run": run_id, "seq": seq})
        rec("end", t0=t0)
    except sqlease.LeaseLost as exc:
        # When the lease clock (or the database) told this execution it no longer holds its
        # lease: the checks compare it with the moment the worker was cut off.
        rec("lease_lost", detail=str(exc)[:160])
        raise
    return {"run": run_id, "seq": seq, "i": steps, "attempt": attempt}
