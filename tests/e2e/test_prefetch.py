"""Prefetch with real prefork workers: a worker with an idle pool process claims at once, however
many tasks it holds; with Celery's ``worker_disable_prefetch`` a worker holds no more tasks than
its pool can run, and the rest wait in the database for any other worker."""

from __future__ import annotations

import time

import pytest

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_a_worker_with_an_idle_process_claims_beside_its_long_tasks(e2e: E2E) -> None:
    """``worker_prefetch_multiplier = 1`` with 8 processes (prefetch 8), the advice for long
    tasks: five long tasks running leave three processes idle, and three more tasks start
    on them at once rather than when a long one ends."""
    e2e.start_worker(concurrency=8, E2E_PREFETCH_MULTIPLIER=1)
    app = e2e.app()
    release = e2e.tmp / "release"
    long = [app.tasks["e2e.block"].delay(str(release)) for _ in range(5)]
    wait_for(lambda: len(e2e.executions(name="e2e.block")) == 5, 30, "five long tasks to start")
    short = [app.tasks["e2e.add"].delay(i, i) for i in range(3)]
    try:
        wait_for(
            lambda: len(e2e.finished(name="e2e.add")) == 3,
            10,
            "the three short tasks to run beside the five long ones",
        )
        assert not e2e.finished(name="e2e.block")  # the long ones still run
    finally:
        release.touch()
    wait_for(lambda: len(e2e.finished()) == 8, 30, "every task to finish")
    assert {r["task_id"] for r in e2e.finished()} == {r.id for r in long + short}
    assert {r["attempt"] for r in e2e.finished()} == {1}


@pytest.mark.timeout(120)
def test_disable_prefetch_holds_no_more_than_the_pool_runs(e2e: E2E) -> None:
    """``worker_disable_prefetch`` (Celery's ``--disable-prefetch``, which Celery applies to
    Redis only): a worker with 2 processes and the default multiplier (prefetch 8) leases two
    of six long tasks; a second worker started later takes two of the four left waiting in
    the database, instead of finding them all leased to the first."""
    release = e2e.tmp / "release"
    first = e2e.start_worker(concurrency=2, args=["--disable-prefetch"])
    app = e2e.app()
    results = [app.tasks["e2e.block"].delay(str(release)) for _ in range(6)]
    ids = [e2e.message_id(r.id) for r in results]

    def leased() -> list[str]:
        rows = [e2e.store.get_message(i) for i in ids]
        return sorted(r.lease_owner for r in rows if r is not None and r.lease_owner)

    try:
        wait_for(lambda: len(e2e.executions(name="e2e.block")) == 2, 30, "two tasks to start")
        wait_for(lambda: len(leased()) == 2, 5, "two leases")
        for _ in range(10):  # and it takes no more while its two run
            assert len(leased()) == 2, leased()
            time.sleep(0.1)
        second = e2e.start_worker(concurrency=2, args=["--disable-prefetch"])
        wait_for(lambda: len(e2e.executions(name="e2e.block")) == 4, 30, "the second worker")
        hosts = [r["hostname"] for r in e2e.executions(name="e2e.block")]
        assert hosts.count(first.nodename) == 2 and hosts.count(second.nodename) == 2, hosts
        assert len(leased()) == 4
    finally:
        release.touch()
    wait_for(lambda: len(e2e.finished()) == 6, 60, "every task to finish")
    assert {r["attempt"] for r in e2e.finished()} == {1}
    log = first.log()
    assert "only supported for Redis" not in log, log[-3000:]
    assert "sqlease: worker_disable_prefetch" in log, log[-3000:]


@pytest.mark.timeout(120)
def test_disable_prefetch_with_autoscale_holds_the_autoscalers_most(e2e: E2E) -> None:
    """With ``--autoscale 3,1`` the limit is the autoscaler's most, as Celery has it: the
    worker holds three of five long tasks, and the autoscaler grows the pool to run them."""
    release = e2e.tmp / "release"
    worker = e2e.start_worker(args=["--autoscale", "3,1", "--disable-prefetch"])
    app = e2e.app()
    results = [app.tasks["e2e.block"].delay(str(release)) for _ in range(5)]
    ids = [e2e.message_id(r.id) for r in results]
    try:
        wait_for(lambda: len(e2e.executions(name="e2e.block")) == 3, 30, "three to start")
        time.sleep(1.0)
        rows = [e2e.store.get_message(i) for i in ids]
        assert sum(1 for r in rows if r is not None and r.lease_owner) == 3, rows
        assert len(e2e.executions(name="e2e.block")) == 3
    finally:
        release.touch()
    wait_for(lambda: len(e2e.finished()) == 5, 60, "every task to finish")
    assert "holds no more tasks than its pool runs (3)" in worker.log()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_green_worker_out_of_credit_claims_as_its_tasks_end(e2e: E2E, pool: str) -> None:
    """The gevent and eventlet pools have no event loop: the worker waits for work in the
    transport, and what frees its prefetch credit (an ack) sends no notification. With a
    safety poll of 30 s, 40 short tasks on 2 green threads with a multiplier of 1 (a prefetch
    of 2) all finish at once, not two per poll."""
    e2e.start_worker(pool=pool, concurrency=2, E2E_PREFETCH_MULTIPLIER=1, E2E_POLLING_INTERVAL=30)
    app = e2e.app(polling_interval=30.0)
    results = [app.tasks["e2e.add"].delay(i, i) for i in range(40)]
    wait_for(lambda: len(e2e.finished()) == 40, 20, "the 40 tasks to finish")
    assert {r["task_id"] for r in e2e.finished()} == {r.id for r in results}
