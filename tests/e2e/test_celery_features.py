"""Celery features a worker uses beside plain delivery, through real workers on sqlease: time
limits, automatic retries, compression, consumers added and cancelled at run time, broadcast
queues, and the queues a worker reports."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import TimeLimitExceeded

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_time_limits_end_the_task_and_the_worker_goes_on(e2e: E2E) -> None:
    backend = e2e.broker
    e2e.start_worker(concurrency=1, E2E_BACKEND=backend)
    app = e2e.app(backend=backend)
    # Hard limit: the pool process is killed and replaced; the task fails, is acked (Celery's
    # acks_on_failure_or_timeout) and is not delivered again.
    killed = app.tasks["e2e.sleep"].apply_async((30,), time_limit=1)
    with pytest.raises(TimeLimitExceeded):
        killed.get(timeout=30)
    e2e.wait_acked(killed.id)
    assert e2e.kinds(killed.id).count("claimed") == 1
    # Soft limit: the task is told and finishes its own way.
    assert app.tasks["e2e.soft_limited"].delay(30).get(timeout=30) == "cleaned up"
    # The worker goes on serving.
    assert app.tasks["e2e.add"].delay(2, 3).get(timeout=30) == 5


@pytest.mark.timeout(120)
def test_a_time_limit_without_acks_on_timeout_runs_the_task_again(e2e: E2E) -> None:
    """Celery stores the hard time limit's FAILURE, then rejects the delivery with requeue:
    the task runs again (as on Redis and RabbitMQ, where it loops for ever), up to its
    max_attempts here, instead of being completed from the stored FAILURE as a delivery
    whose ack was lost is."""
    backend = e2e.broker
    e2e.start_worker(concurrency=1, E2E_BACKEND=backend)
    app = e2e.app(backend=backend)
    result = app.tasks["e2e.sleep_requeued"].apply_async((30,), time_limit=1)
    wait_for(lambda: "attempts_exhausted" in e2e.kinds(result.id), 60, "its attempts to run out")
    kinds = e2e.kinds(result.id)
    assert "completed_from_stored_outcome" not in kinds, kinds
    runs = len(e2e.executions(task_id=result.id))
    assert runs == kinds.count("released") == 3, kinds  # max_attempts (3) runs, each requeued
    assert result.state == "FAILURE"


@pytest.mark.timeout(120)
def test_autoretry_retries_then_fails_with_the_last_error(e2e: E2E) -> None:
    backend = e2e.broker
    e2e.start_worker(concurrency=1, E2E_BACKEND=backend)
    app = e2e.app(backend=backend)
    result = app.tasks["e2e.flaky"].delay()
    with pytest.raises(ValueError, match="failure number 3"):
        result.get(timeout=30)
    runs = e2e.finished(task_id=result.id)
    assert [r["label"] for r in runs] == ["0", "1", "2"]  # the first run and two retries
    # Each retry is a new message with the same task id; none is left behind.
    wait_for(lambda: e2e.store.size("celery") == 0, 10, "the queue to empty")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compression", ["gzip", "bzip2", "zlib"])
def test_compressed_messages(e2e: E2E, compression: str) -> None:
    backend = e2e.broker
    e2e.start_worker(concurrency=1, E2E_BACKEND=backend)
    app = e2e.app(backend=backend)
    result = app.tasks["e2e.add"].apply_async(
        (20, 22), {"label": "x" * 5000}, compression=compression
    )
    assert result.get(timeout=30) == 42
    [row] = e2e.finished(task_id=result.id)
    assert row["label"] == "x" * 5000


def _active_queues(app: Any, nodename: str) -> list[dict[str, Any]]:
    replies = app.control.inspect(destination=[nodename]).active_queues() or {}
    return list(replies.get(nodename, []))


@pytest.mark.timeout(120)
def test_consumers_added_and_cancelled_at_run_time(e2e: E2E) -> None:
    worker = e2e.start_worker(concurrency=1)
    app = e2e.app()
    add = app.tasks["e2e.add"]
    early = add.apply_async((1, 1), queue="extra")
    reply = app.control.add_consumer("extra", reply=True, destination=[worker.nodename])
    assert reply and "add consumer" in str(reply[0][worker.nodename]).lower()
    wait_for(lambda: e2e.finished(task_id=early.id), 30, "the task queued before the consumer")

    queues = app.control.inspect(destination=[worker.nodename]).active_queues()
    assert queues is not None
    assert {q["name"] for q in queues[worker.nodename]} == {"celery", "extra"}

    app.control.cancel_consumer("extra", reply=True, destination=[worker.nodename])
    # Celery replies before it cancels (the worker defers cancel_task_queue with call_soon),
    # on every broker: a message sent on the reply may still be consumed.
    wait_for(
        lambda: {q["name"] for q in _active_queues(app, worker.nodename)} == {"celery"},
        30,
        "the worker to stop consuming from extra",
    )
    late = add.apply_async((2, 2), queue="extra")
    marker = add.delay(3, 3)  # the default queue is still consumed
    wait_for(lambda: e2e.finished(task_id=marker.id), 30, "a task of the default queue")
    assert e2e.finished(task_id=late.id) == []
    assert e2e.store.size("extra") == 1  # kept for the next consumer of "extra"


@pytest.mark.timeout(120)
def test_a_broadcast_task_runs_once_on_every_worker(e2e: E2E) -> None:
    workers = [
        e2e.start_worker(concurrency=1, E2E_BROADCAST="everyone"),
        e2e.start_worker(concurrency=1, E2E_BROADCAST="everyone"),
    ]
    app = e2e.app(broadcast="everyone")
    sent = app.tasks["e2e.add"].apply_async((1, 1), queue="everyone")
    rows = wait_for(
        lambda: (r := e2e.finished(task_id=sent.id)) and len(r) == 2 and r,
        30,
        "a copy on each worker",
    )
    assert {r["hostname"] for r in rows} == {w.nodename for w in workers}
    # A task sent to the default queue still runs once, on one of them.
    once = app.tasks["e2e.add"].delay(2, 2)
    wait_for(lambda: e2e.finished(task_id=once.id), 30, "the plain task")
    assert len(e2e.finished(task_id=once.id)) == 1


@pytest.mark.timeout(120)
def test_worker_direct_queues_reach_the_one_worker_named(e2e: E2E) -> None:
    from celery.utils.nodenames import worker_direct

    workers = [e2e.start_worker(concurrency=1, E2E_WORKER_DIRECT="1") for _ in range(2)]
    app = e2e.app(worker_direct=True)
    add = app.tasks["e2e.add"]
    target = workers[1]
    sent = [add.apply_async((i, 0), queue=worker_direct(target.nodename)) for i in range(4)]
    for result in sent:
        wait_for(lambda r=result: e2e.finished(task_id=r.id), 30, "a direct task")
    assert {r["hostname"] for r in e2e.finished()} == {target.nodename}


@pytest.mark.timeout(120)
def test_inspect_shows_active_and_reserved_tasks(e2e: E2E, tmp_path: Path) -> None:
    worker = e2e.start_worker(concurrency=1, E2E_PREFETCH_MULTIPLIER=2)
    app = e2e.app()
    gate = tmp_path / "open"
    running = app.tasks["e2e.block"].delay(str(gate))
    waiting = app.tasks["e2e.add"].delay(1, 1)
    wait_for(lambda: e2e.executions(task_id=running.id), 30, "the blocking task to start")
    inspect = app.control.inspect(destination=[worker.nodename], timeout=5)
    active = wait_for(lambda: (a := inspect.active()) and a[worker.nodename] and a, 10, "active")
    assert [t["id"] for t in active[worker.nodename]] == [running.id]
    reserved = wait_for(
        lambda: (r := inspect.reserved()) and r[worker.nodename] and r, 10, "reserved"
    )
    assert [t["id"] for t in reserved[worker.nodename]] == [waiting.id]
    stats = inspect.stats()
    assert stats is not None and stats[worker.nodename]["broker"]["transport"] == "sqlease"
    gate.touch()
    wait_for(lambda: e2e.finished(task_id=waiting.id), 30, "the reserved task to run")


@pytest.mark.timeout(120)
def test_message_properties_and_delivery_info_reach_the_task(e2e: E2E) -> None:
    # Celery's integration suite: a property given to apply_async (app_id) reaches
    # self.request.properties, and delivery_info names the exchange, routing key and priority.
    backend = e2e.broker
    e2e.start_worker(concurrency=1, E2E_BACKEND=backend)
    app = e2e.app(backend=backend)
    seen = app.tasks["e2e.properties"].apply_async(app_id="1234", priority=7).get(timeout=30)
    assert seen["properties"]["app_id"] == "1234"
    assert seen["properties"]["priority"] == 7
    assert seen["delivery_info"]["routing_key"] == "celery"
    assert seen["delivery_info"]["priority"] == 7
    assert seen["delivery_info"]["redelivered"] is False


@pytest.mark.timeout(120)
def test_pool_processes_replaced_by_max_tasks_per_child_keep_serving(e2e: E2E) -> None:
    """``--max-tasks-per-child 2``: billiard forks a new pool process after every two tasks,
    while the main process holds its database connections (on SQLite, its checkpoint thread
    too). Every task runs once, in a fresh process whose result writes work, and nothing is
    left behind."""
    backend = e2e.broker
    e2e.start_worker(concurrency=2, E2E_BACKEND=backend, args=["--max-tasks-per-child", "2"])
    app = e2e.app(backend=backend)
    results = [app.tasks["e2e.add"].delay(i, 1000, label=f"m{i}") for i in range(16)]
    assert [r.get(timeout=60) for r in results] == [i + 1000 for i in range(16)]
    rows = wait_for(
        lambda: (r := e2e.finished(name="e2e.add")) and len(r) >= 16 and r, 30, "16 executions"
    )
    assert sorted(r["task_id"] for r in rows) == sorted(r.id for r in results)  # each once
    e2e.assert_first_starts(rows)
    per_process = Counter(r["pid"] for r in rows)
    assert max(per_process.values()) <= 2 and len(per_process) >= 8, per_process
    for result in results:
        e2e.wait_acked(result.id)
    wait_for(lambda: e2e.store.size("celery") == 0, 10, "the queue to empty")
