"""What real ``celery inspect`` calls and an event receiver leave behind (both databases):
their reply and event queues are recorded with an idle expiry (Kombu declares them
auto_delete / x-expires), the maintenance pass removes them, with their bindings, once
idle for longer than it, and keeps the worker's own remote-control queue, which its
consumer touches."""

from __future__ import annotations

import contextlib

import pytest
from sqlalchemy import select

from sqlease._core.maintenance import run_pass

from .conftest import E2E


@pytest.mark.timeout(120)
def test_the_queues_of_inspect_calls_expire_and_the_workers_stays(e2e: E2E) -> None:
    worker = e2e.start_worker()
    node = worker.nodename
    app = e2e.app()
    for _ in range(3):
        assert app.control.inspect([node], timeout=5).ping() == {node: {"ok": "pong"}}
    with app.connection_for_read() as conn:  # an event receiver comes and goes
        receiver = app.events.Receiver(conn, handlers={"*": lambda event: None})
        with contextlib.suppress(TimeoutError):
            receiver.capture(limit=1, timeout=1)
    store = e2e.store
    q = store.tables.queues

    def queues() -> dict[str, int | None]:
        with store.driver.reading() as conn:
            rows = conn.execute(select(q.c.name, q.c.expires_ms)).fetchall()
        return {row.name: row.expires_ms for row in rows}

    found = queues()
    replies = [name for name in found if name.endswith(".reply.celery.pidbox")]
    events = [name for name in found if name.startswith("celeryev.")]
    pidbox = f"{node}.celery.pidbox"
    # Kombu deletes an inspect call's reply queue when the call ends (one killed midway
    # leaves it); an event receiver's queue stays behind.
    assert events and pidbox in found, found
    assert all(found[name] for name in [*replies, *events, pidbox]), found
    assert found["celery"] is None  # the task queue stays until deleted
    # Past the idle expiry (600 s by default) with nobody touching the reply and event
    # queues; the worker's queue is touched by its consumer (as here, just now):
    later = store.now_ms() + 601_000
    store.touch_queues([pidbox], now=later)
    summary = run_pass(store, event_retention_ms=0, now=later + 1)
    assert summary["idle_queues_expired"] == len(replies) + len(events)
    assert set(queues()) == {"celery", pidbox}
    assert {queue for _, _, queue in store.bindings("reply.celery.pidbox")} == set()
    # The worker still answers, to a new reply queue.
    assert app.control.inspect([node], timeout=5).ping() == {node: {"ok": "pong"}}
