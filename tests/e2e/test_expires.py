"""Message expiry is honoured: a task whose ``expires`` passed while no worker ran is never
executed; the worker acknowledges it (revoked) and moves on."""

from __future__ import annotations

import time

import pytest

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_expired_task_never_runs(e2e: E2E) -> None:
    app = e2e.app()
    add = app.tasks["e2e.add"]
    expired = add.apply_async((1, 1), expires=1)
    sentinel = add.delay(2, 2)  # queued behind it: once it has run, the expired one was seen
    time.sleep(2)

    worker = e2e.start_worker(concurrency=1, E2E_PREFETCH_MULTIPLIER=1)
    wait_for(lambda: e2e.finished(task_id=sentinel.id), 30, "the task queued after it")
    assert e2e.executions(task_id=expired.id) == []
    assert [r["task_id"] for r in e2e.executions()] == [sentinel.id]
    # delivered, recognised as expired, acknowledged: gone for good, not retried later
    kinds = [e.kind for e in e2e.store.events(task_id=expired.id)]
    assert kinds == ["enqueued", "claimed", "acked"], kinds
    worker.wait_log(f"Discarding revoked task: e2e.add[{expired.id}]", 10)
