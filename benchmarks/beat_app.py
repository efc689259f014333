"""The Celery app the beats of benchmarks/beat_bench.py run (this folder on ``PYTHONPATH``).

``BEAT_BENCH_ENTRIES`` entries ``e00000``, ``e00001``, … on ``crontab()`` (every minute), each
sending ``bench.noop`` with its own name as the only argument (so that a baseline fire, which
carries no slot, can be traced to its entry). No worker runs: only the sending is measured.

The environment: ``BEAT_BENCH_BROKER`` (``sqlease+…`` or ``redis://…``), ``BEAT_BENCH_PREFIX``
(sqlease's ``table_prefix``), ``BEAT_BENCH_ENTRIES``, ``BEAT_BENCH_STAMP`` (``1``: every
published message gets a header ``bench_sent_at``, the epoch seconds of its publish, for the
baseline whose messages carry no time of their own).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from celery.schedules import crontab
from celery.signals import before_task_publish

import sqlease  # noqa: F401  (registers the transport)

BROKER = os.environ["BEAT_BENCH_BROKER"]
ENTRIES = int(os.environ.get("BEAT_BENCH_ENTRIES", "10000"))

app = Celery("beat_bench")
app.conf.broker_url = BROKER
if BROKER.startswith("sqlease"):
    app.conf.broker_transport_options = {"table_prefix": os.environ["BEAT_BENCH_PREFIX"]}
app.conf.result_backend = None
app.conf.result_expires = None  # no celery.backend_cleanup entry
app.conf.beat_schedule = {
    f"e{i:05d}": {"task": "bench.noop", "schedule": crontab(), "args": (f"e{i:05d}",)}
    for i in range(ENTRIES)
}


@app.task(name="bench.noop", ignore_result=True)
def noop(name: str) -> None:
    return None


if os.environ.get("BEAT_BENCH_STAMP") == "1":

    @before_task_publish.connect
    def _stamp(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers is not None:
            headers["bench_sent_at"] = time.time()
