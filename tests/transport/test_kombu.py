"""The sqlease Kombu transport through Kombu's own API, on SQLite and PostgreSQL:
publish/consume/ack, fenced reject/requeue/restore, stale acks, priorities, exchanges with
persisted bindings, purge, no-ack consumers, delayed delivery, per-run serialization,
heartbeats, bad input and URLs.

Modelled on Kombu's integration suite (``t/integration/common.py``). Rows are checked through a
``sqlease.Store`` on the test's own table prefix.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import kombu
import kombu.exceptions
import kombu.transport
import pytest
from amqp.exceptions import ChannelError
from kombu import Connection, Consumer, Exchange, Queue
from kombu.message import Message
from kombu.utils.url import parse_url
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

import sqlease
from conftest import unique_prefix
from sqlease import ConfigurationError, PayloadTooLarge, Store
from sqlease._core.heartbeat import heartbeat
from sqlease._db.driver import Lane
from sqlease.transport import Transport, fence_of
from sqlease.urls import client_url, to_sqlalchemy_url

from .conftest import POLL

Connect = Callable[..., Connection]

# ---- helpers ------------------------------------------------------------------------------


def publish(conn: Connection, queue: str, body: Any, **kwargs: Any) -> None:
    """Publish ``body`` (JSON) to ``queue`` through the default exchange, declaring it."""
    conn.Producer().publish(
        body, routing_key=queue, declare=[Queue(queue)], serializer="json", **kwargs
    )


def consume(
    conn: Connection,
    queues: Iterable[str | Queue],
    count: int,
    *,
    timeout: float = 5.0,
    prefetch: int | None = None,
    no_ack: bool = False,
    channel: Any = None,
    on_message: Callable[[Any, Message], None] | None = None,
) -> list[Message]:
    """Consume until ``count`` messages came or ``timeout`` passed (then fewer are returned).
    The messages are not acked; the consumer is cancelled before returning."""
    got: list[Message] = []

    def callback(body: Any, message: Message) -> None:
        got.append(message)
        if on_message is not None:
            on_message(body, message)

    consumer = Consumer(
        channel or conn.default_channel,
        [Queue(q) if isinstance(q, str) else q for q in queues],
        callbacks=[callback],
        no_ack=no_ack,
        prefetch_count=prefetch,
        accept=["json"],
    )
    deadline = time.monotonic() + timeout
    with consumer:
        while len(got) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                conn.drain_events(timeout=remaining)
            except TimeoutError:
                break
    return got


def get(conn: Connection, queue: str, *, no_ack: bool = False) -> Message | None:
    """``basic_get`` on the connection's default channel."""
    message: Message | None = conn.default_channel.basic_get(queue, no_ack=no_ack)
    return message


def wait_get(conn: Connection, queue: str, *, timeout: float = 5.0) -> Message:
    """``basic_get`` until a message comes (e.g. once a lease has expired)."""
    deadline = time.monotonic() + timeout
    while True:
        message = get(conn, queue)
        if message is not None:
            return message
        assert time.monotonic() < deadline, f"nothing came from {queue!r} in {timeout}s"
        time.sleep(0.02)


def msg_id(message: Message) -> int:
    return int(message.delivery_info["sqlease_id"])


def attempt_of(message: Message) -> int:
    return int(message.delivery_info["sqlease_attempt"])


def ready(conn: Connection, queue: str) -> int:
    """Kombu's count of deliverable messages (``queue_declare(passive=True)``)."""
    count: int = conn.default_channel.queue_declare(queue, passive=True).message_count
    return count


def rows(store: Store, queue: str | None = None) -> int:
    """Message rows in the table (any state), optionally of one queue."""
    table = store.tables.messages
    stmt = select(func.count()).select_from(table)
    if queue is not None:
        stmt = stmt.where(table.c.queue == queue)
    with store.engine.connect() as c:
        return int(c.execute(stmt).scalar_one())


def leased_rows(store: Store) -> list[sqlease.Message]:
    """Every row under a lease (live or expired)."""
    table = store.tables.messages
    with store.engine.connect() as c:
        ids = c.execute(select(table.c.id).where(table.c.lease_owner.is_not(None))).scalars()
        found = [store.get_message(int(i)) for i in ids]
    return [m for m in found if m is not None]


def bodies(messages: Iterable[Message]) -> list[Any]:
    return [m.payload for m in messages]


# ---- connecting ---------------------------------------------------------------------------


def test_connect_close_and_reconnect(conn: Connection) -> None:
    assert conn.connect()
    assert conn.connected
    conn.close()
    assert not conn.connected
    assert conn.connect()
    assert conn.connected


def test_unreachable_database_is_a_connection_error(
    db_url: str, table_prefix: str, tmp_path: Any
) -> None:
    if db_url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'x.db'}"
    else:
        url = make_url(db_url).set(port=1).render_as_string(hide_password=False)
    conn = Connection("sqlease+" + url, transport_options={"table_prefix": table_prefix})
    try:
        with pytest.raises(kombu.exceptions.OperationalError):
            conn.ensure_connection(max_retries=0)
    finally:
        conn.release()


def _dead_url(db_url: str, tmp_path: Any) -> str:
    if db_url.startswith("sqlite"):
        return f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'x.db'}"
    return make_url(db_url).set(port=1).render_as_string(hide_password=False)


@pytest.mark.timeout(30)
def test_a_refused_connect_fails_fast_so_kombu_retries_it(
    db_url: str, table_prefix: str, tmp_path: Any
) -> None:
    """One connect attempt is one attempt of Kombu's retry loop: it must not retry for 20 s
    itself, or ``connect_timeout``, ``max_retries`` and failover never get a turn (Kombu's
    integration suite: ``BasicFunctionality.test_failed_*``, ``BaseFailover``)."""
    conn = Connection(
        "sqlease+" + _dead_url(db_url, tmp_path), transport_options={"table_prefix": table_prefix}
    )
    try:
        started = time.monotonic()
        with pytest.raises(kombu.exceptions.OperationalError):
            conn.ensure_connection(max_retries=0)
        assert time.monotonic() - started < 5
    finally:
        conn.release()


@pytest.mark.timeout(60)
def test_failover_to_an_alternate_url(
    db_url: str, table_prefix: str, tmp_path: Any, db_store: Store
) -> None:
    """``"dead;live"``: Kombu's ``Connection.switch()`` resolves the alternate's whole scheme
    (``sqlease+postgresql``) as the transport name and hands the URL over in parts. Was a
    ``KeyError: 'No such transport: sqlease+…'`` (Kombu's ``BaseFailover``)."""
    live = "sqlease+" + db_url
    conn = Connection(
        f"sqlease+{_dead_url(db_url, tmp_path)};{live}",
        transport_options={"table_prefix": table_prefix, "polling_interval": POLL},
    )
    try:
        conn.ensure_connection(max_retries=2, interval_start=0, interval_step=0)
        assert conn.connected
        assert conn.transport_cls == live.partition("://")[0]
        assert to_sqlalchemy_url(conn.as_uri(include_password=True)) == to_sqlalchemy_url(live)
        publish(conn, "q", {"n": 1})
        [message] = consume(conn, ["q"], 1)
        assert message.payload == {"n": 1}
        message.ack()
        assert rows(db_store) == 0
    finally:
        conn.release()


