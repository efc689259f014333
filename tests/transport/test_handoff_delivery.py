"""Handoff through the transport in a real Kombu ``Hub`` (PostgreSQL): an idle consumer offers
to take its queue's next message, a publish leases it to the consumer and the notification
delivers it, with no claim statement in between. A consumer closed before it read such a
notification gives the message back at once, attempt refunded."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from kombu import Connection
from kombu.asynchronous import Hub
from kombu.message import Message
from sqlalchemy import select

from sqlease import Store
from sqlease.transport import OFFER_KEY

from .test_background_claims import consuming_worker, hub, run_until, threads_of
from .test_kombu import _consuming, attempt_of, msg_id, publish, rows

Connect = Callable[..., Connection]

__all__ = ["hub"]  # the fixture, imported for these tests

pytestmark = [
    pytest.mark.pg,
    pytest.mark.timeout(60),
    pytest.mark.parametrize("db_url", ["postgresql"], indirect=True),
]


def offered_queues(store: Store, owner: str) -> set[str]:
    """The queues ``owner`` has a live offer for (one a publish could use)."""
    offers = store.tables.offers
    with store.engine.connect() as c:
        live = (offers.c.owner == owner) & offers.c.handed.is_(False)
        return set(c.execute(select(offers.c.queue).where(live)).scalars())


def idle_worker(connect: Connect, hub: Hub, got: list[Message], **options: Any) -> Any:
    """A consumer on "work" that has looked, found nothing, and (handoff on) offered."""
    producer = connect()
    publish(producer, "work", {"n": "declare"})  # declares the queue; consumed below
    worker = consuming_worker(_with(connect, options), hub, got)
    run_until(hub, lambda: len(got) == 1)
    got.pop().ack()
    return worker


def _with(connect: Connect, options: dict[str, Any]) -> Connect:
    return lambda **more: connect(**{**options, **more})


def test_an_idle_consumer_gets_a_published_message_without_claiming(
    connect: Connect, db_store: Store, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    got: list[Message] = []
    # No safety poll during the test: its claim (finding nothing) would be counted below.
    worker = idle_worker(connect, hub, got, polling_interval=30)
    transport = worker.transport
    run_until(hub, lambda: offered_queues(db_store, transport.owner) == {"work"})
    claims = threads_of(monkeypatch, transport.store, "claim")
    combined = threads_of(monkeypatch, transport.store, "ack_and_claim_op")

    publish(connect(), "work", {"n": 1})
    run_until(hub, lambda: len(got) == 1)
    [message] = got
    assert message.payload == {"n": 1}
    assert attempt_of(message) == 1 and not message.delivery_info["redelivered"]
    assert claims == [] and combined == []  # handed over, not claimed
    # Taken while idle: its final result is to put the worker's next offer back.
    assert message.delivery_info[OFFER_KEY] == {
        "queues": ["work"],
        "lease_ms": transport.options.lease_ms,
        "lock_key": transport.lock_key,
        "ttl_ms": transport.handoffs.ttl_ms(),
        "seen": {"work": transport.handoffs.heard["work"]},  # this handoff, heard
    }
    assert offered_queues(db_store, transport.owner) == set()  # the offer was used up
    kinds = [e.kind for e in db_store.events(message_id=msg_id(message))]
    assert kinds == ["claimed"]  # (no "enqueued": a Kombu message without a task id)
    message.ack()
    # After the ack the idle look offers again, and the next publish is handed over too.
    run_until(hub, lambda: offered_queues(db_store, transport.owner) == {"work"})
    assert rows(db_store, "work") == 0
    publish(connect(), "work", {"n": 2})
    run_until(hub, lambda: len(got) == 2)
    assert claims == [] and got[1].payload == {"n": 2}
    [event] = [e for e in db_store.events(message_id=msg_id(got[1])) if e.kind == "claimed"]
    assert event.data == {"owner": transport.owner, "handoff": True}
    got[1].ack()
    run_until(hub, lambda: rows(db_store, "work") == 0)


def test_a_handoff_not_yet_read_at_close_is_released_with_the_attempt_refunded(
    connect: Connect, db_store: Store, hub: Hub
) -> None:
    got: list[Message] = []
    worker = idle_worker(connect, hub, got)
    owner = worker.transport.owner
    run_until(hub, lambda: offered_queues(db_store, owner) == {"work"})
    publish(connect(), "work", {"n": 1})  # handed over; the loop never runs to read it
    [row] = [m for m in _work_rows(db_store) if m.lease_owner is not None]
    assert row.lease_owner == owner and row.attempt == 1
    worker.release()
    assert got == []
    after = db_store.get_message(row.id)
    assert after is not None and after.lease_owner is None and after.state == "ready"
    assert offered_queues(db_store, owner) == set()
    released = [e for e in db_store.events(message_id=row.id) if e.kind == "released"]
    assert [e.data for e in released] == [{"delay_ms": 0, "refund": True}]
    [claimed] = db_store.claim(["work"], "next", lease_ms=5_000)
    assert claimed.id == row.id


def test_with_handoff_off_an_idle_consumer_claims(
    connect: Connect, db_store: Store, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    got: list[Message] = []
    worker = idle_worker(connect, hub, got, handoff=False)
    claims = threads_of(monkeypatch, worker.transport.store, "ack_and_claim_op")
    publish(connect(), "work", {"n": 1})
    run_until(hub, lambda: len(got) == 1)
    assert claims and offered_queues(db_store, worker.transport.owner) == set()
    got[0].ack()


def _work_rows(store: Store) -> list[Any]:
    table = store.tables.messages
    with store.engine.connect() as c:
        ids = c.execute(select(table.c.id).where(table.c.queue == "work")).scalars().all()
    return [store.get_message(int(i)) for i in ids]


def test_a_consumer_that_holds_a_message_withdraws_its_offer(
    connect: Connect, db_store: Store, hub: Hub
) -> None:
    """A busy (or stalled) worker must not be handed what another could start now: only a
    consumer holding nothing offers."""
    got: list[Message] = []
    worker = idle_worker(connect, hub, got)
    owner = worker.transport.owner
    run_until(hub, lambda: offered_queues(db_store, owner) == {"work"})
    publish(connect(), "work", {"n": 1})
    run_until(hub, lambda: len(got) == 1)  # handed over: the offer is used up
    for _ in range(3):  # safety polls while the message is held: no new offer
        polls = worker.transport.loop.poll_timer
        run_until(hub, lambda p=polls: worker.transport.loop.poll_timer is not p)
        assert offered_queues(db_store, owner) == set()
    publish(connect(), "work", {"n": 2})  # not handed over: ready for any worker
    [other] = db_store.claim(["work"], "other", lease_ms=5_000)
    assert other.attempt == 1 and other.id != msg_id(got[0])
    got[0].ack()


def test_the_ack_that_leaves_a_consumer_idle_carries_its_next_offer(
    connect: Connect, db_store: Store, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One statement acks the last held message and offers again, so a publish right after a
    task finished is handed over too; no separate offer or claim follows the ack. The
    handed delivery is known to be outside any run, so that statement holds no run's
    promotion."""
    got: list[Message] = []
    worker = idle_worker(connect, hub, got, polling_interval=30)  # no safety poll meanwhile
    transport = worker.transport
    driver, statements = transport.store.driver, []
    offer_ack = driver.offer_ack

    def noting(fences: Any, offer: Any) -> Any:
        op = offer_ack(fences, offer)
        statements.append(op.statement)
        return op

    monkeypatch.setattr(driver, "offer_ack", noting)
    run_until(hub, lambda: offered_queues(db_store, transport.owner) == {"work"})
    publish(connect(), "work", {"n": 1})
    run_until(hub, lambda: len(got) == 1)
    assert offered_queues(db_store, transport.owner) == set()
    combined = threads_of(monkeypatch, transport.store, "offer_op")
    offers = threads_of(monkeypatch, transport.store, "offer")
    plain_acks = threads_of(monkeypatch, transport.store, "ack_op")
    claims = threads_of(monkeypatch, transport.store, "ack_and_claim_op")
    got[0].ack()
    run_until(hub, lambda: offered_queues(db_store, transport.owner) == {"work"})
    assert [[f.message_id for f in fences] for _, fences in combined] == [[msg_id(got[0])]]
    assert statements == [transport.store.sql.ack_outside_runs_offer]
    # The offer's answer answers its ack too: no longer on its way.
    run_until(hub, lambda: not transport.fetcher.outage._leaving)
    for _ in range(3):  # what the loop's next iterations run: they look no further
        transport.wakeups.on_kick()
        transport.wakeups.on_tick()
    assert len(combined) == 1 and offers == [] and plain_acks == [] and claims == []
    publish(connect(), "work", {"n": 2})
    run_until(hub, lambda: len(got) == 2)
    assert claims == [] and attempt_of(got[1]) == 1
    got[1].ack()


