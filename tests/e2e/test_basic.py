"""Tasks sent with ``.delay()`` run on real workers of every Celery pool (prefork, threads,
solo, gevent, eventlet), SQLite and PostgreSQL."""

from __future__ import annotations

import itertools
import statistics

import pytest

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["prefork", "threads", "solo", "gevent", "eventlet"])
def test_delay_runs_each_task_once(e2e: E2E, pool: str) -> None:
    backend = e2e.broker  # sqlease's result backend, in the broker's database
    worker = e2e.start_worker(pool=pool, concurrency=2, E2E_BACKEND=backend)
    app = e2e.app(backend=backend)
    add = app.tasks["e2e.add"]

    results = [add.delay(i, 100, label=f"t{i}") for i in range(12)]
    assert results[0].get(timeout=30) == 100  # a round trip through the result backend

    rows = wait_for(
        lambda: (r := e2e.finished(name="e2e.add")) and len(r) >= 12 and r,
        30,
        "12 executions",
    )
    assert sorted(r["task_id"] for r in rows) == sorted(r.id for r in results)
    e2e.assert_first_starts(rows)
    assert all(isinstance(r["message_id"], int) for r in rows)
    assert {r["hostname"] for r in rows} == {worker.nodename}
    pids = {r["pid"] for r in rows}
    if pool != "prefork":
        assert pids == {worker.pid}
    else:
        assert worker.pid not in pids
    assert [r.get(timeout=10) for r in results] == [i + 100 for i in range(12)]
    # every delivery was acknowledged: the messages left the table
    for r in results:
        e2e.wait_acked(r.id)
        assert e2e.kinds(r.id)[0] == "enqueued"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_green_pools_keep_the_leases_of_tasks_longer_than_a_lease(e2e: E2E, pool: str) -> None:
    """In a green pool the heartbeat is a green thread beside the tasks, and every database
    wait must yield to the others (psycopg's own wait blocked an eventlet worker at its first
    query): tasks sleeping for twice the lease keep it, and each runs once."""
    # A lease of 2 s, not less: on SQLite each statement blocks the process's every green
    # thread, the heartbeat's too, while it waits for the file.
    worker = e2e.start_worker(pool=pool, concurrency=8, E2E_LEASE_SECONDS=2)
    app = e2e.app()
    sleeps = [app.tasks["e2e.sleep"].delay(4.5, label=f"s{i}") for i in range(4)]
    adds = [app.tasks["e2e.add"].delay(i, i, label=f"a{i}") for i in range(20)]
    rows = wait_for(lambda: (r := e2e.finished()) and len(r) >= 24 and r, 60, "24 executions")
    assert sorted(r["task_id"] for r in rows) == sorted(r.id for r in sleeps + adds)
    e2e.assert_first_starts(rows)  # no lease was lost, nothing ran twice
    started = sorted(r["started"] for r in rows if r["name"] == "e2e.sleep")
    assert started[-1] - started[0] < 1.5  # the four slept side by side, not one by one
    for r in sleeps + adds:
        e2e.wait_acked(r.id)  # the ack is fenced: the lease held to the end
    assert "its lease is lost" not in worker.log()


@pytest.mark.timeout(120)
def test_backlog_is_not_paced_by_the_safety_poll(e2e: E2E, request: pytest.FixtureRequest) -> None:
    """A worker whose prefetch credit is used up (``-c 1``, prefetch multiplier 1, as advised
    for long tasks) starts the next task as soon as it acks the last one, not at the next
    safety poll (``polling_interval``, 1 s by default)."""
    app = e2e.app(polling_interval=1.0)
    for i in range(8):
        app.tasks["e2e.add"].delay(i, i)
    e2e.start_worker(concurrency=1, E2E_PREFETCH_MULTIPLIER=1, E2E_POLLING_INTERVAL=1.0)
    rows = wait_for(lambda: (r := e2e.finished()) and len(r) == 8 and r, 30, "the backlog")
    gaps = [b["started"] - a["ended"] for a, b in itertools.pairwise(rows)]
    # Paced by the poll, every gap is about 1 s; the median ignores one scheduling hiccup.
    assert statistics.median(gaps) < 0.4, [round(g, 3) for g in gaps]