def test_client_url_rebuilds_an_alternate_url_from_its_parts() -> None:
    for url in (
        "sqlease+sqlite:////tmp/some/app.db",
        "sqlease+postgresql://app:p%40ss@db.example:6543/shop",
        "sqlease+postgresql+psycopg://app@db.example/shop",
    ):
        parts = parse_url(url)
        rebuilt = client_url(
            parts["hostname"],
            transport=parts["transport"],
            userid=parts["userid"],
            password=parts["password"],
            port=parts["port"],
            virtual_host=parts["virtual_host"],
        )
        assert to_sqlalchemy_url(rebuilt) == to_sqlalchemy_url(url)


# ---- publish, consume, ack ----------------------------------------------------------------


def test_publish_consume_ack(conn: Connection, db_store: Store) -> None:
    publish(conn, "q", {"n": 0})
    publish(conn, "q", {"n": 1})
    assert ready(conn, "q") == 2

    [first] = consume(conn, ["q"], 1, prefetch=1)
    assert first.payload == {"n": 0}
    assert first.content_type == "application/json"
    assert first.delivery_info["routing_key"] == "q"
    assert first.delivery_info["redelivered"] is False
    assert attempt_of(first) == 1
    row = db_store.get_message(msg_id(first))
    assert row is not None and row.lease_owner == first.delivery_info["sqlease_owner"]
    assert ready(conn, "q") == 1  # the leased one is not deliverable

    first.ack()
    assert db_store.get_message(msg_id(first)) is None
    assert ready(conn, "q") == 1

    [second] = consume(conn, ["q"], 1, prefetch=1)
    assert second.payload == {"n": 1}
    assert second.delivery_tag != first.delivery_tag
    second.ack()
    assert ready(conn, "q") == 0
    assert rows(db_store) == 0


def test_consuming_an_empty_queue_times_out(conn: Connection) -> None:
    conn.default_channel.queue_declare("empty")
    with Consumer(conn.default_channel, [Queue("empty")], accept=["json"]):
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.2)
        assert time.monotonic() - start < 2.0


def test_simple_queue_put_get_qsize_clear(conn: Connection) -> None:
    queue = conn.SimpleQueue("simple")
    try:
        for n in range(3):
            queue.put({"n": n})
        assert queue.qsize() == 3
        message = queue.get_nowait()
        assert message.payload == {"n": 0}
        assert queue.qsize() == 2
        message.ack()
        assert queue.qsize() == 2
        assert queue.clear() == 2
        assert queue.qsize() == 0
        with pytest.raises(queue.Empty):
            queue.get_nowait()
        queue.put({"n": 9})
        message = queue.get(timeout=5)
        assert message.payload == {"n": 9}
        message.ack()
        assert queue.qsize() == 0
    finally:
        queue.close()


def test_simple_buffer_is_no_ack(conn: Connection, db_store: Store) -> None:
    buffer = conn.SimpleBuffer("buffer")
    try:
        buffer.put({"n": 1})
        message = buffer.get(timeout=5)
        assert message.payload == {"n": 1}
        assert rows(db_store, "buffer") == 0  # deleted on fetch, nothing to ack
    finally:
        buffer.close()


def test_basic_get_leases_until_ack(conn: Connection, db_store: Store) -> None:
    publish(conn, "q", {"n": 1})
    message = get(conn, "q")
    assert message is not None
    assert message.payload == {"n": 1}
    assert attempt_of(message) == 1
    row = db_store.get_message(msg_id(message))
    assert row is not None and row.lease_owner is not None
    assert get(conn, "q") is None  # leased: not delivered twice
    message.ack()
    assert db_store.get_message(msg_id(message)) is None
    assert get(conn, "q") is None


def test_basic_get_no_ack_deletes_on_fetch(conn: Connection, db_store: Store) -> None:
    publish(conn, "q", {"n": 0})
    publish(conn, "q", {"n": 1})
    first = get(conn, "q", no_ack=True)
    assert first is not None and first.payload == {"n": 0}
    assert "sqlease_id" not in first.delivery_info  # no lease: nothing to fence
    assert rows(db_store, "q") == 1
    second = get(conn, "q", no_ack=True)
    assert second is not None and second.payload == {"n": 1}
    assert rows(db_store, "q") == 0
    assert get(conn, "q", no_ack=True) is None


# ---- reject, requeue, restore -------------------------------------------------------------


@pytest.mark.parametrize("how", ["reject", "requeue"])
def test_requeued_message_is_redelivered_with_the_next_attempt(
    conn: Connection, db_store: Store, how: str
) -> None:
    publish(conn, "q", {"n": 1})
    [first] = consume(conn, ["q"], 1, prefetch=1)
    if how == "reject":
        first.reject(requeue=True)
    else:
        first.requeue()
    row = db_store.get_message(msg_id(first))
    assert row is not None
    assert (row.state, row.lease_owner, row.attempt) == ("ready", None, 1)
    assert heartbeat().holds(fence_of(first.delivery_info)) is False

    [again] = consume(conn, ["q"], 1, prefetch=1)
    assert msg_id(again) == msg_id(first)
    assert again.payload == {"n": 1}
    assert again.delivery_info["redelivered"] is True
    assert attempt_of(again) == 2
    again.ack()
    assert rows(db_store) == 0


def test_reject_without_requeue_keeps_the_row_dead(conn: Connection, db_store: Store) -> None:
    publish(conn, "q", {"n": 1})
    publish(conn, "q", {"n": 2})
    [first] = consume(conn, ["q"], 1, prefetch=1)
    first.reject(requeue=False)
    row = db_store.get_message(msg_id(first))
    assert row is not None
    assert (row.state, row.reason, row.lease_owner) == ("dead", "rejected", None)
    assert ready(conn, "q") == 1

    got = consume(conn, ["q"], 2, prefetch=5, timeout=0.5)
    assert bodies(got) == [{"n": 2}]  # the rejected one is never redelivered
    got[0].ack()
    assert ready(conn, "q") == 0


def test_attempts_are_exhausted_after_max_attempts(connect: Connect, db_store: Store) -> None:
    conn = connect(max_attempts=2)
    publish(conn, "q", {"n": 1})
    for attempt in (1, 2):
        [message] = consume(conn, ["q"], 1, prefetch=1)
        assert attempt_of(message) == attempt
        message.reject(requeue=True)
    assert consume(conn, ["q"], 1, prefetch=1, timeout=0.3) == []
    row = db_store.get_message(msg_id(message))
    assert row is not None
    assert (row.state, row.reason, row.attempt) == ("dead", "attempts_exhausted", 2)


def test_closing_a_connection_releases_unacked_messages_at_once(
    connect: Connect, db_store: Store
) -> None:
    a, b = connect(), connect()
    for n in range(3):
        publish(a, "q", {"n": n})
    held = consume(a, ["q"], 3, prefetch=3)
    assert len(held) == 3
    ids = sorted(msg_id(m) for m in held)
    fences = [fence_of(m.delivery_info) for m in held]
    assert get(b, "q") is None

    a.release()

    for message_id in ids:
        row = db_store.get_message(message_id)
        assert row is not None
        assert (row.state, row.lease_owner, row.lease_expires_at_ms) == ("ready", None, None)
        assert row.attempt == 1
        assert row.max_attempts == 4  # the unstarted delivery is refunded to the budget
    assert not any(heartbeat().holds(f) for f in fences if f is not None)

    start = time.monotonic()
    again = [get(b, "q") for _ in range(3)]
    assert time.monotonic() - start < 2.0  # no waiting for lease expiry
    assert all(m is not None for m in again)
    assert sorted(msg_id(m) for m in again if m is not None) == ids
    for m in again:
        assert m is not None
        assert attempt_of(m) == 2 and m.delivery_info["redelivered"] is True
        m.ack()
    assert rows(db_store) == 0