def test_a_remote_control_message_notified_with_a_handoff_is_delivered_first(
    connect: Connect, db_store: Store, hub: Hub
) -> None:
    """A revoke broadcast just before a task's publish must reach Celery before the task,
    also when both notifications are read at once (their payloads' order is not kept)."""
    got: list[Message] = []
    worker = idle_worker(connect, hub, got, polling_interval=30)
    transport = worker.transport
    _consuming(worker.default_channel, "ctl", got, no_ack=True)
    run_until(hub, lambda: offered_queues(db_store, transport.owner) == {"work"})
    producer = connect()
    publish(producer, "ctl", {"revoke": "x"})
    publish(producer, "work", {"n": 1})  # handed over
    time.sleep(0.3)  # both notifications are waiting on the LISTEN socket
    transport.wakeups.on_readable()
    run_until(hub, lambda: len(got) == 2)
    assert [m.payload for m in got] == [{"revoke": "x"}, {"n": 1}]
    got[1].ack()


def test_only_a_lone_delivery_of_an_idle_worker_asks_its_result_for_an_offer(
    connect: Connect, db_store: Store, hub: Hub
) -> None:
    producer = connect()
    for n in range(3):
        publish(producer, "work", {"n": n})
    got: list[Message] = []
    consuming_worker(connect, hub, got)
    run_until(hub, lambda: len(got) == 3)  # one claim of three: not a lone delivery
    assert [OFFER_KEY in m.delivery_info for m in got] == [False, False, False]
    for message in got:
        message.ack()


