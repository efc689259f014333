"""The app of the connection-budget test (tests/e2e/test_connections.py): a broker and a
result backend on the same PostgreSQL URL (``CONN_URL``, which names the test's own
``application_name``), tables under ``CONN_PREFIX``."""

from __future__ import annotations

import os
import time

from celery import Celery

import sqlease  # noqa: F401  (registers the sqlease transport)


def make_app(url: str, prefix: str) -> Celery:
    app = Celery("conn", broker=f"sqlease+{url}", backend=f"sqlease+{url}", set_as_current=False)
    app.conf.update(
        broker_transport_options={"table_prefix": prefix, "lease_seconds": 10},
        result_backend_transport_options={"table_prefix": prefix},
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        enable_utc=True,
    )
    app.task(name="conn.work", shared=False)(_work)
    return app


def _work(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


if "CONN_URL" in os.environ:
    app = make_app(os.environ["CONN_URL"], os.environ["CONN_PREFIX"])
