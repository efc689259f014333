"""Celery's own in-process test worker (``celery.contrib.testing.worker.start_worker``, what
``celery.contrib.pytest``'s ``celery_worker`` fixtures use) runs on sqlease as on any broker:
solo and threads pools, the ping check, results through sqlease's backend, a retry, and a
clean stop that leaves nothing leased."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from conftest import unique_prefix
from sqlease import Store

pytestmark = pytest.mark.timeout(60)


def _app(db_url: str, prefix: str) -> Celery:
    url = "sqlease+" + db_url
    app = Celery("inprocess", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        broker_transport_options={"table_prefix": prefix, "polling_interval": 0.05},
        result_backend_transport_options={"table_prefix": prefix},
    )
    app.loader.import_task_module("celery.contrib.testing.tasks")  # celery.ping

    @app.task(name="inprocess.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="inprocess.retry_once", bind=True, shared=False, max_retries=3)
    def retry_once(self: Any) -> int:
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        return self.request.retries

    return app


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_celerys_test_worker_runs_tasks_on_sqlease(db_url: str, pool: str) -> None:
    prefix = unique_prefix()
    app = _app(db_url, prefix)
    add, retry_once = app.tasks["inprocess.add"], app.tasks["inprocess.retry_once"]
    with start_worker(app, pool=pool, concurrency=2, perform_ping_check=True, shutdown_timeout=10):
        assert add.delay(2, 2).get(timeout=10) == 4
        results = [add.delay(i, i) for i in range(10)]
        assert [r.get(timeout=10) for r in results] == [2 * i for i in range(10)]
        assert retry_once.delay().get(timeout=10) == 1
    store = Store(db_url, table_prefix=prefix)
    assert store.size("celery") == 0
    table = store.tables.messages
    with store.engine.connect() as conn:
        left = conn.execute(table.select().where(table.c.queue == "celery")).fetchall()
    assert left == []  # acked: nothing leased or parked behind the stopped worker
    app.close()