def test_closing_a_channel_releases_its_unacked_messages(conn: Connection, db_store: Store) -> None:
    publish(conn, "q", {"n": 1})
    channel = conn.channel()
    [held] = consume(conn, ["q"], 1, prefetch=1, channel=channel)
    assert get(conn, "q") is None
    channel.close()
    row = db_store.get_message(msg_id(held))
    assert row is not None
    assert (row.lease_owner, row.attempt, row.max_attempts) == (None, 1, 4)
    again = get(conn, "q")
    assert again is not None and msg_id(again) == msg_id(held)
    assert attempt_of(again) == 2
    again.ack()


@pytest.mark.timeout(30)
def test_a_stale_ack_changes_nothing(
    connect: Connect, db_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    a = connect(lease_seconds=0.3)
    b = connect()
    publish(a, "q", {"n": 1})
    stale = get(a, "q")
    assert stale is not None and attempt_of(stale) == 1
    fence = fence_of(stale.delivery_info)
    assert fence is not None
    heartbeat().drop([fence])  # A stalls: its heartbeat no longer renews the lease

    current = wait_get(b, "q")  # after A's lease expired
    assert msg_id(current) == msg_id(stale)
    assert attempt_of(current) == 2
    assert current.delivery_info["redelivered"] is True

    with caplog.at_level(logging.WARNING, logger="sqlease"):
        stale.ack()  # must not raise
    assert "stale ack refused" in caplog.text
    row = db_store.get_message(msg_id(stale))
    assert row is not None, "a stale ack deleted the message another consumer holds"
    assert row.attempt == 2
    assert row.lease_owner == current.delivery_info["sqlease_owner"]

    current.ack()
    assert db_store.get_message(msg_id(stale)) is None


# ---- order ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["basic_get", "consumer"])
def test_higher_priority_first_then_fifo(conn: Connection, db_store: Store, how: str) -> None:
    sent = [(0, "low-a"), (9, "high-a"), (5, "mid"), (9, "high-b"), (0, "low-b"), (1, "one")]
    for priority, name in sent:
        publish(conn, "q", {"name": name}, priority=priority)
    if how == "basic_get":
        got = [get(conn, "q") for _ in sent]
        assert get(conn, "q") is None
        messages = [m for m in got if m is not None]
    else:
        messages = consume(conn, ["q"], len(sent), prefetch=10)
    assert [m.payload["name"] for m in messages] == [
        "high-a",
        "high-b",
        "mid",
        "one",
        "low-a",
        "low-b",
    ]
    for m in messages:
        m.ack()
    assert rows(db_store) == 0


# ---- queues and exchanges -----------------------------------------------------------------


def test_one_consumer_several_queues(conn: Connection, db_store: Store) -> None:
    for queue in ("q1", "q2", "q3"):
        for n in range(2):
            publish(conn, queue, {"queue": queue, "n": n})
    got = consume(conn, ["q1", "q2", "q3"], 6, prefetch=10)
    assert sorted((m.payload["queue"], m.payload["n"]) for m in got) == [
        (q, n) for q in ("q1", "q2", "q3") for n in range(2)
    ]
    for m in got:
        assert m.delivery_info["routing_key"] == m.payload["queue"]
        m.ack()
    assert rows(db_store) == 0


def test_direct_exchange_routes_by_routing_key(connect: Connect, db_store: Store) -> None:
    binder, publisher = connect(), connect()
    exchange = Exchange("direct_x", type="direct")
    for name, key in (("qa", "a"), ("qb", "b")):
        Queue(name, exchange, routing_key=key)(binder.default_channel).declare()

    producer = publisher.Producer(exchange=exchange, serializer="json")
    for key in ("a", "b", "a", "nobody"):
        producer.publish({"key": key}, routing_key=key)

    assert ready(publisher, "qa") == 2
    assert ready(publisher, "qb") == 1
    assert rows(db_store) == 3  # "nobody" matched no binding
    got = consume(publisher, ["qb"], 1)
    assert bodies(got) == [{"key": "b"}]
    assert got[0].delivery_info["exchange"] == "direct_x"
    got[0].ack()


def test_topic_exchange_with_bindings_from_another_connection(
    connect: Connect, db_store: Store
) -> None:
    binder, publisher = connect(), connect()
    exchange = Exchange("topic_x", type="topic")
    Queue("t_a", exchange, routing_key="a.*")(binder.default_channel).declare()
    Queue("t_all", exchange, routing_key="#")(binder.default_channel).declare()

    producer = publisher.Producer(exchange=exchange, serializer="json")
    for key in ("a.x", "b.y", "a.x.y", "a"):
        producer.publish({"key": key}, routing_key=key)

    assert (ready(binder, "t_a"), ready(binder, "t_all")) == (1, 4)
    got_a = consume(binder, ["t_a"], 1, prefetch=10)
    got_all = consume(binder, ["t_all"], 4, prefetch=10)
    assert bodies(got_a) == [{"key": "a.x"}]
    assert sorted(m.payload["key"] for m in got_all) == ["a", "a.x", "a.x.y", "b.y"]
    for m in got_a + got_all:
        m.ack()
    assert rows(db_store) == 0


def test_an_exchange_declared_elsewhere_routes_by_its_type_when_published_to_by_name(
    connect: Connect, db_store: Store
) -> None:
    """As on a broker, an exchange's type is kept where its bindings are: a process that
    publishes to it by name, never having declared it, routes by that type (Kombu alone
    would take it for a direct exchange and drop what no routing key names). A passive
    declaration finds it; deleting it takes its type and bindings away."""
    binder, publisher = connect(), connect()
    topic, fanout = Exchange("named_topic", type="topic"), Exchange("named_fan", type="fanout")
    Queue("nt_orders", topic, routing_key="orders.*")(binder.default_channel).declare()
    Queue("nf_1", fanout)(binder.default_channel).declare()
    Queue("nf_2", fanout)(binder.default_channel).declare()

    producer = publisher.Producer(serializer="json")  # declares nothing
    for key in ("orders.us", "orders.us.west", "refunds.us"):
        producer.publish({"key": key}, exchange="named_topic", routing_key=key)
    producer.publish({"n": 1}, exchange="named_fan", routing_key="anything")

    assert ready(binder, "nt_orders") == 1
    assert (ready(binder, "nf_1"), ready(binder, "nf_2")) == (1, 1)
    assert bodies(consume(binder, ["nt_orders"], 1)) == [{"key": "orders.us"}]
    # A queue bound to it by a process that never declared it: a fanout's third queue.
    joiner = connect().channel()
    joiner.queue_declare("nf_3")
    joiner.queue_bind("nf_3", "named_fan")
    producer.publish({"n": 2}, exchange="named_fan", routing_key="")
    assert [ready(binder, q) for q in ("nf_1", "nf_2", "nf_3")] == [2, 2, 1]
    channel = publisher.channel()
    channel.exchange_declare("named_topic", "topic", passive=True)  # no error: it exists
    with pytest.raises(ChannelError, match="NOT_FOUND"):
        channel.exchange_declare("never_declared", "topic", passive=True)

    binder.default_channel.exchange_delete("named_topic")
    later = connect().channel()  # a connection that never saw it
    with pytest.raises(ChannelError, match="NOT_FOUND"):
        later.exchange_declare("named_topic", "topic", passive=True)
    assert db_store.bindings("named_topic") == []
    assert db_store.exchange_type("named_fan") == "fanout"


def test_fanout_delivers_one_copy_to_each_bound_queue(connect: Connect, db_store: Store) -> None:
    a, b, publisher = connect(), connect(), connect()
    exchange = Exchange("fan_x", type="fanout")
    Queue("f1", exchange)(a.default_channel).declare()
    Queue("f2", exchange)(b.default_channel).declare()
    Queue("f3", exchange)(b.default_channel).declare()

    publisher.Producer(exchange=exchange, serializer="json").publish({"n": 1})

    for queue in ("f1", "f2", "f3"):
        assert ready(publisher, queue) == 1
    assert rows(db_store) == 3
    got = consume(a, ["f1"], 1) + consume(b, ["f2", "f3"], 2)
    assert bodies(got) == [{"n": 1}] * 3
    assert len({msg_id(m) for m in got}) == 3  # three rows, one copy each
    for m in got:
        m.ack()
    assert rows(db_store) == 0


@pytest.mark.parametrize("kind", ["direct", "topic", "fanout"])
def test_unbinding_stops_delivery(connect: Connect, db_store: Store, kind: str) -> None:
    binder, publisher = connect(), connect()
    exchange = Exchange(f"{kind}_unbind_x", type=kind)
    key = "a.b" if kind != "fanout" else ""
    kept = Queue("kept", exchange, routing_key=key)(binder.default_channel)
    gone = Queue("gone", exchange, routing_key=key)(binder.default_channel)
    kept.declare()
    gone.declare()
    producer = publisher.Producer(exchange=exchange, serializer="json")
    producer.publish({"n": 1}, routing_key="a.b")
    assert (ready(publisher, "kept"), ready(publisher, "gone")) == (1, 1)

    gone.unbind_from(exchange, routing_key=key)
    producer.publish({"n": 2}, routing_key="a.b")
    assert (ready(publisher, "kept"), ready(publisher, "gone")) == (2, 1)


@pytest.mark.parametrize(
    "kind",
    [
        "direct",
        "fanout",
        "topic",
    ],
)
def test_unbinding_from_another_connection_stops_delivery(
    connect: Connect, db_store: Store, kind: str
) -> None:
    binder, other, publisher = connect(), connect(), connect()
    exchange = Exchange(f"{kind}_xunbind_x", type=kind)
    key = "a.b" if kind != "fanout" else ""
    Queue("gone", exchange, routing_key=key)(binder.default_channel).declare()
    producer = publisher.Producer(exchange=exchange, serializer="json")
    producer.publish({"n": 1}, routing_key="a.b")
    assert ready(publisher, "gone") == 1

    # Another process unbinds the queue (Kombu's Queue.unbind_from declares nothing first).
    Queue("gone", exchange, routing_key=key)(other.default_channel).unbind_from(
        exchange, routing_key=key
    )
    assert [q for _, _, q in db_store.bindings(exchange.name)] == []
    producer.publish({"n": 2}, routing_key="a.b")
    assert ready(publisher, "gone") == 1


def test_queue_delete_removes_queue_bindings_and_ready_messages(
    conn: Connection, db_store: Store
) -> None:
    exchange = Exchange("del_x", type="direct")
    Queue("doomed", exchange, routing_key="k")(conn.default_channel).declare()
    Queue("survivor", exchange, routing_key="k")(conn.default_channel).declare()
    producer = conn.Producer(exchange=exchange, serializer="json")
    producer.publish({"n": 1}, routing_key="k")
    producer.publish({"n": 2}, routing_key="k")
    assert rows(db_store, "doomed") == 2

    conn.default_channel.queue_delete("doomed")

    with pytest.raises(kombu.exceptions.ChannelError):
        conn.default_channel.queue_declare("doomed", passive=True)
    assert [q for _, _, q in db_store.bindings("del_x")] == ["survivor"]
    assert rows(db_store, "doomed") == 0
    producer.publish({"n": 3}, routing_key="k")
    assert rows(db_store, "doomed") == 0
    assert ready(conn, "survivor") == 3


def test_purge_removes_ready_messages_and_leaves_leased_ones(
    conn: Connection, db_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    for n in range(4):
        publish(conn, "q", {"n": n})
    held = get(conn, "q")
    assert held is not None
    assert conn.default_channel.queue_purge("q") == 3
    assert ready(conn, "q") == 0
    row = db_store.get_message(msg_id(held))
    assert row is not None and row.lease_owner is not None
    assert conn.default_channel.queue_purge("q") == 0
    with caplog.at_level(logging.WARNING, logger="sqlease"):
        held.ack()
    assert "stale" not in caplog.text
    assert rows(db_store) == 0


# ---- consumers that never ack ---------------------------------------------------------------


@pytest.mark.timeout(30)
def test_no_ack_consumer_deletes_on_fetch(connect: Connect, db_store: Store) -> None:
    a = connect(lease_seconds=0.3)
    for n in range(3):
        publish(a, "q", {"n": n})
    got = consume(a, ["q"], 3, no_ack=True)
    assert bodies(got) == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert rows(db_store) == 0
    time.sleep(0.5)  # longer than a lease: nothing comes back
    b = connect()
    assert get(b, "q") is None
    assert consume(b, ["q"], 1, timeout=0.2) == []


def _calls_of(monkeypatch: pytest.MonkeyPatch, target: Any, name: str) -> list[tuple[Any, ...]]:
    """Record the positional arguments of every call to ``target.name`` (still carried out)."""
    calls: list[tuple[Any, ...]] = []
    real = getattr(target, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, recording)
    return calls


def _consuming(channel: Any, queue: str, into: list[Any], *, no_ack: bool = False) -> None:
    """Start a consumer on ``queue`` that appends each message it gets to ``into``."""
    Consumer(
        channel,
        [Queue(queue)],
        callbacks=[lambda b, m: into.append(m)],
        accept=["json"],
        no_ack=no_ack,
    ).consume()


def test_remote_control_is_delivered_before_tasks_published_after_it(
    connect: Connect,
) -> None:
    """A revoke broadcast before a task was published must reach Celery before the task, or
    the task runs first (Celery's test_revoked_by_headers_complex_canvas, every time on
    SQLite): the no-ack (pidbox) queues are looked at before any channel claims, whichever
    channel Kombu's fair cycle comes to first."""
    conn = connect()
    got: list[Any] = []
    _consuming(conn.channel(), "work", got)  # the task channel first in the cycle
    _consuming(conn.channel(), "control", got, no_ack=True)
    publish(conn, "control", {"method": "revoke"})
    publish(conn, "work", {"task": 1})
    conn.drain_events(timeout=5)
    assert [m.payload for m in got][:1] == [{"method": "revoke"}]
    while len(got) < 2:
        conn.drain_events(timeout=5)
    assert [m.payload for m in got] == [{"method": "revoke"}, {"task": 1}]


def test_cancelling_the_consumer_of_a_closed_channel_does_nothing(conn: Connection) -> None:
    """Celery cancels its consumers after a connection loss, on channels Kombu has closed
    (their connection is gone): that must not raise ('NoneType' has no 'withdraw_offers')."""
    channel = conn.channel()
    consumer = Consumer(channel, [Queue("work")], callbacks=[lambda b, m: None], accept=["json"])
    consumer.consume()
    channel.close()
    consumer.cancel()
    assert channel.connection is None


def _wait_for_notification(transport: Any) -> None:
    """Block until the transport's LISTEN socket has something, then let it wake as its event
    loop would."""
    import select

    fd = transport.waker.fileno()
    assert fd is not None
    assert select.select([fd], [], [], 5)[0], "no notification within 5 s"
    transport.wakeups.on_readable()


@pytest.mark.pg
@pytest.mark.timeout(30)
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # LISTEN/NOTIFY
def test_a_notification_wakes_only_the_queues_it_names(
    connect: Connect, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL names the queue in its wake-up: a published task goes straight to its claim,
    without a look at the no-ack (remote control) queues; a message for those is looked at when
    its own notification comes."""
    worker, producer = connect(), connect()
    transport = worker.transport
    got: list[Message] = []
    _consuming(worker.default_channel, "work", got)
    _consuming(worker.default_channel, "ctl", got, no_ack=True)
    takes = _calls_of(monkeypatch, transport.store, "take_op")
    assert transport.waker.fileno() is not None  # listening before anything is published
    transport.wakeups.on_readable()  # the first look: everything, then quiet
    assert takes == [(["ctl"],)] and got == []
    publish(producer, "work", {"n": 1})
    _wait_for_notification(transport)
    assert bodies(got) == [{"n": 1}]
    assert len(takes) == 1, "a task's notification made the worker look at its no-ack queue"
    publish(producer, "ctl", {"n": 2})
    _wait_for_notification(transport)
    assert bodies(got) == [{"n": 1}, {"n": 2}] and takes[-1] == (["ctl"],)


@pytest.mark.pg
@pytest.mark.timeout(30)
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # LISTEN/NOTIFY
def test_a_drained_queue_is_not_claimed_from_again_until_something_can_be_ready(
    connect: Connect, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a claim came back short, the worker's next look (an ack's) claims nothing until a
    notification names the queue or a message is released: no empty claims while idle."""
    worker, producer = connect(), connect()
    transport = worker.transport
    delivered: list[Message] = []
    _consuming(worker.default_channel, "work", delivered)
    claims = _calls_of(monkeypatch, transport.store, "ack_and_claim_op")
    assert transport.waker.fileno() is not None  # listening before anything is published

    def look() -> None:  # what an ack or a tick does in the worker's loop
        transport.fetcher.looks.wake()
        transport.wakeups.drain()

    look()
    assert len(claims) == 1 and not delivered
    look()
    assert len(claims) == 1, "claimed again from a queue known to be empty"
    publish(producer, "work", {"n": 1})
    _wait_for_notification(transport)
    assert len(claims) == 2 and len(delivered) == 1
    look()
    assert len(claims) == 2
    delivered[0].requeue()  # released: ready again, so look for it
    look()
    assert len(claims) == 3 and len(delivered) == 2


# ---- delayed delivery ---------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_eta_message_is_delivered_when_due_and_not_before(
    conn: Connection, db_store: Store
) -> None:
    # The connection's first use (the store, the schema check) happens before the clock
    # starts, and the eta leaves room for a stalled machine: everything up to the early
    # consume below must happen before it (a CI run once took over 1.5 s for the two publishes).
    conn.default_channel.queue_declare("q")
    eta = datetime.now(UTC) + timedelta(seconds=3)
    publish(conn, "q", {"n": "later"}, headers={"eta": eta.isoformat()})
    publish(conn, "q", {"n": "now"})
    assert ready(conn, "q") == 1  # the scheduled one does not count until due
    assert rows(db_store, "q") == 2

    early = consume(conn, ["q"], 2, prefetch=10, timeout=0.5)
    assert bodies(early) == [{"n": "now"}]
    early[0].ack()
    assert ready(conn, "q") == 0

    late = consume(conn, ["q"], 1, prefetch=10, timeout=8.0)
    arrived = time.time()
    assert bodies(late) == [{"n": "later"}]
    assert arrived >= eta.timestamp() - 0.05, "delivered before its eta"
    assert arrived <= eta.timestamp() + 1.5, "delivered long after its eta"
    assert attempt_of(late[0]) == 1
    late[0].ack()
    assert rows(db_store) == 0


def test_eta_in_the_past_is_delivered_at_once(conn: Connection) -> None:
    eta = datetime.now(UTC) - timedelta(hours=1)
    publish(conn, "q", {"n": 1}, headers={"eta": eta.isoformat()})
    assert ready(conn, "q") == 1
    [message] = consume(conn, ["q"], 1, timeout=2.0)
    message.ack()


# ---- per-message TTL (expiration) ---------------------------------------------------------


def backdate(store: Store, message_id: int, ms: int) -> None:
    """Make a queued message look ``ms`` older (instead of sleeping past its TTL)."""
    table = store.tables.messages
    with store.engine.begin() as c:
        c.execute(
            table.update()
            .where(table.c.id == message_id)
            .values(
                available_at_ms=table.c.available_at_ms - ms,
                created_at_ms=table.c.created_at_ms - ms,
            )
        )


def queued_ids(store: Store, queue: str) -> list[int]:
    table = store.tables.messages
    with store.engine.connect() as c:
        found = c.execute(select(table.c.id).where(table.c.queue == queue).order_by(table.c.id))
        return [int(i) for i in found.scalars()]


def test_a_message_past_its_ttl_is_not_delivered_and_kept_as_expired(
    conn: Connection, db_store: Store
) -> None:
    # Kombu's BaseTimeToLive: publish(expiration=2), wait 3 s, nothing comes.
    publish(conn, "q", {"n": "stale"}, expiration=2)
    publish(conn, "q", {"n": "fresh"}, expiration=2)
    publish(conn, "q", {"n": "no ttl"})
    stale, _fresh, plain = queued_ids(db_store, "q")
    backdate(db_store, stale, 3000)
    backdate(db_store, plain, 3000)

    got = consume(conn, ["q"], 3, prefetch=10, timeout=1.0)
    # (Backdating made "no ttl" the older one: it comes first.)
    assert bodies(got) == [{"n": "no ttl"}, {"n": "fresh"}]
    for message in got:
        message.ack()
    expired = db_store.get_message(stale)
    assert expired is not None
    assert (expired.state, expired.reason) == ("dead", "expired")
    assert expired.last_error is not None and "TTL of 2000 ms" in expired.last_error
    # Kept, so an operator can give it a fresh TTL and let it run.
    assert db_store.requeue(stale)
    [again] = consume(conn, ["q"], 1, timeout=2.0)
    assert again.payload == {"n": "stale"}
    again.ack()
    assert rows(db_store, "q") == 0


def test_a_queues_message_ttl_expires_what_waited_longer(conn: Connection, db_store: Store) -> None:
    """``Queue(message_ttl=…)`` (RabbitMQ's ``x-message-ttl``): a message queued longer than
    its queue's TTL is not delivered and kept as expired; a message's own shorter TTL still
    wins. (Kombu's virtual channels drop the argument; sqlease keeps it.)"""
    queue = Queue("ttlq", message_ttl=2)  # seconds
    queue(conn.default_channel).declare()
    publish(conn, "ttlq", {"n": "stale"})
    publish(conn, "ttlq", {"n": "fresh"})
    publish(conn, "ttlq", {"n": "own ttl"}, expiration=0.5)
    stale, _fresh, own = queued_ids(db_store, "ttlq")
    backdate(db_store, stale, 3000)
    backdate(db_store, own, 1000)
    got = consume(conn, [queue], 3, prefetch=10, timeout=1.0)
    assert bodies(got) == [{"n": "fresh"}]
    got[0].ack()
    expired = [db_store.get_message(i) for i in (stale, own)]
    assert [(m.state, m.reason) for m in expired if m] == [("dead", "expired")] * 2
    assert expired[0] is not None and "queue's TTL of 2000 ms" in (expired[0].last_error or "")
    assert expired[1] is not None and "message TTL of 500 ms" in (expired[1].last_error or "")


def test_consumers_that_never_ack_judge_a_takes_ttls_at_one_database_time(
    connect: Connect, db_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleted on fetch, a message past its own TTL is left in the timeline, not delivered;
    a take's TTLs are judged at one database time, read once. The queue's TTL is not
    applied to such consumers (remote control, events: the maintenance pass deletes their
    stale copies), and when the time cannot be read the batch is delivered, not lost."""
    conn = connect()
    queue = Queue("noackttl", message_ttl=2)
    queue(conn.default_channel).declare()
    for n in range(4):
        publish(conn, "noackttl", {"n": n}, expiration=2)
    publish(conn, "noackttl", {"n": "queue ttl only"})
    ids = queued_ids(db_store, "noackttl")
    for i in (ids[0], ids[2], ids[4]):
        backdate(db_store, i, 3000)
    reads: list[int] = []
    real = Store.now_ms
    monkeypatch.setattr(Store, "now_ms", lambda self: reads.append(1) or real(self))
    got = consume(conn, [queue], 3, no_ack=True, timeout=1.0)
    assert sorted(str(m.payload["n"]) for m in got) == ["1", "3", "queue ttl only"]
    assert rows(db_store, "noackttl") == 0
    for dropped in (ids[0], ids[2]):
        [event] = db_store.events(message_id=dropped)
        assert event.kind == "expired" and "message TTL of 2000 ms" in event.data["error"]
    assert len(reads) == 1  # one batch, one read of the database's time

    def unreadable(self: Store) -> int:
        raise OSError("the database went away")

    monkeypatch.setattr(Store, "now_ms", unreadable)
    publish(conn, "noackttl", {"n": "old"}, expiration=2)
    backdate(db_store, queued_ids(db_store, "noackttl")[0], 3000)
    [kept] = consume(conn, [queue], 1, no_ack=True, timeout=1.0)
    assert kept.payload == {"n": "old"}  # delivered rather than dropped on a guess


@pytest.mark.parametrize("ttl", [-1, 1.5, "300", True])
def test_a_bad_message_ttl_is_refused_at_declaration(conn: Connection, ttl: Any) -> None:
    queue = Queue("badttl", queue_arguments={"x-message-ttl": ttl})
    with pytest.raises(ConfigurationError, match="'badttl': x-message-ttl"):
        queue(conn.default_channel).declare()


def test_ttl_applies_to_basic_get_and_no_ack_fetches(conn: Connection, db_store: Store) -> None:
    publish(conn, "q", {"n": 1}, expiration=1)
    publish(conn, "q", {"n": 2})
    publish(conn, "r", {"n": 3}, expiration=1)
    publish(conn, "r", {"n": 4})
    for queue in ("q", "r"):
        backdate(db_store, queued_ids(db_store, queue)[0], 1500)
    dropped = queued_ids(db_store, "r")[0]

    message = get(conn, "q")  # skips the expired one
    assert message is not None and message.payload == {"n": 2}
    message.ack()
    taken = get(conn, "r", no_ack=True)
    assert taken is not None and taken.payload == {"n": 4}
    assert rows(db_store, "r") == 0  # no-ack: deleted on fetch, the expiry is in the timeline
    assert [e.kind for e in db_store.events(message_id=dropped)] == ["expired"]


def test_simple_queue_with_ttl_raises_empty_once_expired(conn: Connection, db_store: Store) -> None:
    queue = conn.SimpleQueue("ttl_simple")
    try:
        queue.put({"Hello": "World"}, headers={"k1": "v1"}, expiration=2)
        backdate(db_store, queued_ids(db_store, "ttl_simple")[0], 3000)
        with pytest.raises(queue.Empty):
            queue.get(timeout=0.5)
        queue.put({"Hello": "again"}, expiration=2)
        assert queue.get(timeout=2).payload == {"Hello": "again"}
    finally:
        queue.close()


def test_a_ttl_of_zero_expires_when_no_consumer_is_waiting(
    connect: Connect, db_store: Store
) -> None:
    # AMQP: "expired upon reaching a queue unless it can be delivered to a consumer at once".
    conn = connect()
    publish(conn, "q", {"n": "nobody waiting"}, expiration=0)
    backdate(db_store, queued_ids(db_store, "q")[0], 5)
    assert consume(conn, ["q"], 1, timeout=0.5) == []
    [expired] = [db_store.get_message(i) for i in queued_ids(db_store, "q")]
    assert expired is not None and expired.reason == "expired"


def test_celery_task_messages_with_expires_are_left_to_the_worker(
    conn: Connection, db_store: Store
) -> None:
    # Celery sets both the ``expires`` header and ``expiration``; its worker revokes expired
    # tasks itself (REVOKED result, signal, event), so the transport delivers them.
    publish(
        conn,
        "q",
        {"n": 1},
        expiration=1,
        headers={"task": "t.add", "id": "abc", "expires": "2000-01-01T00:00:00"},
    )
    backdate(db_store, queued_ids(db_store, "q")[0], 5000)
    [message] = consume(conn, ["q"], 1, timeout=2.0)
    message.ack()


@pytest.mark.parametrize("bad", ["soon", "-5", "nan", True])
def test_an_expiration_that_is_not_a_ttl_is_refused_at_publish(
    conn: Connection, db_store: Store, bad: Any
) -> None:
    # Kombu's publish(expiration=seconds) always sends a number; a raw property can carry
    # anything.
    channel = conn.default_channel
    channel.queue_declare("q")
    message = channel.prepare_message(
        '{"n": 1}', 0, "application/json", "utf-8", {}, {"expiration": bad}
    )
    with pytest.raises(ConfigurationError, match="expiration"):
        channel.basic_publish(message, "", "q")
    assert rows(db_store) == 0


# ---- per-run serialization ----------------------------------------------------------------


def test_messages_of_one_run_are_never_delivered_concurrently(
    connect: Connect, db_store: Store
) -> None:
    a, b = connect(), connect()
    publish(a, "q", {"n": "r1"}, headers={"run_id": "R"})
    publish(a, "q", {"n": "r2"}, headers={"run_id": "R"})
    publish(a, "q", {"n": "solo"})

    first = consume(a, ["q"], 3, prefetch=4, timeout=0.5)
    assert sorted(m.payload["n"] for m in first) == ["r1", "solo"]
    assert get(b, "q") is None  # r2 waits behind r1, even for another consumer

    r1 = next(m for m in first if m.payload["n"] == "r1")
    r1.ack()
    second = consume(a, ["q"], 1, prefetch=4)
    assert bodies(second) == [{"n": "r2"}]
    for m in [*first, *second]:
        if m is not r1:
            m.ack()
    assert rows(db_store) == 0


# ---- heartbeats ---------------------------------------------------------------------------


# The holder runs in a fresh process, as a worker does: the process's heartbeat thread is its own.
HOLDER = r"""
import sys
from kombu import Connection, Queue

url, prefix, warm_up = sys.argv[1], sys.argv[2], sys.argv[3] == "warm-up"
options = {"table_prefix": prefix, "polling_interval": 0.05}
with Connection(url, transport_options=options) as long_lease, Connection(
    url, transport_options={**options, "lease_seconds": 1.2}
) as short_lease:
    if warm_up:
        # Hold (then ack) a default 60 s lease first: the heartbeat thread then sleeps lease/3.
        long_lease.Producer().publish({"n": 0}, routing_key="warm", declare=[Queue("warm")])
        long_lease.default_channel.basic_get("warm").ack()
    message = short_lease.default_channel.basic_get("q")
    info = message.delivery_info
    print(info["sqlease_id"], info["sqlease_owner"], flush=True)
    sys.stdin.readline()  # hold the message, unacked, until the test says so
    message.ack()
    print("acked", flush=True)
"""


def run_holder(broker_url: str, table_prefix: str, *, warm_up: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, broker_url, table_prefix, "warm-up" if warm_up else "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def check_heartbeat_keeps_lease(
    connect: Connect, db_store: Store, broker_url: str, table_prefix: str, *, warm_up: bool
) -> None:
    other = connect()
    publish(other, "q", {"n": 1})
    holder = run_holder(broker_url, table_prefix, warm_up=warm_up)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        line = holder.stdout.readline()
        assert line, f"the holder failed: {holder.communicate(timeout=10)[1]}"
        message_id, owner = int(line.split()[0]), line.split()[1]
        # More than three 1.2 s leases, never acked. (With 0.6 s leases a busy machine, two
        # test processes and the database on two cores, once let a renewal miss the clock.)
        end = time.monotonic() + 3.8
        while time.monotonic() < end:
            stolen = get(other, "q")
            assert stolen is None, "the lease expired although its holder is alive"
            time.sleep(0.1)
        row = db_store.get_message(message_id)
        assert row is not None
        assert (row.lease_owner, row.attempt) == (owner, 1)
        holder.stdin.write("ack\n")
        holder.stdin.flush()
        out, err = holder.communicate(timeout=20)
        assert holder.returncode == 0, err
        assert out.strip() == "acked"
        assert "lease lost" not in err and "stale" not in err
        assert db_store.get_message(message_id) is None
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate()


@pytest.mark.timeout(60)
def test_heartbeat_keeps_a_held_lease_alive(
    connect: Connect, db_store: Store, broker_url: str, table_prefix: str
) -> None:
    check_heartbeat_keeps_lease(connect, db_store, broker_url, table_prefix, warm_up=False)


@pytest.mark.timeout(60)
def test_heartbeat_renews_a_short_lease_taken_while_the_thread_sleeps_long(
    connect: Connect, db_store: Store, broker_url: str, table_prefix: str
) -> None:
    check_heartbeat_keeps_lease(connect, db_store, broker_url, table_prefix, warm_up=True)


# ---- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        "not json{",
        '{"no": "properties"}',
        "[1, 2]",
        '"just a string"',
        '{"properties": {"delivery_info": 5}}',
    ],
)
def test_undecodable_row_is_kept_dead_and_the_next_message_delivered(
    conn: Connection, db_store: Store, payload: str
) -> None:
    conn.default_channel.queue_declare("q")
    bad = db_store.enqueue("q", payload, task_id="x")
    publish(conn, "q", {"n": "good"})

    got = consume(conn, ["q"], 1, prefetch=1)
    assert bodies(got) == [{"n": "good"}]
    got[0].ack()
    row = db_store.get_message(bad)
    assert row is not None
    assert (row.state, row.reason, row.lease_owner) == ("dead", "undecodable", None)
    assert row.task_id == "x"
    assert ready(conn, "q") == 0


def test_basic_get_skips_an_undecodable_row(conn: Connection, db_store: Store) -> None:
    conn.default_channel.queue_declare("q")
    bad = db_store.enqueue("q", "not json{", task_id="x")
    publish(conn, "q", {"n": "good"})
    message = get(conn, "q")
    row = db_store.get_message(bad)
    assert row is not None and (row.state, row.reason) == ("dead", "undecodable")
    assert message is not None and message.payload == {"n": "good"}
    message.ack()


def test_undecodable_row_for_a_no_ack_consumer_is_recorded(
    conn: Connection, db_store: Store
) -> None:
    conn.default_channel.queue_declare("q")
    bad = db_store.enqueue("q", "not json{", task_id="x")
    publish(conn, "q", {"n": "good"})
    got = consume(conn, ["q"], 1, no_ack=True)
    assert bodies(got) == [{"n": "good"}]
    # Deleted on fetch like every no-ack row, but the timeline keeps what it was.
    [event] = [e for e in db_store.events(message_id=bad) if e.kind == "undecodable"]
    assert event.data["payload"] == "not json{"


@pytest.mark.timeout(30)
def test_undecodable_body_in_a_valid_envelope_is_kept_dead(
    conn: Connection, db_store: Store
) -> None:
    conn.default_channel.queue_declare("q")
    envelope = {
        "body": 12345,
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": {},
        "properties": {"body_encoding": "base64", "delivery_info": {}},
    }
    bad = db_store.enqueue("q", json.dumps(envelope), task_id="x")
    publish(conn, "q", {"n": "good"})
    try:
        got = consume(conn, ["q"], 1, prefetch=1, timeout=2.0)
    finally:
        heartbeat().drop(m.fence for m in leased_rows(db_store))  # none renewed forever
        row = db_store.get_message(bad)
    assert bodies(got) == [{"n": "good"}]
    got[0].ack()
    assert row is not None
    assert (row.state, row.reason, row.lease_owner) == ("dead", "undecodable", None)


@pytest.mark.timeout(30)
def test_a_failing_callback_does_not_strand_the_rest_of_a_claimed_batch(
    connect: Connect, db_store: Store
) -> None:
    a, b = connect(), connect()
    for n in range(3):
        publish(a, "q", {"n": n})

    def explode(body: Any, message: Message) -> None:
        raise RuntimeError("consumer callback failed")

    try:
        with pytest.raises(RuntimeError, match="callback failed"):
            consume(a, ["q"], 3, prefetch=10, on_message=explode)
        a.release()
        again = [get(b, "q") for _ in range(3)]
    finally:
        heartbeat().drop(m.fence for m in leased_rows(db_store))
    assert all(m is not None for m in again), "messages stranded under a live lease"


def test_oversized_message_is_refused_at_publish(connect: Connect, db_store: Store) -> None:
    conn = connect(max_payload_bytes=2000)
    with pytest.raises(PayloadTooLarge, match="max_payload_bytes"):
        publish(conn, "q", {"blob": "x" * 5000})
    assert rows(db_store) == 0
    publish(conn, "q", {"blob": "small"})
    [message] = consume(conn, ["q"], 1)
    assert message.payload == {"blob": "small"}
    message.ack()


def test_properties_amqp_would_drop_are_dropped_when_they_cannot_be_stored(
    conn: Connection, db_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``before_task_publish`` handler that passes its ``**kwargs`` on to
    ``producer.publish`` (Celery's test_chord_header_id_duplicated_on_rabbitmq_msg_duplication)
    sends the signal object as a message property. RabbitMQ drops keys that are not AMQP
    properties; so does sqlease when such a key cannot be stored. Everything else that cannot
    be stored is refused with the reason."""
    unstorable = object()
    with caplog.at_level(logging.WARNING, logger="sqlease.transport"):
        publish(conn, "q", {"n": 1}, signal=unstorable, sender="kept", correlation_id="c1")
    assert "dropped message properties 'signal'" in caplog.text
    [message] = consume(conn, ["q"], 1)
    assert message.payload == {"n": 1}
    assert message.properties["sender"] == "kept"  # storable: kept, as Kombu's other transports do
    assert message.properties["correlation_id"] == "c1"
    assert "signal" not in message.properties
    message.ack()

    with pytest.raises(ConfigurationError, match="cannot be stored as JSON"):
        publish(conn, "q", {"n": 2}, correlation_id=unstorable)  # an AMQP property
    with pytest.raises(ConfigurationError, match="cannot be stored as JSON"):
        publish(conn, "q", {"n": 3}, headers={"h": unstorable}, signal=unstorable)
    assert rows(db_store, "q") == 0


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("lease_seconds", -1),
        ("lease_seconds", "soon"),
        ("max_attempts", 0),
        ("max_attempts", 1.5),
        ("polling_interval", "x"),
        ("heartbeat_interval", 5),  # not shorter than the lease below
        ("table_prefix", "bad prefix;"),
        ("auto_migrate", "maybe"),
        ("max_payload_bytes", 0),
        ("publish_sync_commit", "later"),
        ("lease_sync_commit", 2),
    ],
)
def test_invalid_transport_option_is_a_configuration_error(
    connect: Connect, option: str, value: Any
) -> None:
    overrides = {option: value}
    if option == "heartbeat_interval":
        overrides["lease_seconds"] = 1
    conn = connect(**overrides)
    with pytest.raises(ConfigurationError, match=option):
        conn.connect()


def test_publish_sync_commit_reaches_the_store_and_loses_nothing(
    connect: Connect, db_url: str
) -> None:
    """``publish_sync_commit: False`` (PostgreSQL: publishes skip the WAL flush wait) is passed
    to the store; what is published is delivered as always, on either database."""
    conn = connect(publish_sync_commit=False)
    store = conn.default_channel.store
    assert store.publish_sync_commit is False
    if db_url.startswith("postgresql"):
        assert store.driver.lane(Lane.PUBLISH) is store.driver.lane(Lane.LEASES)
    for n in range(3):
        publish(conn, "q", {"n": n})
    got = consume(conn, ["q"], 3)
    assert [m.payload["n"] for m in got] == [0, 1, 2]
    for message in got:
        message.ack()


@pytest.mark.parametrize(
    "queue",
    [
        "it's",
        'say "hi"',
        "ünïcödé-キュー",
        "q'; DROP TABLE messages; --",
        "a.b*#|%_\\",
        "x" * 255,
        "é" * 127,
    ],
)
def test_odd_queue_names(conn: Connection, db_store: Store, queue: str) -> None:
    publish(conn, queue, {"n": 1})
    publish(conn, queue, {"n": 2})
    assert ready(conn, queue) == 2
    [message] = consume(conn, [queue], 1, prefetch=1)
    assert message.payload == {"n": 1}
    assert message.delivery_info["routing_key"] == queue
    message.ack()
    assert conn.default_channel.queue_purge(queue) == 1
    conn.default_channel.queue_delete(queue)
    with pytest.raises(kombu.exceptions.ChannelError):
        conn.default_channel.queue_declare(queue, passive=True)
    assert rows(db_store) == 0


@pytest.mark.parametrize("name", ["x" * 256, "é" * 128])
def test_names_longer_than_amqps_are_refused_with_what_was_too_long(
    conn: Connection, db_store: Store, name: str
) -> None:
    """Queue names, exchange names and routing keys hold at most 255 bytes of UTF-8 (AMQP's
    short strings): past that, a clear error names the field, and nothing is stored."""
    channel = conn.default_channel
    with pytest.raises(ConfigurationError, match=r"queue name .* 256 bytes of UTF-8, over 255"):
        channel.queue_declare(name)
    with pytest.raises(ConfigurationError, match=r"exchange name .* over 255"):
        channel.exchange_declare(name, "direct")
    with pytest.raises(ConfigurationError, match=r"queue name .* over 255"):
        channel.basic_consume(name, False, lambda message: None, "tag")  # never declared
    channel.queue_declare("short")
    channel.exchange_declare("ex", "direct")
    with pytest.raises(ConfigurationError, match=r"routing key .* over 255"):
        channel.queue_bind("short", "ex", routing_key=name)
    # A publish to such a queue, through the default exchange, names it and enqueues nothing.
    with pytest.raises(ConfigurationError, match=r"queue name .* the message was not enqueued"):
        db_store.enqueue(name, "{}")
    with pytest.raises(ConfigurationError, match=r"queue name .* the message was not enqueued"):
        conn.Producer().publish({"n": 1}, routing_key=name, serializer="json")
    assert rows(db_store) == 0


# ---- URLs and registration (no database needed, or SQLite by definition) ------------------


def test_bare_url_is_sqlease_db_in_the_working_directory(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    options = {"table_prefix": unique_prefix(), "polling_interval": POLL}
    with Connection("sqlease://", transport_options=options) as conn:
        publish(conn, "q", {"n": 1})
        [message] = consume(conn, ["q"], 1)
        assert message.payload == {"n": 1}
        message.ack()
    assert (tmp_path / "sqlease.db").is_file()


CHDIR = r"""
import os, sys
from kombu import Connection, Queue

for directory in sys.argv[1:]:
    os.chdir(directory)
    with Connection("sqlease://", transport_options={"polling_interval": 0.05}) as conn:
        conn.Producer().publish({"dir": directory}, routing_key="q", declare=[Queue("q")])
"""


@pytest.mark.timeout(60)
def test_bare_url_follows_the_working_directory(tmp_path: Any) -> None:
    # In a fresh process, so this test's engine cache cannot leak into the others.
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", CHDIR, str(one), str(two)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    assert (one / "sqlease.db").is_file()
    assert (two / "sqlease.db").is_file(), "the second publish went to the first directory"


def test_as_uri_masks_the_password() -> None:
    conn = Connection("sqlease+postgresql://u:secret@h/db")
    try:
        assert "secret" not in conn.as_uri()
        assert conn.as_uri() == "sqlease+postgresql://u:**@h/db"
        assert "secret" not in repr(conn)
        assert "secret" in conn.as_uri(include_password=True)
    finally:
        conn.release()
    sqlite = Connection("sqlease+sqlite:////tmp/app.db")
    try:
        assert sqlite.as_uri() == "sqlease+sqlite:////tmp/app.db"
    finally:
        sqlite.release()


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("sqlease+mysql://u:pw@h/db", "mysql"),
        ("sqlease+postgresql+asyncpg://u:pw@h/db", "psycopg"),
        ("sqlease+sqlite://", "in-memory"),
        ("sqlease+sqlite:///:memory:", "in-memory"),
        ("sqlease://somehost/db", "no host"),
    ],
)
def test_unsupported_urls_are_configuration_errors(url: str, match: str) -> None:
    conn = Connection(url)
    try:
        with pytest.raises(ConfigurationError, match=match) as excinfo:
            conn.connect()
        assert ":pw@" not in str(excinfo.value)
    finally:
        conn.release()


def test_transport_is_registered_and_supports_fanout() -> None:
    assert kombu.transport.resolve_transport("sqlease") is Transport
    assert Transport.driver_type != "sql"  # Celery turns events off for 'sql'
    assert "fanout" in Transport.implements.exchange_type
    assert {"direct", "topic"} <= set(Transport.implements.exchange_type)
    conn = Connection("sqlease+sqlite:////tmp/unused.db")
    try:
        assert conn.supports_exchange_type("fanout")
        assert conn.transport_cls == "sqlease"
    finally:
        conn.release()
