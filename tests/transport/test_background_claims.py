"""A busy worker's claims and acks, sent without blocking its event loop (PostgreSQL).

The transport runs in a real Kombu ``Hub`` here, as in a Celery worker: once tasks are held,
the refill claim and the acks waiting with it go out as one statement that the loop sends and
whose rows it reads when the socket is readable (sqlease.transport._loop_calls); with a psycopg
whose statement generator is not there, a background thread runs it instead
(sqlease.transport._background). Every test runs with both. What was claimed is delivered on
the loop's thread. A connection closed while such a claim is under way gives its messages back
at once (guarantees.md, invariant 8), with the attempt refunded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import Connection
from kombu.asynchronous import Hub
from kombu.message import Message

from sqlease import Store
from sqlease._db.driver import Lane
from sqlease.transport._background import BackgroundCalls
from sqlease.transport._loop_calls import LoopCalls

from .test_kombu import _consuming, attempt_of, leased_rows, msg_id, publish, rows

Connect = Callable[..., Connection]

pytestmark = [
    pytest.mark.pg,
    pytest.mark.timeout(60),
    pytest.mark.parametrize("db_url", ["postgresql"], indirect=True),
]


@pytest.fixture(params=["loop", "thread"])
def calls(request: pytest.FixtureRequest) -> str:
    """How the worker's statements go: sent by the loop, or run on a thread."""
    return str(request.param)


@pytest.fixture
def transport_options(transport_options: dict[str, Any], calls: str) -> dict[str, Any]:
    return {**transport_options, "loop_statements": calls == "loop"}


@pytest.fixture
def hub() -> Iterator[Hub]:
    hub = Hub()
    yield hub
    hub.close()