def test_an_idle_look_before_the_handoff_is_read_does_not_offer_again(
    connect: Connect, db_store: Store, hub: Hub
) -> None:
    """The race a CI run hit: a publish used the idle worker's offer, and the worker's next
    idle look ran before it read that notification. Still idle as far as it knew, it offered
    again, and the next publish was handed to it too, past its prefetch of one."""
    got: list[Message] = []
    worker = idle_worker(connect, hub, got, polling_interval=30)
    transport = worker.transport
    worker.default_channel.basic_qos(0, 1, False)
    run_until(hub, lambda: offered_queues(db_store, transport.owner) == {"work"})
    producer = connect()
    publish(producer, "work", {"n": 1})  # handed over; the loop has not read it yet
    assert transport.handoffs.holds_nothing()
    transport.fetcher.look_ahead()  # the idle look, as the safety poll runs it
    assert transport.fetcher.runner.wait_idle(5)  # its offer written; nothing read yet
    publish(producer, "work", {"n": 2})
    second = [m for m in _work_rows(db_store) if m.lease_owner is None]
    assert len(second) == 1  # ready for any worker, not handed to this busy one
    run_until(hub, lambda: len(got) == 1)
    assert got[0].payload == {"n": 1}
    time.sleep(0.2)
    hub.run_once()
    assert len(got) == 1  # its prefetch of one holds
    got[0].ack()
    run_until(hub, lambda: len(got) == 2)  # the ack freed the credit: the second comes
    assert got[1].payload == {"n": 2}
    got[1].ack()
    # Having heard the handoff, the worker's offers stand again.
    run_until(hub, lambda: offered_queues(db_store, transport.owner) == {"work"})


