"""``eta``/``countdown`` and ``self.retry(countdown=…)`` become ``available_at`` in SQL: the
task reaches a worker when due, no lease is held while it waits, nothing runs twice (with a
lease far shorter than the wait)."""

from __future__ import annotations

import itertools
import time

import pytest

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow

LEASE = 1.0


@pytest.mark.timeout(120)
def test_countdown_runs_once_when_due_without_a_lease_while_waiting(e2e: E2E) -> None:
    e2e.start_worker(concurrency=2, E2E_LEASE_SECONDS=LEASE)
    app = e2e.app(lease_seconds=LEASE)
    sent_at = time.time()
    result = app.tasks["e2e.add"].apply_async((1, 2), countdown=3)
    message_id = e2e.message_id(result.id)

    samples = 0
    while time.time() < sent_at + 2.6:
        row = e2e.store.get_message(message_id)
        assert row is not None
        assert row.state == "ready" and row.attempt == 0, row
        assert row.lease_owner is None and row.lease_expires_at_ms is None, row
        assert abs(row.available_at_ms / 1000.0 - (sent_at + 3)) < 0.5, row
        assert not e2e.executions(task_id=result.id)
        assert e2e.admin.task(result.id).state == "scheduled"
        samples += 1
        time.sleep(0.2)
    assert samples >= 5

    rows = wait_for(lambda: e2e.finished(task_id=result.id), 15, "the task to run when due")
    assert rows[0]["started"] >= sent_at + 3 - 0.05
    assert rows[0]["started"] < sent_at + 3 + 3  # promptly when due
    assert rows[0]["attempt"] == 1
    time.sleep(3 * LEASE)  # several lease periods: no second delivery
    assert len(e2e.executions(task_id=result.id)) == 1
    kinds = [e.kind for e in e2e.store.events(task_id=result.id)]
    assert kinds.count("claimed") == 1 and kinds.count("acked") == 1, kinds


@pytest.mark.timeout(120)
def test_retry_with_countdown_runs_max_retries_plus_one_times_then_ends(e2e: E2E) -> None:
    e2e.start_worker(concurrency=2, E2E_LEASE_SECONDS=LEASE)
    app = e2e.app(lease_seconds=LEASE)
    result = app.tasks["e2e.retry_always"].delay(1.0, 2)  # self.retry(countdown=1, max_retries=2)

    wait_for(lambda: len(e2e.finished(task_id=result.id)) == 3, 30, "three executions")
    time.sleep(1.0 + 2 * LEASE)  # a 4th would have come by now
    rows = e2e.executions(task_id=result.id)
    assert [r["retries"] for r in rows] == [0, 1, 2]
    # every retry is a fresh message, delivered once, not before its countdown
    assert [r["attempt"] for r in rows] == [1, 1, 1]
    assert len({r["message_id"] for r in rows}) == 3
    for before, after in itertools.pairwise(rows):
        assert after["started"] - before["ended"] >= 1.0 - 0.05, (before, after)
        assert after["started"] - before["ended"] < 1.0 + 3
    events = e2e.store.events(task_id=result.id)
    for message_id in {r["message_id"] for r in rows}:
        kinds = [e.kind for e in events if e.message_id == message_id]
        assert kinds == ["enqueued", "claimed", "acked"], kinds


@pytest.mark.timeout(120)
def test_inspect_scheduled_lists_the_eta_tasks_waiting_in_the_database(e2e: E2E) -> None:
    """As Celery's own integration test expects (t/integration/test_inspect.py): the worker
    holds no ETA task in memory, so the answer comes from the rows it will claim."""
    from datetime import UTC, datetime, timedelta
    from unittest.mock import ANY

    worker = e2e.start_worker()
    app = e2e.app()
    node = worker.nodename
    exec_time = datetime.now(UTC) + timedelta(seconds=30)
    result = app.tasks["e2e.add"].apply_async([1, 2], {"label": "z"}, eta=exec_time)
    other = app.tasks["e2e.add"].apply_async([3, 4], queue="elsewhere", countdown=30)
    reply = app.control.inspect([node], timeout=5).scheduled()
    assert reply == {
        node: [
            {
                "eta": exec_time.strftime("%Y-%m-%dT%H:%M:%S.%f") + "+00:00",
                "priority": 6,
                "request": {
                    "id": result.id,
                    "name": "e2e.add",
                    "args": [1, 2],
                    "kwargs": {"label": "z"},
                    "type": "e2e.add",
                    "hostname": ANY,
                    "time_start": None,
                    "acknowledged": False,
                    "delivery_info": {
                        "exchange": "",
                        "routing_key": "celery",
                        "priority": 0,
                        "redelivered": False,
                    },
                    "worker_pid": None,
                },
            }
        ]
    }, reply  # not the task on a queue this worker does not consume
    assert other.id not in str(reply)
    result.revoke()
    other.revoke()
