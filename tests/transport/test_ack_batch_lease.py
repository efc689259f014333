"""An ack waiting in a batch keeps its lease until it leaves for the database
(sqlease.transport._acks.stop_renewing). In the worker's event loop an ack waits a few
milliseconds for others to join it; if the loop is held up meanwhile (Celery's soft shutdown
sleeps in a signal handler on the loop's thread), its lease is still renewed, so no other
worker takes the finished task over and runs it again. A real Kombu ``Hub``; the wait is
real time, longer than the lease."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from kombu import Connection
from kombu.asynchronous import Hub
from kombu.message import Message

from sqlease import Store

from .test_background_claims import run_until
from .test_kombu import _consuming, msg_id, publish

Connect = Callable[..., Connection]

pytestmark = pytest.mark.timeout(60)

LEASE = 1.0


@pytest.fixture
def hub() -> Iterator[Hub]:
    hub = Hub()
    yield hub
    hub.close()


def test_an_ack_waiting_in_a_batch_keeps_its_lease(
    connect: Connect, db_store: Store, hub: Hub
) -> None:
    producer = connect()
    for i in range(3):
        publish(producer, "work", {"n": i})
    got: list[Message] = []
    worker = connect(lease_seconds=LEASE)
    channel = worker.default_channel
    channel.basic_qos(0, 8, False)
    _consuming(channel, "work", got)
    worker.transport.register_with_event_loop(worker.connection, hub)
    run_until(hub, lambda: len(got) == 3)
    fetcher = worker.transport.fetcher

    got[0].ack()
    assert fetcher.acks.pending  # two more are held: it waits for the batch
    time.sleep(LEASE * 2.5)  # the loop held up, for longer than the lease

    other = connect()
    try:
        # Nothing lapsed for another consumer to take over: the waiting ack's lease included.
        assert other.default_channel.basic_get("work") is None
    finally:
        other.release()
    fetcher.acks.flush()
    acked = msg_id(got[0])
    run_until(hub, lambda: db_store.get_message(acked) is None)
    kinds = [e.kind for e in db_store.events(message_id=acked)]
    assert kinds[-2:] == ["claimed", "acked"], kinds
    for message in got[1:]:
        message.ack()
    fetcher.acks.flush()
    run_until(hub, lambda: all(db_store.get_message(msg_id(m)) is None for m in got))
    worker.release()
    producer.release()