def run_until(hub: Hub, done: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = hub.create_loop()
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the event loop did not get there in time"
        next(loop)


def consuming_worker(connect: Connect, hub: Hub, got: list[Message], prefetch: int = 8) -> Any:
    worker = connect()
    channel = worker.default_channel
    channel.basic_qos(0, prefetch, False)
    _consuming(channel, "work", got)
    worker.transport.register_with_event_loop(worker.connection, hub)
    return worker


def holding_eight(connect: Connect, hub: Hub, published: int) -> tuple[Any, list[Message]]:
    """Publish ``published`` messages; a worker with a prefetch of 8 then holds the first 8."""
    producer = connect()
    for i in range(published):
        publish(producer, "work", {"n": i})
    got: list[Message] = []
    worker = consuming_worker(connect, hub, got)
    run_until(hub, lambda: len(got) == 8)
    return worker, got


def threads_of(
    monkeypatch: pytest.MonkeyPatch,
    target: Any,
    name: str,
    calls: list[tuple[int, Any]] | None = None,
) -> list[tuple[int, Any]]:
    """Record (thread ident, first argument) of every call to ``target.name`` (into
    ``calls``, given one shared by several targets: in the order they were made)."""
    calls = [] if calls is None else calls
    real = getattr(target, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append((threading.get_ident(), args[0] if args else None))
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, recording)
    return calls


def test_a_busy_consumer_refills_off_the_loop_with_its_acks(
    connect: Connect, db_store: Store, hub: Hub, monkeypatch: pytest.MonkeyPatch, calls: str
) -> None:
    worker, got = holding_eight(connect, hub, 12)
    store = worker.transport.store
    assert store.driver.lane(Lane.LEASES) is not None
    plain_acks = threads_of(monkeypatch, store, "ack_op")
    prepared = threads_of(monkeypatch, store, "ack_and_claim_op")
    sent = threads_of(monkeypatch, store.driver.lane(Lane.LEASES), "send")
    blocking = threads_of(monkeypatch, store.driver.lane(Lane.LEASES), "rows")
    for message in got[:4]:
        message.ack()
    run_until(hub, lambda: len(got) == 12)
    loop_thread = threading.get_ident()
    combined = [(thread, fences) for thread, fences in prepared if fences]
    if calls == "loop":
        assert isinstance(worker.transport.fetcher.runner, LoopCalls)
        # Prepared and sent by the loop itself, which never waited for a statement's rows.
        assert sent and all(thread == loop_thread for thread, _ in sent)
        assert store.sql.ack_outside_runs_claim_plain_single in [s for _, s in sent]
        assert blocking == []
        assert combined and all(thread == loop_thread for thread, _ in combined)
    else:
        assert isinstance(worker.transport.fetcher.runner, BackgroundCalls)
        assert sent == []
        assert combined and all(thread != loop_thread for thread, _ in combined)
    acked_with_claims = {f.message_id for _, fences in combined for f in fences}
    acked_alone = {f.message_id for _, fences in plain_acks for f in fences}
    assert acked_with_claims | acked_alone == {msg_id(m) for m in got[:4]}
    assert acked_with_claims, "no ack went with the refill claim"
    # The first four are gone; the other eight are leased, each delivered once.
    assert rows(db_store, "work") == 8
    assert sorted(m.id for m in leased_rows(db_store)) == sorted(msg_id(m) for m in got[4:])
    assert len({msg_id(m) for m in got}) == 12
    for message in got[4:]:
        message.ack()
    run_until(hub, lambda: rows(db_store, "work") == 0)
    # Every ack was answered: none still counts as on its way (an outage would wait for it,
    # and the bookkeeping would grow with every task).
    outage = worker.transport.fetcher.outage
    run_until(hub, lambda: not outage._leaving)
    # The loop (or the thread) kept one connection for its statements, given back at close.
    fast = store.driver.lane(Lane.LEASES)
    assert fast is not None
    pool = fast._engine.pool
    assert worker.transport.fetcher.runner is not None
    spares = fast.spares_kept()  # kept by the engine for one-statement calls
    assert pool.checkedout() >= 1 + spares  # type: ignore[attr-defined]
    worker.release()
    assert pool.checkedout() == store.driver.lane(Lane.LEASES).spares_kept()  # type: ignore[attr-defined]


def test_closing_while_a_background_claim_runs_gives_its_messages_back(
    connect: Connect, db_store: Store, hub: Hub, monkeypatch: pytest.MonkeyPatch, calls: str
) -> None:
    worker, got = holding_eight(connect, hub, 12)
    store = worker.transport.store
    entered, gate = threading.Event(), threading.Event()
    if calls == "loop":
        # The statement goes out, but the loop does not get to read its rows before closing.
        real_send = store.driver.lane(Lane.LEASES).send

        def sent(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            return real_send(*args, **kwargs)

        monkeypatch.setattr(store.driver.lane(Lane.LEASES), "send", sent)
        monkeypatch.setattr(LoopCalls, "_on_socket", lambda self: None)
    else:
        real = store.ack_and_claim_op

        def slow(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                entered.set()
                gate.wait(10)
            return real(*args, **kwargs)

        monkeypatch.setattr(store, "ack_and_claim_op", slow)
        threading.Timer(0.3, gate.set).start()
    for message in got[:4]:
        message.ack()
    run_until(hub, entered.is_set)
    worker.release()  # waits for the claim, then gives back what it leased
    monkeypatch.undo()  # the next worker reads its rows
    assert len(got) == 8, "a message was delivered to a closing connection"
    # The four acks went through; the four still held and the four just claimed are ready
    # again at once (no lease left behind), their attempt refunded.
    assert rows(db_store, "work") == 8 and leased_rows(db_store) == []
    assert db_store.size("work") == 8
    again: list[Message] = []
    other = consuming_worker(connect, hub, again, prefetch=16)
    run_until(hub, lambda: len(again) == 8)
    assert {msg_id(m) for m in again}.isdisjoint(msg_id(m) for m in got[:4])
    budgets = [db_store.get_message(msg_id(m)) for m in again]
    assert all(b is not None and b.max_attempts - b.attempt >= 2 for b in budgets)
    assert {attempt_of(m) for m in again} <= {1, 2}
    other.release()


def test_a_background_claim_without_acks_reports_the_queue_drained(
    connect: Connect, hub: Hub, calls: str
) -> None:
    """A short background claim that carried no acks saw the queue as it is: drained (so the
    worker makes no more claims until something can be ready). One that carried acks is
    never taken as drained: it may not have seen them free a run's next message."""
    worker, got = holding_eight(connect, hub, 10)
    fetcher, channel = worker.transport.fetcher, worker.default_channel
    channel.basic_qos(0, 16, False)  # room for what the claims below bring
    fetcher.claim(channel, ["work"], 4)
    run_until(hub, lambda: not channel.look.claiming)
    assert len(got) == 10 and channel.look.known_empty
    got[0].ack()
    fetcher.acks.flush()  # written on the runner, reported in the loop
    assert fetcher.acks.pending == []
    run_until(hub, lambda: not fetcher.runner.pending)
    got[1].ack()
    assert fetcher.acks.pending  # deferred: goes with the next claim
    fetcher.claim(channel, ["work"], 4)
    run_until(hub, lambda: not channel.look.claiming)
    assert len(got) == 10 and not channel.look.known_empty
    worker.release()


def test_a_claim_that_stops_in_front_of_a_run_claims_again_at_once(
    connect: Connect, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's claim of plain messages stops in front of a run's head; the worker
    claims again at once with the full claim (not a polling interval later), and delivers
    in publish order."""
    producer = connect()
    publish(producer, "work", {"n": "a"})
    publish(producer, "work", {"n": "r1"}, headers={"run_id": "R"})
    publish(producer, "work", {"n": "b"})
    publish(producer, "work", {"n": "r2"}, headers={"run_id": "R"})
    got: list[Message] = []
    worker = consuming_worker(connect, hub, got)
    store = worker.transport.store
    # Every statement the worker sends or runs, on every lane, in the order they were made.
    lanes = {id(store.driver.lane(x)): store.driver.lane(x) for x in Lane}.values()
    recorded: list[tuple[int, Any]] = []
    for lane in lanes:
        for how in ("send", "rows"):
            threads_of(monkeypatch, lane, how, recorded)
    started = time.monotonic()
    run_until(hub, lambda: len(got) == 3, timeout=5.0)
    # Well within the polling interval (1 s): the second claim did not wait for it.
    assert time.monotonic() - started < 0.9
    assert [m.payload["n"] for m in got] == ["a", "r1", "b"]
    statements = [s for _, s in recorded]
    # The plain claim, then at once the full one: no offer or idle look between them.
    texts = [str(getattr(x, "text", x))[:60] for x in statements]
    first = statements.index(store.sql.claim_plain_single)
    assert statements[first + 1] == store.sql.claim_single, texts
    # r2 waits for r1's ack, then comes.
    got[1].ack()
    run_until(hub, lambda: len(got) == 4)
    assert got[3].payload["n"] == "r2"
    worker.release()
