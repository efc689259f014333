"""The Celery app that real workers run behind PgBouncer (this folder on PYTHONPATH):
broker and results through the pooler URL in ``POOLER_URL``, tables under ``POOLER_PREFIX``."""

from __future__ import annotations

import os
import time

from celery import Celery

import sqlease  # noqa: F401  (registers the transport)


def _add(x: int, y: int) -> int:
    return x + y


def _total(values: list[int]) -> int:
    return sum(values)


def _slow(self: object, seconds: float) -> dict[str, object]:
    started = time.time()
    time.sleep(seconds)
    properties = getattr(self.request, "properties", None) or {}  # type: ignore[attr-defined]
    info = properties.get("delivery_info") or {}
    return {"attempt": info.get("sqlease_attempt"), "pid": os.getpid(), "started": started}


def make_app(url: str, prefix: str, *, lease_seconds: float = 2.0) -> Celery:
    app = Celery("pooler_app", set_as_current=False)
    app.conf.broker_url = f"sqlease+{url}"
    app.conf.result_backend = f"sqlease+{url}"
    app.conf.broker_transport_options = {
        "table_prefix": prefix,
        "lease_seconds": lease_seconds,
        "polling_interval": 0.2,
    }
    app.conf.result_backend_transport_options = {"table_prefix": prefix}
    app.conf.worker_prefetch_multiplier = 4

    app.task(name="pooler.add")(_add)
    app.task(name="pooler.total")(_total)
    app.task(name="pooler.slow", bind=True)(_slow)
    return app


if "POOLER_URL" in os.environ:
    app = make_app(
        os.environ["POOLER_URL"],
        os.environ["POOLER_PREFIX"],
        lease_seconds=float(os.environ.get("POOLER_LEASE", "2")),
    )