def test_after_relistening_the_offers_used_meanwhile_are_made_afresh(
    connect: Connect, db_store: Store, hub: Hub
) -> None:
    """A handoff whose notification went to a listening connection that broke is never
    heard; the offer it used would never stand again. A new listening connection clears
    such offers (none can be used while no connection holds the lock), and the idle look
    offers afresh; the message itself comes back when its lease expires."""
    got: list[Message] = []
    worker = idle_worker(connect, hub, got, polling_interval=0.2)
    transport = worker.transport
    run_until(hub, lambda: offered_queues(db_store, transport.owner) == {"work"})
    publish(connect(), "work", {"n": 1})  # handed over, never read
    assert offered_queues(db_store, transport.owner) == set()
    transport.loop.remove_reader()  # the listening connection breaks, its notification lost
    transport.waker._drop()
    run_until(hub, lambda: offered_queues(db_store, transport.owner) == {"work"})
    assert got == []
    [row] = [m for m in _work_rows(db_store) if m.lease_owner is not None]
    assert row.lease_owner == transport.owner  # until its lease expires


def test_a_ttl_of_zero_reaches_an_idle_consumer_by_handoff(
    connect: Connect, db_store: Store, hub: Hub
) -> None:
    # AMQP: a TTL of 0 expires a message "unless it can be delivered to a consumer at once".
    # A handoff leases it in the publish itself: delivered, not expired.
    got: list[Message] = []
    worker = idle_worker(connect, hub, got, polling_interval=30)
    run_until(hub, lambda: offered_queues(db_store, worker.transport.owner) == {"work"})
    publish(connect(), "work", {"n": "now or never"}, expiration=0)
    run_until(hub, lambda: len(got) == 1)
    [message] = got
    assert message.payload == {"n": "now or never"}
    [event] = [e for e in db_store.events(message_id=msg_id(message)) if e.kind == "claimed"]
    assert event.data == {"owner": worker.transport.owner, "handoff": True}
    message.ack()
    run_until(hub, lambda: rows(db_store, "work") == 0)


def test_a_handoff_past_the_prefetch_limit_is_given_back(
    connect: Connect, db_store: Store, hub: Hub
) -> None:
    """An offer can stand for a moment after a claim filled the worker (a publish raced its
    first look; the offer goes at the next idle look). A publish that uses it hands the
    message to a consumer with no prefetch credit left: it gives the message back at once,
    attempt refunded, ready for another worker (and for a purge)."""
    got: list[Message] = []
    producer = connect()
    publish(producer, "work", {"n": "declare"})
    worker = consuming_worker(_with(connect, {"polling_interval": 30}), hub, got, prefetch=1)
    run_until(hub, lambda: len(got) == 1)
    got.pop().ack()
    owner = worker.transport.owner
    run_until(hub, lambda: offered_queues(db_store, owner) == {"work"})
    publish(connect(), "work", {"n": 1})
    run_until(hub, lambda: len(got) == 1)  # handed over: held, the offer used up
    offers = db_store.tables.offers
    with db_store.engine.begin() as c:  # the offer standing again while the message is held
        c.execute(offers.update().where(offers.c.owner == owner).values(handed=False))
    publish(connect(), "work", {"n": 2})
    [second] = [m for m in _work_rows(db_store) if m.id != msg_id(got[0])]

    def given_back() -> bool:
        row = db_store.get_message(second.id)
        return row is not None and row.lease_owner is None

    run_until(hub, given_back)
    assert len(got) == 1
    released = [e for e in db_store.events(message_id=second.id) if e.kind == "released"]
    assert [e.data for e in released] == [{"delay_ms": 0, "refund": True}]
    [other] = db_store.claim(["work"], "other", lease_ms=5_000)
    assert other.id == second.id
    got[0].ack()


