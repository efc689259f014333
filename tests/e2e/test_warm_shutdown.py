"""Warm shutdown releases the worker's unstarted leases at once (guarantees.md, invariant
8): the prefetched tasks of a worker stopped with SIGTERM go back unleased when it exits, and
another worker runs them straight away instead of waiting for their leases to expire."""

from __future__ import annotations

import signal
import time

import pytest

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow

LEASE = 20.0  # far longer than the test waits: anything left leased would stall it


@pytest.mark.timeout(120)
def test_warm_shutdown_releases_prefetched_leases(e2e: E2E) -> None:
    first = e2e.start_worker(concurrency=1, E2E_LEASE_SECONDS=LEASE, E2E_PREFETCH_MULTIPLIER=4)
    app = e2e.app(lease_seconds=LEASE)
    release = e2e.tmp / "release"
    running = app.tasks["e2e.block"].delay(str(release))
    wait_for(lambda: e2e.executions(task_id=running.id), 30, "the first task to start")
    prefetched = [app.tasks["e2e.add"].delay(i, i) for i in range(3)]
    ids = [e2e.message_id(r.id) for r in prefetched]

    def leased_to_first() -> bool:
        rows = [e2e.store.get_message(i) for i in ids]
        return all(r is not None and r.lease_owner is not None for r in rows)

    wait_for(leased_to_first, 15, "the worker to prefetch (lease) the other three")
    assert e2e.executions() == e2e.executions(task_id=running.id)  # they have not started

    first.proc.send_signal(signal.SIGTERM)
    first.wait_log("Warm shutdown", 10)
    release.touch()  # let the running task finish: warm shutdown waits for it
    assert first.warm_shutdown(30) == 0
    exited_at = time.time()

    assert len(e2e.finished(task_id=running.id)) == 1
    assert "acked" in [e.kind for e in e2e.store.events(task_id=running.id)]
    for message_id, result in zip(ids, prefetched, strict=True):
        row = e2e.store.get_message(message_id)
        assert row is not None and row.state == "ready", row
        assert row.lease_owner is None and row.lease_expires_at_ms is None, row
        events = e2e.store.events(task_id=result.id)
        assert [e.kind for e in events] == ["enqueued", "claimed", "released"], events
        assert events[-1].data == {"delay_ms": 0, "refund": True}, events  # never started
    assert e2e.executions() == e2e.executions(task_id=running.id)

    second = e2e.start_worker(concurrency=1, E2E_LEASE_SECONDS=LEASE)
    rows = wait_for(
        lambda: (
            (r := [x for p in prefetched for x in e2e.finished(task_id=p.id)]) and len(r) == 3 and r
        ),
        15,
        "the released tasks to run on the second worker",
    )
    assert {r["hostname"] for r in rows} == {second.nodename}
    assert max(r["started"] for r in rows) - exited_at < LEASE / 2
    assert {r["attempt"] for r in rows} == {2}


@pytest.mark.timeout(120)
def test_warm_shutdown_gives_the_maintenance_lock_up(e2e: E2E) -> None:
    """The worker that runs the maintenance passes gives the lock up as it stops, so the
    next worker's pass runs at once instead of after the lock's lease (twice the interval)."""
    from sqlalchemy import select

    from sqlease._core.maintenance import LOCK_NAME

    locks = e2e.store.tables.locks

    def holder() -> str | None:
        with e2e.store.engine.connect() as conn:
            owner: str | None = conn.execute(
                select(locks.c.owner).where(locks.c.name == LOCK_NAME)
            ).scalar()
            return owner

    opts = '{"maintenance_interval": 2}'  # an expired lock stays as a row until taken over
    first = e2e.start_worker(concurrency=1, E2E_TRANSPORT_OPTIONS=opts)
    held = wait_for(holder, 30, "the worker's first maintenance pass")
    assert first.warm_shutdown(30) == 0
    assert holder() is None, held
