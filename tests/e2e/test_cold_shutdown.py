"""Celery's cold shutdown (``SIGQUIT``, or a second Ctrl+C) and its soft shutdown
(``worker_soft_shutdown_timeout``) on sqlease: the running tasks Celery cancels and the
prefetched ones go back at once, fenced and with the attempt refunded, as on a broker that
requeues a closed channel's unacked messages; another worker runs them without waiting for
their leases to lapse. A task that finishes within the soft shutdown's window is acked."""

from __future__ import annotations

import json
import signal
import time

import pytest

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow

LEASE = 20.0  # far longer than the test waits: anything left leased would stall it


def _given_back(e2e: E2E, task_id: str) -> None:
    row = e2e.store.get_message(e2e.message_id(task_id))
    assert row is not None and row.state == "ready", row
    assert row.lease_owner is None and row.lease_expires_at_ms is None, row
    events = e2e.store.events(task_id=task_id)
    assert [e.kind for e in events] == ["enqueued", "claimed", "released"], events
    assert events[-1].data == {"delay_ms": 0, "refund": True}, events


@pytest.mark.timeout(120)
def test_cold_shutdown_gives_running_and_prefetched_tasks_back_at_once(e2e: E2E) -> None:
    first = e2e.start_worker(concurrency=1, E2E_LEASE_SECONDS=LEASE)
    app = e2e.app(lease_seconds=LEASE)
    release = e2e.tmp / "release"
    running = app.tasks["e2e.block"].delay(str(release))
    wait_for(lambda: e2e.executions(task_id=running.id), 30, "the first task to start")
    prefetched = [app.tasks["e2e.add"].delay(i, i) for i in range(2)]
    ids = [e2e.message_id(r.id) for r in prefetched]
    wait_for(
        lambda: all((m := e2e.store.get_message(i)) and m.lease_owner for i in ids),
        15,
        "the worker to prefetch (lease) the other two",
    )

    first.proc.send_signal(signal.SIGQUIT)
    assert first.proc.wait(30) == 0
    exited_at = time.time()
    assert "Cold shutdown" in first.log()
    # Celery terminated the running task: it never finished, and its delivery came back.
    assert [r["ended"] for r in e2e.executions(task_id=running.id)] == [None]
    for result in (running, *prefetched):
        _given_back(e2e, result.id)

    release.touch()  # the next run of the blocking task returns at once
    second = e2e.start_worker(concurrency=1, E2E_LEASE_SECONDS=LEASE)
    for result in (running, *prefetched):
        rows = wait_for(lambda r=result: e2e.finished(task_id=r.id), 15, "a rerun")
        assert [(r["hostname"], r["attempt"]) for r in rows] == [(second.nodename, 2)]
        assert rows[0]["started"] - exited_at < LEASE / 2  # not a lease's expiry
        e2e.wait_acked(result.id)


@pytest.mark.timeout(120)
def test_soft_shutdown_acks_what_finishes_in_its_window_and_gives_the_rest_back(
    e2e: E2E,
) -> None:
    """During the soft shutdown's window Celery's main process sleeps in its signal handler.
    The leases (shorter than the window here) hold: the heartbeat runs in its own thread, and
    on SQLite the handler waits for the main thread to leave its transaction, whose write lock
    it would otherwise hold through the window (the heartbeat could not renew, and a second
    worker took the finished task over). The task that finishes in the window is acked; the
    one still running is given back as the worker closes, and runs on the other worker."""
    lease = 2.0
    conf = json.dumps({"worker_soft_shutdown_timeout": 8})
    first = e2e.start_worker(concurrency=2, E2E_LEASE_SECONDS=lease, E2E_CONF=conf)
    app = e2e.app(lease_seconds=lease)
    release = e2e.tmp / "release"
    blocked = app.tasks["e2e.block"].delay(str(release))
    short = app.tasks["e2e.sleep"].delay(3.0)  # ends inside the window
    wait_for(
        lambda: e2e.executions(task_id=blocked.id) and e2e.executions(task_id=short.id),
        30,
        "both tasks to start",
    )
    first.proc.send_signal(signal.SIGQUIT)
    first.wait_log("Initiating Soft Shutdown", 10)
    # A second worker on the same queue, within the window: it would take over any lease
    # that lapsed (the window is four leases long).
    second = e2e.start_worker(concurrency=1, E2E_LEASE_SECONDS=lease)

    assert first.proc.wait(30) == 0
    log = first.log()
    assert "Cold shutdown" in log
    assert "lease lost" not in log and "not sent" not in log, log

    assert [r["ended"] is not None for r in e2e.executions(task_id=short.id)] == [True]
    assert e2e.kinds(short.id) == ["enqueued", "claimed", "acked"]

    release.touch()
    rows = wait_for(lambda: e2e.finished(task_id=blocked.id), 15, "the cancelled task's rerun")
    assert [(r["hostname"], r["attempt"]) for r in rows] == [(second.nodename, 2)]
    e2e.wait_acked(blocked.id)
    events = e2e.store.events(task_id=blocked.id)
    # Held through the window, then given back at once: released before the rerun's claim.
    assert [e.kind for e in events] == ["enqueued", "claimed", "released", "claimed", "acked"]
    assert events[2].data == {"delay_ms": 0, "refund": True}, events
