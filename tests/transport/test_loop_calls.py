"""sqlease.transport._loop_calls on its own (PostgreSQL): statements a Kombu ``Hub`` sends and reads
without waiting for them, on one kept connection; errors come back as outcomes, as the
background thread's do, and a dropped connection is replaced."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from kombu.asynchronous import Hub
from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from conftest import unique_prefix
from e2e.tcp_proxy import StallingProxy
from sqlease._db.driver import Claim, Lane, Op
from sqlease._db.postgresql.direct import NONBLOCKING, DirectLane
from sqlease.store import Fence, NewMessage, Store
from sqlease.transport import _loop_calls as loop_calls
from sqlease.transport._background import Done, Job
from sqlease.transport._loop_calls import LoopCalls

from .test_background_claims import hub, run_until

__all__ = ["hub"]  # the fixture, shared

pytestmark = [
    pytest.mark.pg,
    pytest.mark.timeout(60),
    pytest.mark.skipif(not NONBLOCKING, reason="this psycopg has no statement generator"),
]

DIVISION_BY_ZERO = text("SELECT 1 / (SELECT count(*) FROM (SELECT 1 WHERE false) s)")


@pytest.fixture
def store(pg_database_url: str) -> Store:
    store = Store(pg_database_url, table_prefix=unique_prefix())
    assert store.driver.lane(Lane.LEASES) is not None
    store.driver.lane(
        Lane.LEASES
    )._engine.dispose()  # process-wide: an earlier test may have killed it
    return store


def acks(store: Store) -> Callable[[list[Job]], tuple[Op[list[Done]], list[Job]]]:
    """Each job's context holds fences: the first waiting job's acked in one statement."""

    def prepare(jobs: list[Job]) -> tuple[Op[list[Done]], list[Job]]:
        job = jobs[0]
        op = store.ack_op(job.context["fences"])
        return op.then(lambda acked: [Done(job.key, value=acked)]), [job]

    return prepare


def fails(store: Store) -> Callable[[list[Job]], tuple[Op[list[Done]], list[Job]]]:
    def prepare(jobs: list[Job]) -> tuple[Op[list[Done]], list[Job]]:
        job = jobs[0]
        return Op(Lane.LEASES, DIVISION_BY_ZERO, {}, lambda rows: [Done(job.key)]), [job]

    return prepare


def leased(store: Store, count: int) -> list[Fence]:
    store.enqueue_many([NewMessage(queue="q", payload=str(i)) for i in range(count)])
    return [m.fence for m in store.claim(["q"], "w", lease_ms=60_000, limit=count)]


def backend_pid(calls: LoopCalls) -> int:
    driver = calls._line(Lane.LEASES)._fairy.driver_connection
    assert isinstance(driver, psycopg.Connection)
    return int(driver.info.backend_pid)


def test_the_loop_sends_the_statement_and_reads_its_rows_when_they_come(
    store: Store, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert store.driver.lane(Lane.LEASES) is not None
    first, second, third = leased(store, 3)
    blocking: list[Any] = []
    monkeypatch.setattr(DirectLane, "rows", lambda *a, **k: blocking.append(a))
    notified: list[int] = []
    calls = LoopCalls(hub, store.driver, acks(store), lambda: notified.append(1))
    calls.submit("a", fences=[first])
    calls.submit("b", fences=[second, third])  # waits: one statement at a time
    assert calls.pending and calls.collect() == []
    run_until(hub, lambda: len(notified) == 2)
    outcomes = calls.collect()
    assert [o.key for o in outcomes] == ["a", "b"]
    assert outcomes[0].value == {first.message_id}
    assert outcomes[1].value == {second.message_id, third.message_id}
    assert not calls.pending and blocking == []
    monkeypatch.undo()
    assert store.size("q") == 0 and store.get_message(first.message_id) is None
    pool = store.driver.lane(Lane.LEASES)._engine.pool
    spares = store.driver.lane(Lane.LEASES).spares_kept()  # the engine's, for one-statement calls
    assert pool.checkedout() == 1 + spares  # type: ignore[attr-defined]  # kept between statements
    calls.stop()
    assert pool.checkedout() == spares  # type: ignore[attr-defined]


def test_wait_idle_finishes_what_is_under_way_without_the_loop(store: Store, hub: Hub) -> None:
    assert store.driver.lane(Lane.LEASES) is not None
    calls = LoopCalls(hub, store.driver, acks(store), lambda: None)
    fences = leased(store, 2)
    calls.submit("a", fences=fences[:1])
    calls.submit("b", fences=fences[1:])
    assert calls.wait_idle(10)
    assert [o.value for o in calls.collect()] == [{fences[0].message_id}, {fences[1].message_id}]
    calls.stop()


def test_a_statement_error_is_the_outcome_and_the_connection_is_kept(
    store: Store, hub: Hub
) -> None:
    assert store.driver.lane(Lane.LEASES) is not None
    calls = LoopCalls(hub, store.driver, fails(store), lambda: None)
    calls.submit("a")
    calls.submit("b")
    run_until(hub, lambda: len(calls._done) == 2)
    outcomes = calls.collect()
    assert len(outcomes) == 2
    assert all(isinstance(o.error, sa_exc.DataError) for o in outcomes)
    # Given back on the failure, as the pinned path does.
    assert not calls._line(Lane.LEASES).holds_connection
    calls.stop()
    pool = store.driver.lane(Lane.LEASES)._engine.pool
    assert pool.checkedout() == store.driver.lane(Lane.LEASES).spares_kept()  # type: ignore[attr-defined]


def test_a_dropped_connection_is_ridden_out_on_a_fresh_one(
    store: Store, hub: Hub, pg_database_url: str
) -> None:
    assert store.driver.lane(Lane.LEASES) is not None
    calls = LoopCalls(hub, store.driver, acks(store), lambda: None)
    first, second = leased(store, 2)
    calls.submit("a", fences=[first])
    run_until(hub, lambda: bool(calls._done))
    assert calls.collect()[0].value == {first.message_id}
    old_pid = backend_pid(calls)
    admin = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
    calls.submit("b", fences=[second])
    run_until(hub, lambda: bool(calls._done))
    # Sent again (after a backoff the hub timed) on a new connection: acked, no error.
    [outcome] = calls.collect()
    assert outcome.error is None and outcome.value == {second.message_id}
    assert backend_pid(calls) != old_pid
    calls.stop()


def test_a_statement_sent_again_counts_its_leases_from_that_send(
    store: Store, hub: Hub, pg_database_url: str
) -> None:
    """What a statement leased counts its lease from when the statement was sent (the job's
    ``sent_at``): sent again after its connection dropped, it ran no earlier than the last
    send, and ``sent_at`` moves there (else a lease clock would be nearly spent on arrival
    after an outage, the task interrupted as it starts)."""

    def prepare(jobs: list[Job]) -> tuple[Op[list[Done]], list[Job]]:
        job = jobs[0]
        op = store.ack_op(job.context["fences"])
        return op.then(lambda acked: [Done(job.key, value=acked, context=job.context)]), [job]

    calls = LoopCalls(hub, store.driver, prepare, lambda: None)
    first, second = leased(store, 2)
    submitted = time.monotonic()
    calls.submit("a", fences=[first], sent_at=submitted)
    run_until(hub, lambda: bool(calls._done))
    [a] = calls.collect()
    assert submitted <= a.context["sent_at"] <= time.monotonic()
    admin = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (backend_pid(calls),))
    submitted = time.monotonic()
    calls.submit("b", fences=[second], sent_at=submitted)
    run_until(hub, lambda: bool(calls._done))
    [b] = calls.collect()
    assert b.error is None and b.value == {second.message_id}
    # Sent again after the first backoff (0.05 s) on a new connection: counted from there.
    assert b.context["sent_at"] >= submitted + 0.05
    calls.stop()


def test_a_database_that_stays_away_fails_the_calls_after_the_retry_time(
    store: Store, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert store.driver.lane(Lane.LEASES) is not None
    fences = leased(store, 2)
    monkeypatch.setattr(loop_calls, "RETRY_SECONDS", 0.3)
    tries: list[float] = []

    def refused() -> Any:
        tries.append(time.monotonic())
        raise sa_exc.OperationalError("connect", {}, Exception("connection refused"))

    monkeypatch.setattr(store.driver.lane(Lane.LEASES), "kept_connection", refused)
    calls = LoopCalls(hub, store.driver, acks(store), lambda: None)
    calls.submit("a", fences=fences[:1])
    calls.submit("b", fences=fences[1:])  # waits behind it, then the same
    run_until(hub, lambda: len(calls._done) == 2)
    outcomes = calls.collect()
    assert all(isinstance(o.error, sa_exc.OperationalError) for o in outcomes)
    assert len(tries) >= 3 and tries[-1] - tries[0] < 1.0  # backed off, then gave up
    assert all(store.get_message(f.message_id) is not None for f in fences)  # never acked
    calls.stop()


def test_an_op_that_is_not_one_statement_is_executed_at_once(store: Store, hub: Hub) -> None:
    """A transaction of several statements cannot be sent from the loop: it runs, blocking,
    rather than being lost (the transport's own ops are all one statement)."""
    fences = leased(store, 1)

    def prepare(jobs: list[Job]) -> tuple[Op[list[Done]], list[Job]]:
        job = jobs[0]
        op = store.driver.message_ack_claim(fences, Claim(["q"], "w", 60_000, 1, None))
        assert not op.sendable or store.driver.nonblocking
        body = Op(Lane.LEASES, body=lambda conn: store.driver.run_on(conn, op))
        return body.then(lambda found: [Done(job.key, value=found[0])]), [job]

    calls = LoopCalls(hub, store.driver, prepare, lambda: None)
    calls.submit("a")
    [outcome] = calls.collect()
    assert outcome.value == {fences[0].message_id}
    calls.stop()


def test_a_statement_without_an_answer_is_given_up_and_sent_again(
    store: Store, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that stops answering on a connection that stays open (a partition, a stuck
    pooler) holds no statement past ``give_up_after`` (the lease): its connection is dropped
    and the statement sent again on a new one, until the retries' time is up."""
    monkeypatch.setattr(loop_calls, "RETRY_SECONDS", 0.9)
    given_up: list[int] = []
    give_up = LoopCalls._give_up_if_stuck

    def counted(self: LoopCalls) -> None:
        stuck = self._sending is not None
        give_up(self)
        if stuck and self._sending is None:
            given_up.append(1)

    monkeypatch.setattr(LoopCalls, "_give_up_if_stuck", counted)

    def prepare(jobs: list[Job]) -> tuple[Op[list[Done]], list[Job]]:
        job = jobs[0]
        stuck = text("SELECT pg_backend_pid() AS pid, pg_sleep(3)")
        return Op(Lane.LEASES, stuck, {}, lambda rows: [Done(job.key, value=rows)]), [job]

    calls = LoopCalls(hub, store.driver, prepare, lambda: None, give_up_after=0.3)
    started = time.monotonic()
    calls.submit("a")
    run_until(hub, lambda: len(calls._done) == 1)
    elapsed = time.monotonic() - started
    [outcome] = calls.collect()
    assert isinstance(outcome.error, sa_exc.OperationalError)
    assert "within the lease" in str(outcome.error)
    assert 0.8 <= elapsed < 2.5  # given up and tried again, never waiting out the 3 s
    assert len(given_up) >= 2
    assert not calls.pending
    calls.stop()


def test_a_claim_whose_answer_was_lost_gives_its_messages_to_the_claim_sent_again(
    pg_database_url: str, hub: Hub
) -> None:
    """The event loop's claim committed, its answer was dropped with the connection: before
    it goes out again, what it leased is released (attempt refunded), so the claim sent
    again delivers those messages at once (sqlease.transport._unheard)."""
    proxy = StallingProxy.to(pg_database_url)
    prefix = unique_prefix()
    direct = Store(pg_database_url, table_prefix=prefix)
    store = Store(proxy.through(pg_database_url), table_prefix=prefix)

    def prepare(jobs: list[Job]) -> tuple[Op[list[Done]], list[Job]]:
        job = jobs[0]
        op = store.claim_op(["q"], "w1", 60_000, 5, None)
        return op.then(lambda found: [Done(job.key, value=found)]), [job]

    calls = LoopCalls(hub, store.driver, prepare, lambda: None)
    try:
        [message_id] = direct.enqueue_many([NewMessage(queue="q", payload="p", task_id="t")])
        proxy.lose_answer(b"claimed AS (UPDATE")
        calls.submit("claim")
        run_until(hub, lambda: bool(calls._done))
        [outcome] = calls.collect()
        assert proxy.answers_lost == 1
        assert outcome.error is None
        assert [(m.id, m.attempt) for m in outcome.value] == [(message_id, 2)]
        kinds = [(e.kind, e.attempt) for e in direct.events(task_id="t")]
        assert kinds == [("enqueued", 0), ("claimed", 1), ("released", 1), ("claimed", 2)]
        assert not calls._unheard
    finally:
        calls.stop()
        store.engine.dispose()
        direct.engine.dispose()
        proxy.close()


def test_a_claim_given_up_without_an_answer_has_its_leases_released_before_it_goes_again(
    store: Store, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim given up after ``give_up_after`` may have run: the release of what it leased
    goes out before it is sent again."""
    monkeypatch.setattr(loop_calls, "RETRY_SECONDS", 0.9)
    asked: list[tuple[str, list[str]]] = []
    release = store.driver.release_lost_claims

    def recorded(owner: str, marks: Any, since: float) -> Any:
        asked.append((owner, list(marks)))
        return release(owner, marks, since)

    monkeypatch.setattr(store.driver, "release_lost_claims", recorded)

    def prepare(jobs: list[Job]) -> tuple[Op[list[Done]], list[Job]]:
        job = jobs[0]
        stuck = text("SELECT pg_sleep(3)")
        finish = lambda rows: [Done(job.key, value=rows)]  # noqa: E731
        return Op(Lane.LEASES, stuck, {}, finish, claim_mark=("w1", "m1")), [job]

    calls = LoopCalls(hub, store.driver, prepare, lambda: None, give_up_after=0.3)
    calls.submit("a")
    run_until(hub, lambda: len(calls._done) == 1)
    [outcome] = calls.collect()
    assert isinstance(outcome.error, sa_exc.OperationalError)
    assert asked and asked[0] == ("w1", ["m1"])
    calls.stop()
