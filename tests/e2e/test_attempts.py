"""Attempts exhaustion through a real worker (guarantees.md, invariant 6): a task that kills
its own pool process every time is requeued by ``task_reject_on_worker_lost`` (a sqlease
default), delivered 3 times, then failed ``attempts_exhausted``; the worker keeps serving
other tasks."""

from __future__ import annotations

import time

import pytest

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_task_killing_its_worker_process_ends_attempts_exhausted(e2e: E2E) -> None:
    worker = e2e.start_worker(concurrency=2)
    app = e2e.app()
    add = app.tasks["e2e.add"]
    killer = app.tasks["e2e.kill_own_process"].delay()
    others = [add.delay(i, i) for i in range(3)]
    message_id = e2e.message_id(killer.id)

    def dead() -> bool:
        row = e2e.store.get_message(message_id)
        return row is not None and row.state == "dead"

    wait_for(dead, 60, "the task to be failed after its deliveries")
    others += [add.delay(i, i) for i in range(3)]  # sent meanwhile / after: still served
    wait_for(
        lambda: all(e2e.finished(task_id=r.id) for r in others), 30, "the other tasks to finish"
    )

    row = e2e.store.get_message(message_id)
    assert row is not None
    assert (row.state, row.reason) == ("dead", "attempts_exhausted"), row
    assert row.lease_owner is None and row.attempt == 3, row
    snapshot = e2e.admin.task(killer.id)
    assert (snapshot.state, snapshot.reason, snapshot.attempt) == (
        "failed",
        "attempts_exhausted",
        3,
    ), snapshot
    executions = e2e.executions(task_id=killer.id)
    assert [r["attempt"] for r in executions] == [1, 2, 3]
    assert all(r["ended"] is None for r in executions)  # killed every time
    assert len({r["pid"] for r in executions}) == 3  # a fresh pool process each time
    kinds = [(e.kind, e.attempt) for e in e2e.store.events(task_id=killer.id)]
    assert [attempt for kind, attempt in kinds if kind == "claimed"] == [1, 2, 3], kinds
    assert kinds[-1][0] == "attempts_exhausted", kinds
    assert "WorkerLostError" in worker.log()

    # nothing more happens to it, and the worker is still alive and serving
    time.sleep(1)
    assert len(e2e.executions(task_id=killer.id)) == 3
    assert worker.alive()
    last = add.delay(5, 5)
    wait_for(lambda: e2e.finished(task_id=last.id), 30, "a task sent at the end")
