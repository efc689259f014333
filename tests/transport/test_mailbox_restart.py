"""A worker's remote-control queue across a restart (Kombu's mailbox, both databases): the
commands broadcast while no worker of that name listened are not delivered to the next one,
as RabbitMQ (whose auto-delete queue went with the consumer) and Redis (which broadcasts to
listening workers only) behave; commands sent once it listens, and the replies a client
waits for, still come."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from kombu import Connection
from kombu.pidbox import Mailbox

from sqlease import Store

pytestmark = pytest.mark.timeout(60)


class _Handlers:
    """What a worker's node runs for each command: records it."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, name: str) -> Callable[..., Any]:
        def handle(state: Any, **arguments: Any) -> str:
            self.seen.append(name)
            return "pong" if name == "ping" else "ok"

        return handle


def _node(conn: Connection, handlers: _Handlers) -> Any:
    """A worker named w1@host listening for commands; its consumer."""
    mailbox = Mailbox("celery", type="fanout")(conn)
    commands = {n: handlers(n) for n in ("shutdown", "cancel_consumer", "ping")}
    node = mailbox.Node("w1@host", handlers=commands, state={})
    return node.listen(channel=conn.channel())


def _drain(conn: Connection, until: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=0.05)
        except TimeoutError:
            pass


def test_commands_sent_while_no_worker_listened_do_not_reach_the_next_one(
    connect: Callable[..., Connection], db_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    first, handlers = connect(), _Handlers()
    consumer = _node(first, handlers)
    client = Mailbox("celery", type="fanout")(connect())
    client._broadcast("ping")  # a live worker gets its commands
    _drain(first, lambda: handlers.seen == ["ping"])
    assert handlers.seen == ["ping"]
    consumer.cancel()
    first.release()  # the worker stopped (or died): its queue stays for a while
    client._broadcast("shutdown")
    client._broadcast("cancel_consumer", {"queue": "celery"})
    assert db_store.size("w1@host.celery.pidbox") == 2
    again, restarted = connect(), _Handlers()
    with caplog.at_level(logging.WARNING, logger="sqlease.transport._control"):
        _node(again, restarted)
    _drain(again, lambda: bool(restarted.seen), seconds=1.0)
    assert restarted.seen == []  # neither the shutdown nor the cancel came
    assert "2 remote-control command(s)" in caplog.text
    assert db_store.size("w1@host.celery.pidbox") == 0
    # It listens: what is sent now comes, and a client waiting for its reply gets it.
    worker = threading.Thread(target=_drain, args=(again, lambda: bool(restarted.seen)))
    worker.start()
    replies = client._broadcast("ping", reply=True, timeout=5.0, limit=1)
    worker.join()
    assert restarted.seen == ["ping"] and replies == [{"w1@host": "pong"}]
    again.release()


def test_a_queue_of_tasks_keeps_what_was_published_before_its_consumer_came(
    connect: Callable[..., Connection], db_store: Store
) -> None:
    """Only a mailbox's queue starts empty: an auto-delete queue of a fanout exchange
    that is not a mailbox keeps its messages for its first consumer."""
    from kombu import Consumer, Exchange, Producer, Queue

    exchange = Exchange("news", type="fanout")
    queue = Queue("reader", exchange, auto_delete=True)
    with connect() as producer:
        Producer(producer).publish({"n": 1}, exchange=exchange, declare=[queue])
    got: list[Any] = []
    reader = connect()
    with Consumer(reader, [queue], no_ack=True, callbacks=[lambda b, m: got.append(b)]):
        _drain(reader, lambda: bool(got))
    assert got == [{"n": 1}]
    reader.release()
