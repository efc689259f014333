"""PostgreSQL failover under real workers and publishers (docs/howto/postgresql.md, "High
availability").

The test starts its own primary and streaming standby (throwaway clusters on their own ports,
tests/e2e/pg_clusters.py) and runs a worker and a publisher on a multi-host URL
(``host=a,b&port=p,q&target_session_attrs=read-write``). While tasks are published as fast as
one thread can and two long tasks run, it kills the primary (``immediate``: every connection
drops) and promotes the standby once a lease has passed (a failover slower than the lease, so
that the leases taken on the old primary run out). Then:

- the worker and the publisher go on against the new primary without a restart;
- synchronous replication: no task whose ``delay()`` returned is lost, each runs, and no result
  a caller got is lost; asynchronous: the publishes lost are counted (the window is printed,
  ``-s``, and the docs quote it);
- the long tasks' leases, taken on the old primary and replicated, come back by expiry: each
  runs again, and never two deliveries at once (the first is interrupted by its lease clock,
  ``interrupt_on_lease_lost``, before its lease can end on the database).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from .apps.partition_app import make_app
from .conftest import E2E, wait_for
from .pg_clusters import Clusters, bindir

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(bindir() is None, reason="no PostgreSQL server programs to start"),
]

LEASE = 3.0


@pytest.fixture(params=["synchronous", "asynchronous"])
def clusters(request: pytest.FixtureRequest) -> Iterator[Clusters]:
    found = Clusters(synchronous=request.param == "synchronous")
    try:
        found.start()
        yield found
    finally:
        found.stop()


@pytest.fixture
def db_url(clusters: Clusters) -> str:
    """The e2e harness's database: the clusters' multi-host URL."""
    return clusters.url()


def rows(e2e: E2E) -> list[dict[str, Any]]:
    conn = sqlite3.connect(str(e2e.records_path), timeout=30)
    conn.row_factory = sqlite3.Row
    try:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'timeline'").fetchone():
            return []
        return [dict(r) for r in conn.execute("SELECT * FROM timeline ORDER BY id")]
    finally:
        conn.close()


class Publisher(threading.Thread):
    """Publishes ``part.add`` as fast as it can; remembers each task whose ``delay()``
    returned (confirmed to the caller), and when."""

    def __init__(self, app: Any) -> None:
        super().__init__(daemon=True)
        self.app = app
        self.confirmed: list[tuple[str, float]] = []
        self.errors: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        task = self.app.tasks["part.add"]
        i = 0
        while not self.stopping.is_set():
            i += 1
            try:
                result = task.delay(i, i)
            except Exception as exc:  # not confirmed: the caller knows it may be lost
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            self.confirmed.append((result.id, time.time()))


def test_workers_and_publishers_ride_out_a_failover(e2e: E2E, clusters: Clusters) -> None:
    app = make_app(e2e.broker, prefix=e2e.prefix, lease_seconds=LEASE)
    e2e._apps.append(app)
    # Claims wait for the standby as publishes do (lease_sync_commit): a claim lost with the
    # primary could otherwise be made again by this worker under the same fence while the
    # first delivery runs (docs/howto/postgresql.md, "A lost claim and the same worker").
    worker = e2e.start_worker(
        app="partition_app", concurrency=3, E2E_HOST="W", E2E_INTERRUPT="1", E2E_LEASE_SYNC="1"
    )
    # Results a caller got before the failover.
    before = [app.tasks["part.add"].delay(100 + i, 1) for i in range(5)]
    got = {r.id: r.get(timeout=30) for r in before}
    blocks = [app.tasks["part.block"].delay(5.0) for _ in range(2)]
    for block in blocks:
        wait_for(lambda b=block: any(r["task_id"] == b.id for r in rows(e2e)), 30, "a block")
    publisher = Publisher(app)
    publisher.start()
    time.sleep(1.0)

    clusters.crash_primary()
    crashed = time.time()  # the primary is gone: what it had not sent its standby is lost
    # The failover's detection and decision take longer than a lease (Patroni's ttl is 30 s):
    # the worker cannot renew meanwhile, and its leases run out.
    time.sleep(LEASE + 1.5)
    clusters.promote_standby()
    promoted = time.time()
    time.sleep(1.0)
    publisher.stopping.set()
    publisher.join(60)
    after_promotion = [t for t, at in publisher.confirmed if at > promoted]
    assert after_promotion, f"the publisher did not go on: {publisher.errors[-3:]}"

    confirmed = {task_id for task_id, _ in publisher.confirmed}
    done = lambda: {r["task_id"] for r in rows(e2e) if r["kind"] == "done"}  # noqa: E731
    if clusters.synchronous:
        wait_for(lambda: confirmed <= done(), 60, "every confirmed task to run")
        lost: set[str] = set()
    else:
        # Wait for the rest to settle; what is neither run nor in the database was lost.
        wait_for(lambda: not e2e.store.size("celery"), 60, "the queue to drain")
        time.sleep(LEASE + 1)
        lost = {t for t in confirmed - done() if e2e.store.get_task(t) is None}
        ran = confirmed - lost
        wait_for(lambda: ran <= done(), 60, "every surviving task to run")
    # Results a caller got before the failover are still there (synchronous: always).
    kept = {task_id: app.AsyncResult(task_id).get(timeout=10) for task_id in got}
    if clusters.synchronous:
        assert kept == got

    # The long tasks: leased on the old primary, their leases came back by expiry; the first
    # delivery stopped (its lease clock) before the second started. Asynchronous
    # replication can lose a claim, and then the same fence twice: only the synchronous
    # case promises no overlap.
    for block in blocks:
        assert block.get(timeout=60)["attempt"] >= 2
        mine = [r for r in rows(e2e) if r["task_id"] == block.id]
        starts = {r["attempt"]: r["at"] for r in mine if r["kind"] == "start"}
        stops = {r["attempt"]: r["at"] for r in mine if r["kind"] in ("interrupted", "done")}
        for attempt, stopped in stops.items() if clusters.synchronous else ():
            later = [at for a, at in starts.items() if a > attempt]
            assert all(stopped < at for at in later), mine
    assert worker.alive() and "Unrecoverable error" not in worker.log()
    window = [crashed - at for task_id, at in publisher.confirmed if task_id in lost]
    resumed = min(at for _, at in publisher.confirmed if at > promoted) - promoted
    mode = "synchronous" if clusters.synchronous else "asynchronous"
    print(
        f"\nfailover ({mode}): {len(confirmed)} publishes confirmed, {len(lost)} lost"
        + (
            f" (confirmed {min(window):.3f}-{max(window):.3f} s before the primary was gone)"
            if window
            else ""
        )
        + f"; {len(after_promotion)} confirmed after the promotion, the first {resumed:.2f} s"
        f" after it; results kept {sum(kept[t] == got[t] for t in got)} of {len(got)}"
    )
