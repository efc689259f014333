"""A Celery app as a user would write it for Redis or RabbitMQ, with only the broker URL
changed to sqlease: no ``import sqlease``, no ``task_acks_late`` or
``task_reject_on_worker_lost``. The short lease keeps the test fast; it is not about
acknowledgement. Loaded by ``celery -A durable_app worker`` with this folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

try:
    from . import records
except ImportError:  # loaded by ``celery -A durable_app`` from this folder
    import records  # type: ignore[no-redef]

app = Celery("durable", broker=os.environ.get("E2E_BROKER", "memory://"), set_as_current=False)
app.conf.broker_transport_options = {
    "lease_seconds": float(os.environ.get("E2E_LEASE_SECONDS", "2")),
    "polling_interval": 0.2,
    "table_prefix": os.environ.get("E2E_PREFIX", "sqlease_"),
}


@app.task(name="durable.slow", bind=True)
def slow(self: Any, seconds: float) -> float:
    row = records.start(self, None)
    time.sleep(seconds)
    records.end(row)
    return seconds
