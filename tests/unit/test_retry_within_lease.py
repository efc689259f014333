"""A transient error met inside a lease-bounded call (sqlease._db.retry, sqlease._db.bounds):
retried while the bound lasts, past the store's own retry window (an outage shorter than the
lease), and still retried when a renewal confirmed during the last wait moved the bound on (a
short outage that the heartbeat rode out); raised at the bound otherwise."""

from __future__ import annotations

import time

import pytest
from sqlalchemy.exc import OperationalError

from sqlease._db.bounds import bounded
from sqlease._db.retry import retry_transient


def flaky(failures: int) -> tuple[list[int], object]:
    calls: list[int] = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise OperationalError("select 1", None, ConnectionError("server gone"))
        return "done"

    return calls, retry_transient(call, seconds=5)


def test_a_renewal_during_the_last_wait_lets_the_call_go_on() -> None:
    calls, call = flaky(failures=3)
    lefts = iter([0.01, 0.01, 5.0])  # nearly out, then the heartbeat renewed the lease

    def remaining() -> float:
        return next(lefts, 5.0)

    with bounded(remaining):
        assert call() == "done"  # type: ignore[operator]
    assert len(calls) == 4


def test_without_a_renewal_the_error_comes_at_the_bound() -> None:
    calls, call = flaky(failures=10)
    end = time.monotonic() + 0.03  # less than the first backoff is left

    with bounded(lambda: end - time.monotonic()), pytest.raises(OperationalError, match="gone"):
        call()  # type: ignore[operator]
    assert len(calls) == 1
    assert time.monotonic() >= end  # it waited out the lease before giving up


def test_a_bounded_call_retries_past_the_stores_window_while_its_lease_lasts() -> None:
    calls: list[int] = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= 4:  # backoffs of 0.05, 0.1, 0.2 and 0.4 s: 0.75 s of errors
            raise OperationalError("select 1", None, ConnectionError("server gone"))
        return "done"

    window = retry_transient(call, seconds=0.1)
    with bounded(lambda: 30.0):
        assert window() == "done"
    assert len(calls) == 5
    # Unbounded (not made for a delivery), the same errors end at the store's window.
    calls.clear()
    with pytest.raises(OperationalError, match="gone"):
        window()
    assert len(calls) == 2


def test_a_lost_connection_of_another_error_class_is_retried_and_a_refusal_is_not() -> None:
    """psycopg reports a connection terminated under a pooler, as it answered a ``BEGIN``, as
    an ``InternalError`` (two results for one command): taken as a disconnect (the connection
    dropped) and retried; an ``InternalError`` of the server's, on a live connection, is not."""
    import psycopg
    from sqlalchemy.exc import DBAPIError, InternalError

    from sqlease._db.postgresql.engine import desynced

    garbled = psycopg.InternalError("received 2 results from command 'BEGIN'")
    assert desynced(garbled)
    assert not desynced(psycopg.InternalError("cache lookup failed"))
    assert not desynced(psycopg.OperationalError("received 2 results from command 'BEGIN'"))

    for invalidated, expected_calls in ((True, 2), (False, 1)):
        calls: list[int] = []

        def call(invalidated: bool = invalidated, calls: list[int] = calls) -> str:
            calls.append(1)
            if len(calls) == 1:
                raise DBAPIError.instance(
                    "BEGIN", None, garbled, psycopg.Error, connection_invalidated=invalidated
                )
            return "done"

        retried = retry_transient(call, seconds=5)
        if invalidated:
            assert retried() == "done"
        else:
            with pytest.raises(InternalError):
                retried()
        assert len(calls) == expected_calls


def test_a_new_connection_lost_in_its_own_set_up_is_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Behind a pooler, a new connection's settings check can end with the terminated server
    connection's FATAL as a second result of its ``ROLLBACK``: the pool's connect fails with
    psycopg's ``InternalError``. That is a lost connection (retried), not the caller's error:
    a chaos run through PgBouncer once failed a task with it."""
    from types import SimpleNamespace

    import psycopg
    from sqlalchemy import create_engine
    from sqlalchemy.exc import DBAPIError

    from sqlease._db.postgresql.direct import DirectLane

    engine = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    lane = DirectLane(engine)
    fairy = SimpleNamespace(driver_connection=SimpleNamespace(autocommit=False))
    failures = [psycopg.InternalError("received 2 results from command 'ROLLBACK'")]

    def connect() -> object:
        if failures:
            raise failures.pop()
        return fairy

    monkeypatch.setattr(engine, "raw_connection", connect)
    monkeypatch.setattr("sqlease._db.retry.time.sleep", lambda _seconds: None)  # no backoff
    assert retry_transient(lane.kept_connection, seconds=5)() is fairy
    assert fairy.driver_connection.autocommit  # kept in autocommit, as every kept one

    # A server's own InternalError on a new connection is not a lost connection: it goes up.
    failures.append(psycopg.InternalError("cache lookup failed"))
    with pytest.raises(DBAPIError) as raised:
        retry_transient(lane.kept_connection, seconds=5)()
    assert not raised.value.connection_invalidated
    engine.dispose()


def test_a_program_limit_the_server_reported_is_raised_at_once() -> None:
    """psycopg calls an index entry or a NOTIFY payload too large (SQLSTATE class 54)
    operational, but the server answered: no retry changes it, and the connection is fine. A
    publish with such a value used to retry for 20 s (and Kombu's retries after) first."""
    import psycopg.errors

    from sqlease._db.retry import lost_connection

    too_big = OperationalError(
        "insert", None, psycopg.errors.ProgramLimitExceeded("index row size 3016 exceeds")
    )
    gone = OperationalError("insert", None, psycopg.errors.AdminShutdown("terminating"))
    assert not lost_connection(too_big)
    assert lost_connection(gone)
    calls: list[int] = []

    def call() -> None:
        calls.append(1)
        raise too_big

    started = time.monotonic()
    with pytest.raises(OperationalError, match="index row size"):
        retry_transient(call, seconds=5)()
    assert calls == [1] and time.monotonic() - started < 1.0
