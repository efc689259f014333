"""Auto-delete queues through Kombu (both databases): the declaration records the idle
expiry, a live consumer keeps its queue, a gone consumer's queue goes at the next pass with
its bindings, and a consumer whose queue expired under it declares and binds it again."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from sqlalchemy import select

from sqlease import Store
from sqlease._core.maintenance import run_pass

EXPIRY = 1.0  # seconds (the option's least); consumers touch every 0.2 s


def reply_queue(name: str) -> Queue:
    exchange = Exchange("reply.celery.pidbox", type="direct", durable=False)
    return Queue(
        f"{name}.reply.celery.pidbox",
        exchange,
        routing_key=name,
        durable=False,
        auto_delete=True,
        expires=EXPIRY / 10,  # shorter than the floor: idle_queue_expiry wins
    )


def drain_for(conn: Connection, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=0.1)
        except TimeoutError:
            pass


@pytest.mark.timeout(60)
def test_a_live_consumer_keeps_its_queue_and_a_gone_one_loses_it(
    connect: Callable[..., Connection], db_store: Store
) -> None:
    live, gone = reply_queue("live"), reply_queue("gone")
    consumer_conn = connect(idle_queue_expiry=EXPIRY)
    got: list[object] = []
    with Consumer(consumer_conn, [live], callbacks=[lambda body, m: got.append(body)]):
        leaving = connect(idle_queue_expiry=EXPIRY)
        with Consumer(leaving, [gone], no_ack=True):
            drain_for(leaving, 0.1)
        leaving.release()  # the inspect call is over
        assert db_store.has_queue(gone.name) and db_store.has_queue(live.name)
        drain_for(consumer_conn, 3 * EXPIRY)  # the live consumer touches its queue
        summary = run_pass(db_store, event_retention_ms=0)
        assert summary["idle_queues_expired"] == 1
        assert db_store.has_queue(live.name) and not db_store.has_queue(gone.name)
        bound = {queue for _, _, queue in db_store.bindings("reply.celery.pidbox")}
        assert bound == {live.name}
        with connect() as producer_conn:
            Producer(producer_conn).publish(
                {"reply": 1}, exchange=live.exchange, routing_key="live", serializer="json"
            )
        drain_for(consumer_conn, 0.5)
        assert got == [{"reply": 1}]


@pytest.mark.timeout(60)
def test_a_consumer_whose_queue_expired_declares_and_binds_it_again(
    connect: Callable[..., Connection], db_store: Store
) -> None:
    queue = reply_queue("paused")
    conn = connect(idle_queue_expiry=EXPIRY)
    got: list[object] = []
    with Consumer(conn, [queue], callbacks=[lambda body, m: (got.append(body), m.ack())]):
        drain_for(conn, 0.1)
        time.sleep(EXPIRY + 0.2)  # the consumer stands still for longer than the expiry
        assert run_pass(db_store, event_retention_ms=0)["idle_queues_expired"] == 1
        drain_for(conn, 0.5)  # its next touch finds the queue gone
        assert db_store.has_queue(queue.name)
        assert {q for _, _, q in db_store.bindings("reply.celery.pidbox")} == {queue.name}
        with connect() as producer_conn:
            Producer(producer_conn).publish(
                {"after": 1}, exchange=queue.exchange, routing_key="paused", serializer="json"
            )
        drain_for(conn, 0.5)
        assert got == [{"after": 1}]


def test_a_queues_expires_reaches_its_idle_expiry(
    connect: Callable[..., Connection], db_store: Store
) -> None:
    """``Queue(expires=…)`` (RabbitMQ's ``x-expires``), which Kombu's virtual channels drop,
    is the queue's idle expiry (the longer of it and ``idle_queue_expiry``); a queue
    declared without it stays until deleted."""
    conn = connect(idle_queue_expiry=EXPIRY)
    Queue("expiring", expires=5.0)(conn.default_channel).declare()
    Queue("staying")(conn.default_channel).declare()
    queues = db_store.tables.queues
    with db_store.engine.connect() as c:
        rows = dict(c.execute(select(queues.c.name, queues.c.expires_ms)).all())
    assert rows["expiring"] == 5_000 and rows["staying"] is None