def test_a_handoff_during_a_claim_is_kept_and_the_claims_surplus_given_back(
    connect: Connect,
    db_store: Store,
    hub: Hub,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handoff can arrive while a claim sized by the credit is under way (its offer still
    stood). The handoff is delivered, with its attempt; what the claim then brings beyond
    the credit is given back, attempt refunded: the worker never holds more than its
    prefetch. (Before, the claim's message came too: two held with a prefetch of one.)"""
    caplog.set_level(logging.INFO, logger="sqlease.transport._claims")
    got: list[Message] = []
    options = {"polling_interval": 30, "loop_statements": False}
    producer = connect()
    publish(producer, "work", {"n": "declare"})
    worker = consuming_worker(_with(connect, options), hub, got, prefetch=1)
    run_until(hub, lambda: len(got) == 1)
    got.pop().ack()
    transport, channel = worker.transport, worker.default_channel
    run_until(hub, lambda: offered_queues(db_store, transport.owner) == {"work"})
    run_until(hub, lambda: not transport.fetcher.runner.pending)  # (its last look answered)
    store = transport.store
    real, entered, gate = store.ack_and_claim_op, threading.Event(), threading.Event()

    def held_up(*args: Any, **kwargs: Any) -> Any:  # (the runner's thread)
        entered.set()
        gate.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "ack_and_claim_op", held_up)
    transport.fetcher.claim(channel, ["work"], 1)  # as a notification's look would
    run_until(hub, entered.is_set)
    publish(producer, "work", {"n": 1})  # handed over: the offer still stood
    run_until(hub, lambda: len(got) == 1)
    assert got[0].payload == {"n": 1} and attempt_of(got[0]) == 1
    publish(producer, "work", {"n": 2})  # ready: the offer was used up
    [second] = [m for m in _work_rows(db_store) if m.id != msg_id(got[0])]

    def released() -> list[Any]:
        events = db_store.events(message_id=second.id)
        return [e.data for e in events if e.kind == "released"]

    gate.set()  # the claim takes the second, beyond the credit: given back
    run_until(hub, lambda: len(got) > 1 or released() != [])
    assert len(got) == 1 and channel.qos.unacked_count() == 1
    assert released() == [{"delay_ms": 0, "refund": True}]
    assert "beyond the consumer's credit" in caplog.text
    row = db_store.get_message(second.id)
    assert row is not None and row.lease_owner is None and row.state == "ready"
    got.pop().ack()
    run_until(hub, lambda: len(got) == 1)
    assert got[0].payload == {"n": 2}
    got.pop().ack()
    run_until(hub, lambda: rows(db_store, "work") == 0)
    worker.release()


def test_a_redelivery_being_settled_counts_against_the_credit(
    connect: Connect, db_store: Store, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redelivered message is checked for a stored result off the loop before it is
    delivered. Until then it holds its credit: nothing else is claimed or accepted for a
    consumer with a prefetch of one, and once delivered it is the only message held."""
    from sqlease.transport import _deliveries

    producer = connect()
    publish(producer, "work", {"n": 1}, headers={"id": "task-1"})  # a task, with its id
    [gone] = db_store.claim(["work"], "gone:1:x", lease_ms=1, limit=1)  # a worker vanished
    publish(producer, "work", {"n": 2}, headers={"id": "task-2"})
    real, entered, gate = _deliveries.settle_redelivered, threading.Event(), threading.Event()

    def held_up(*args: Any) -> Any:  # (the side thread)
        entered.set()
        gate.wait(10)
        return real(*args)

    monkeypatch.setattr(_deliveries, "settle_redelivered", held_up)
    time.sleep(0.01)  # its lease of 1 ms ran out
    got: list[Message] = []
    worker = consuming_worker(_with(connect, {"polling_interval": 30}), hub, got, prefetch=1)
    channel = worker.default_channel
    run_until(hub, entered.is_set)
    deadline = time.monotonic() + 0.5
    run_until(hub, lambda: time.monotonic() > deadline or got != [])  # the loop goes on
    waiting = db_store.get_message(msg_id_of(db_store, 2))
    assert got == [] and waiting is not None and waiting.lease_owner is None
    assert channel.qos.settling == 1 and not channel.qos.can_consume()
    gate.set()
    run_until(hub, lambda: len(got) == 1)
    assert got[0].payload == {"n": 1} and attempt_of(got[0]) == 2
    assert channel.qos.settling == 0 and channel.qos.unacked_count() == 1
    got.pop().ack()
    run_until(hub, lambda: len(got) == 1)
    assert got[0].payload == {"n": 2}
    got.pop().ack()
    run_until(hub, lambda: rows(db_store, "work") == 0)
    assert gone.attempt == 1
    worker.release()


def msg_id_of(store: Store, n: int) -> int:
    """The id of the message on "work" whose payload is ``{"n": n}``."""
    [found] = [m.id for m in _work_rows(store) if f'"n": {n}' in _body(m)]
    return found


def _body(message: Any) -> str:
    import base64
    import json

    return base64.b64decode(json.loads(message.payload)["body"]).decode()
