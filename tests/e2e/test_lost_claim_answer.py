"""A real worker whose claim committed while its answer was lost (the connection cut between
the commit and the reply) delivers what that claim leased at once, on the claim's retry,
instead of after a lease with a delivery more spent (sqlease.transport._unheard).

The worker reaches PostgreSQL through a TCP proxy that lets the first claim statement through
and drops its answer with the connection. Ten tasks wait when the worker starts; the lease is
60 s. Every task runs once, within seconds: those the lost claim had leased were released
(attempt refunded) and claimed again, and none was failed or waited for its lease."""

from __future__ import annotations

import time

import pytest

from .apps.partition_app import make_app
from .conftest import E2E
from .tcp_proxy import StallingProxy

pytestmark = [pytest.mark.timeout(90)]

LEASE = 60.0


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_claim_whose_answer_was_lost_delivers_its_tasks_without_waiting_a_lease(
    e2e: E2E,
) -> None:
    proxy = StallingProxy.to(e2e.db_url)
    try:
        app = make_app(e2e.broker, prefix=e2e.prefix, lease_seconds=LEASE)
        e2e._apps.append(app)
        sent = [app.tasks["part.add"].delay(i, i) for i in range(10)]
        proxy.lose_answer(b"claimed AS (UPDATE")
        started = time.monotonic()
        worker = e2e.start_worker(
            app="partition_app",
            concurrency=2,
            E2E_BROKER="sqlease+" + proxy.through(e2e.db_url),
            E2E_LEASE_SECONDS=LEASE,
        )
        assert [r.get(timeout=30) for r in sent] == [2 * i for i in range(10)]
        assert time.monotonic() - started < LEASE / 2  # no task waited out its lease
        assert proxy.answers_lost == 1
        released = 0
        for result in sent:
            kinds = [(e.kind, e.attempt) for e in e2e.store.events(task_id=result.id)]
            runs = [k for k in kinds if k[0] == "acked"]
            assert len(runs) == 1, kinds
            if ("released", 1) in kinds:  # leased by the lost claim
                released += 1
                assert kinds[1:] == [("claimed", 1), ("released", 1), ("claimed", 2), runs[0]]
            else:
                assert [k for k, _ in kinds] == ["enqueued", "claimed", "acked"], kinds
        assert released >= 1
        log = worker.log()
        assert "leased by a claim whose answer was lost released" in log, log[-3000:]
    finally:
        proxy.close()
