"""A delivery whose channel or connection goes away, on SQLite and PostgreSQL: an ack after the
close, a connection dropped without ``close()``, a delivery whose result was stored as its
channel closed; header values of the types Kombu's JSON
carries; a SQLite file that cannot be opened."""

from __future__ import annotations

import decimal
import gc
import logging
import time
import uuid
import weakref
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from amqp.exceptions import RecoverableConnectionError
from kombu import Connection, Exchange

from sqlease import ConfigurationError, Store
from sqlease._core.heartbeat import heartbeat
from sqlease.transport import fence_of

from .test_kombu import Connect, attempt_of, consume, get, msg_id, publish, wait_get


@pytest.mark.parametrize("close", ["channel", "connection"])
def test_an_ack_after_the_close_is_a_connection_error_and_the_message_comes_back(
    connect: Connect, db_store: Store, close: str
) -> None:
    conn, other = connect(), connect()
    publish(conn, "q", {"n": 1})
    channel = conn.channel()
    [held] = consume(conn, ["q"], 1, prefetch=1, channel=channel)
    if close == "channel":
        channel.close()
    else:
        conn.release()

    with pytest.raises(RecoverableConnectionError, match="given back when its channel closed"):
        held.ack()
    # One of the transport's connection errors: Celery's ack_log_error logs it.
    assert isinstance(RecoverableConnectionError(), other.connection_errors)
    held.ack_log_error(logging.getLogger("test"), other.connection_errors)

    again = get(other, "q")
    assert again is not None and msg_id(again) == msg_id(held)
    assert again.delivery_info["redelivered"] is True and attempt_of(again) == 2
    again.ack()


def test_a_connection_dropped_unclosed_gives_its_messages_back(
    broker_url: str,
    transport_options: dict[str, Any],
    connect: Connect,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Kombu's own finalizer kept a channel's QoS, and with it the connection, alive for the
    life of the process, and the heartbeat renewed its leases all that time."""
    leaked = Connection(broker_url, transport_options=transport_options)
    publish(leaked, "q", {"n": 1})
    [held] = consume(leaked, ["q"], 1, prefetch=1)
    fence = fence_of(held.delivery_info)
    assert fence is not None and heartbeat().holds(fence)
    collected = weakref.ref(leaked.connection)
    del held, leaked
    gc.collect()
    assert collected() is None

    with caplog.at_level(logging.WARNING, logger="sqlease"):
        heartbeat().beat()  # what the heartbeat's thread does at its next interval
        # The heartbeat's own thread may be in the middle of a beat that found the holder
        # first: it logs once its renewals are done.
        deadline = time.monotonic() + 5.0
        while "garbage-collected without being closed are given back" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.01)
    assert not heartbeat().holds(fence)
    # Within 2 s, where the lease is 60 s: given back, not run out. (Not asked only once: a
    # busy CI machine once answered None to a get made right after the give-back.)
    again = wait_get(connect(), "q", timeout=2.0)
    assert msg_id(again) == fence.message_id
    assert again.delivery_info["redelivered"] is True
    again.ack()


def test_an_open_connection_keeps_its_leases_through_a_collection(conn: Connection) -> None:
    publish(conn, "q", {"n": 1})
    [held] = consume(conn, ["q"], 1, prefetch=1)
    fence = fence_of(held.delivery_info)
    assert fence is not None
    del held  # the channel still holds it unacked
    gc.collect()
    heartbeat().beat()
    assert heartbeat().holds(fence)


def test_header_values_of_kombus_json_types_come_back_as_they_went(conn: Connection) -> None:
    """As through Kombu's Redis transport (RabbitMQ's tables carry most of them too)."""
    headers = {
        "at": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        "amount": decimal.Decimal("1.50"),
        "ref": uuid.UUID(int=7),
        "raw": b"\x00\xffraw",
        "plain": [1, "two"],
    }
    publish(conn, "q", {"n": 1}, headers=headers)
    [message] = consume(conn, ["q"], 1, prefetch=1)
    assert {k: message.headers[k] for k in headers} == headers
    assert message.payload == {"n": 1}
    message.ack()


def test_a_header_value_no_json_can_carry_is_refused_by_name(conn: Connection) -> None:
    with pytest.raises(Exception, match="cannot be stored as JSON") as refused:
        publish(conn, "q", {"n": 1}, headers={"handler": object()})
    assert "'q'" in str(refused.value)


def test_a_sqlite_file_that_cannot_be_opened_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "app.db"
    conn = Connection(f"sqlease+sqlite:///{missing}", transport_options={"polling_interval": 1})
    try:
        with pytest.raises(Exception) as failed:
            conn.connect()
        assert str(missing) in str(failed.value)
        assert f"its directory {missing.parent} does not exist" in str(failed.value)
    finally:
        conn.release()


def test_a_headers_exchange_is_refused_at_its_declaration(conn: Connection) -> None:
    """Kombu's virtual transport took it and failed at the first bind with ``KeyError``."""
    with pytest.raises(ConfigurationError, match="'hx': type 'headers' is not supported"):
        Exchange("hx", "headers")(conn.default_channel).declare()
    Exchange("tx", "topic")(conn.default_channel).declare()  # the supported types still are


def test_a_closing_channel_acks_a_delivery_whose_result_is_stored(
    conn: Connection, db_store: Store
) -> None:
    """Celery stops its consumer before its pool: a task that stored its result as the
    channel closed has its ack still on its way. Given back, it waited for its next worker
    (its state "queued" until then); it is acked as that worker would, from its result."""
    from sqlease._core.results import ResultStore

    publish(conn, "q", {"n": 1}, headers={"id": "finished"})
    publish(conn, "q", {"n": 2}, headers={"id": "running"})
    channel = conn.channel()
    finished, running = consume(conn, ["q"], 2, prefetch=2, channel=channel)
    fence = fence_of(finished.delivery_info)
    assert fence is not None
    ResultStore(db_store).put(
        "celery-task-meta-finished", b"{}", state="SUCCESS", task_id="finished", fence=fence
    )
    channel.close()

    assert db_store.get_message(msg_id(finished)) is None  # acked
    kinds = [e.kind for e in db_store.events(task_id="finished")]
    assert kinds[-1] == "completed_from_stored_outcome", kinds
    row = db_store.get_message(msg_id(running))
    assert row is not None and (row.state, row.lease_owner) == ("ready", None)  # given back
