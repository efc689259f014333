"""A database outage shorter than the lease, longer than the store's own retries, under a
running task (reliability.md, "The database drops connections or restarts").

Worker A reaches PostgreSQL through a TCP proxy that closes every connection and refuses new
ones for 24 s (a server restarting, or failing over), where the store retries an operation
for 20 s and the lease is 45 s. A runs two tasks: one sleeps 30 s (``interrupt_on_lease_lost``:
a lost lease would cut it short), the other checkpoints every 0.5 s for 30 s. A connection
error that reached Celery would make it restart its consumer, which gives back what the
channels hold, the running tasks included: they would lose their leases and run again; and a
checkpoint that gave up after the store's 20 s would fail its task. Instead:

- each task runs once, to its end, on its first delivery: no second claim, no ``LeaseLost``,
  its result is A's; the checkpoint sent during the outage waited for the database (within
  its lease) and went through;
- A's consumer never restarted (no "Connection to broker lost"), and A logged the outage;
- a task published during the outage runs on A once the database is back.

Worker B, through a proxy of its own whose outage lasts 30 s, runs one task that stores no
result and ends as the database goes away: its ack, retried through the outage, is B's only
lease. Were Celery to reconnect, the reconnect would drop the unwritten ack and the message
would come back at the lease's expiry to run again. Instead B holds the error back for it
(it logs the outage, never "Connection to broker lost"), and the ack is written once the
database is back: the task ran once.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from .apps.partition_app import make_app
from .conftest import E2E, wait_for
from .tcp_proxy import StallingProxy
from .test_partition import first, timeline

pytestmark = [pytest.mark.timeout(150)]

LEASE = 45.0
OUTAGE = 24.0
#: B's: longer than the store's 20 s of retries after B's ack first fails (the ack then
#: reaches the transport's outage gate), shorter than the lease.
B_OUTAGE = 30.0


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_running_task_keeps_its_lease_through_an_outage_shorter_than_the_lease(
    e2e: E2E,
) -> None:
    proxy = StallingProxy.to(e2e.db_url)
    b_proxy = StallingProxy.to(e2e.db_url)
    try:
        app = make_app(e2e.broker, prefix=e2e.prefix, lease_seconds=LEASE)
        e2e._apps.append(app)
        a = e2e.start_worker(
            app="partition_app",
            concurrency=2,
            E2E_BROKER="sqlease+" + proxy.through(e2e.db_url),
            E2E_HOST="A",
            E2E_LEASE_SECONDS=LEASE,
        )
        b = e2e.start_worker(
            app="partition_app",
            queues="quiet",
            E2E_BROKER="sqlease+" + b_proxy.through(e2e.db_url),
            E2E_HOST="B",
            E2E_LEASE_SECONDS=LEASE,
        )
        block = app.tasks["part.block"].delay(30.0)
        work = app.tasks["part.work"].delay(60, 0.5)
        wait_for(lambda: first(timeline(e2e, block.id), kind="start"), 30, "the sleep's start")
        wait_for(lambda: first(timeline(e2e, work.id), kind="checkpoint"), 30, "a checkpoint")
        quiet = app.tasks["part.quiet"].apply_async((1.0,), queue="quiet")
        wait_for(lambda: first(timeline(e2e, quiet.id), kind="start"), 30, "the quiet start")

        proxy.down()
        b_proxy.down()
        went_down = time.time()
        b_up = threading.Timer(B_OUTAGE, b_proxy.up)  # while A's checks below go on
        b_up.start()
        time.sleep(OUTAGE / 2)
        during = app.tasks["part.add"].delay(2, 3)  # published directly, meanwhile
        time.sleep(max(0.0, went_down + OUTAGE - time.time()))
        proxy.up()
        assert first(timeline(e2e, quiet.id), kind="done"), "B's task ended in its outage"

        assert block.get(timeout=60) == {"attempt": 1, "host": "A"}
        assert work.get(timeout=60) == {"steps": 60, "attempt": 1, "host": "A"}
        assert during.get(timeout=30) == 5
        assert [r["kind"] for r in timeline(e2e, block.id)] == ["start", "done"]
        steps = [r for r in timeline(e2e, work.id) if r["kind"] == "checkpoint"]
        assert [int(r["detail"]) for r in steps] == list(range(1, 61))
        # The checkpoint sent into the outage returned once the database was back.
        waited = max(b["at"] - a["at"] for a, b in itertools.pairwise(steps))
        assert waited > OUTAGE / 2, waited
        for task in (block, work):
            kinds = [e.kind for e in e2e.store.events(task_id=task.id)]
            assert kinds.count("claimed") == 1 and "released" not in kinds, kinds
            assert "lease_lost" not in kinds, kinds
        log = a.log()
        assert "the database cannot be reached" in log
        assert "Connection to broker lost" not in log, log[-3000:]
        assert a.alive()

        b_up.join()
        wait_for(
            lambda: "acked" in [e.kind for e in e2e.store.events(task_id=quiet.id)],
            15,
            "B's ack, once its database is back",
        )
        kinds = [e.kind for e in e2e.store.events(task_id=quiet.id)]
        assert kinds.count("claimed") == 1 and "released" not in kinds, kinds
        assert [(r["kind"], r["attempt"]) for r in timeline(e2e, quiet.id)] == [
            ("start", 1),
            ("done", 1),
        ]
        b_log = b.log()
        assert "1 delivery held here can still hold" in b_log, b_log[-3000:]
        assert "Connection to broker lost" not in b_log, b_log[-3000:]
        assert b.alive()
    finally:
        proxy.close()
        b_proxy.close()
