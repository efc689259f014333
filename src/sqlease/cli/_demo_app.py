"""The Celery app that ``python -m sqlease demo`` runs (``celery -A sqlease.cli._demo_app
worker``)."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

import sqlease

URL = os.environ.get("SQLEASE_DEMO_URL", "sqlease://")

app = Celery("sqlease_demo", broker=URL, backend=URL)
app.conf.broker_transport_options = {"lease_seconds": 3.0, "polling_interval": 0.5}
app.conf.worker_prefetch_multiplier = 1
app.conf.worker_hijack_root_logger = False


@app.task(bind=True)
def import_catalog(self: Any, pages: int, seconds_per_page: float = 0.3) -> dict[str, int]:
    ctx = sqlease.context()
    page = int(ctx.state.get("page", 0))  # 0 on the first delivery, the checkpoint after
    resumed_from = page
    while page < pages:
        time.sleep(seconds_per_page)  # fetch and import one page
        page += 1
        ctx.checkpoint({"page": page}, progress=(page, pages))
    return {"pages": page, "resumed_from": resumed_from, "attempt": ctx.attempt}
