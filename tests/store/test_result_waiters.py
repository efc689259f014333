"""PostgreSQL: a result's write notifies only while a client waits (sqlease._core.waiters),
and a client that starts to wait during a write still finds the result."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery, states
from celery.result import AsyncResult

from conftest import isolated_app, record_naps, unique_prefix
from sqlease import Store
from sqlease._core.results import ResultStore
from sqlease._core.waiters import WAITER_KEYS, waiter_key, waiter_keys
from sqlease._db.ops import ResultWrite

pytestmark = pytest.mark.pg


def test_waiter_keys_are_distinct_per_channel_and_64_bit() -> None:
    keys = waiter_keys("a_results")
    assert len(set(keys)) == WAITER_KEYS == len(keys)
    assert all(-(2**63) <= k < 2**63 for k in keys)
    assert keys == waiter_keys("a_results")  # every process computes the same
    assert not set(keys) & set(waiter_keys("b_results"))
    # Results spread over the keys: two writes at once rarely try the same one.
    tried = {waiter_key(keys, f"celery-task-meta-{n}") for n in range(200)}
    assert tried == set(keys)


def _raw_listener(store: Store, channel: str) -> psycopg.Connection[Any]:
    """A LISTEN connection that holds none of the waiters' locks: it hears what is sent."""
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg.connect(url, autocommit=True)
    conn.execute(f'LISTEN "{channel}"')
    return conn


def _heard(conn: psycopg.Connection[Any]) -> list[str]:
    return [n.payload for n in conn.notifies(timeout=0.3, stop_after=100)]


def _shared_holders(conn: psycopg.Connection[Any], keys: list[int]) -> int:
    """How many sessions hold all the waiters' keys shared (pg_locks splits a bigint key:
    classid its high half, objid its low half)."""
    rows = conn.execute(
        "SELECT pid, count(*) FROM pg_locks WHERE locktype = 'advisory' "
        "AND mode = 'ShareLock' AND granted AND objsubid = 1 AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND ((classid::bigint << 32) | objid::bigint) = ANY(%s) GROUP BY pid",
        (keys,),
    ).fetchall()
    assert all(count == len(keys) for _, count in rows), rows  # all of them, or none
    return len(rows)


def _until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def results(pg_database_url: str) -> Iterator[ResultStore]:
    store = Store(pg_database_url, table_prefix=unique_prefix())
    yield ResultStore(store)
    store.engine.dispose()


def test_a_result_is_notified_only_while_a_client_waits(results: ResultStore) -> None:
    store = results.store
    with _raw_listener(store, results.notify_channel) as listener:
        for n in range(3):
            results.put(f"k{n}", b"v", state="SUCCESS", task_id=f"t{n}")
        assert _heard(listener) == []  # nobody waits: no notification

        waiter = store.driver.waker(results.notify_channel, shared_keys=results.waiter_keys)
        assert waiter.fileno() is not None
        keys = [f"celery-task-meta-{n}" for n in range(40)]  # every waiter key tried
        assert {waiter_key(results.waiter_keys, k) for k in keys} == set(results.waiter_keys)
        for key in keys:
            results.put(key, b'{"r": 1}', state="SUCCESS", task_id=key)
        assert _heard(listener) == [f'{key}\n{{"r": 1}}' for key in keys]
        assert len(waiter.wait_payloads(0.5) or []) == len(keys)  # the waiter hears them too

        assert _shared_holders(listener, results.waiter_keys) == 1
        waiter.close()  # the last waiter gone (the server lets go of its locks soon after)
        _until(lambda: _shared_holders(listener, results.waiter_keys) == 0)
        results.put("k-after", b"v", state="SUCCESS", task_id="t-after")
        assert _heard(listener) == []


def test_a_write_without_a_waiter_key_always_notifies(results: ResultStore) -> None:
    store = results.store
    with _raw_listener(store, results.notify_channel) as listener:
        conn, transaction = _write_in_open_transaction(results, "k-any", b"1", keyed=False)
        transaction.commit()
        conn.close()
        assert _heard(listener) == ["k-any\n1"]


def test_a_listener_that_connects_again_takes_the_keys_and_says_so(
    results: ResultStore,
) -> None:
    """A waiting client's connection broke (a server restart, or the reaper closed it): the
    wait that connects again returns at once with "cannot tell", so that its caller reads
    what was written meanwhile while holding the keys again, instead of napping until its
    safety interval over writes that found no waiter."""
    store = results.store
    waiter = store.driver.waker(results.notify_channel, shared_keys=results.waiter_keys)
    with _raw_listener(store, results.notify_channel) as admin:
        assert waiter.fileno() is not None and waiter.generation == 1
        pid = waiter._conn.info.backend_pid  # type: ignore[attr-defined]
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        _until(lambda: _shared_holders(admin, results.waiter_keys) == 0)
        assert waiter.wait_payloads(30) is None  # noticed the break: cannot tell
        started = time.monotonic()
        assert waiter.wait_payloads(30) is None  # connected anew: at once, cannot tell
        assert time.monotonic() - started < 10 and waiter.generation == 2
        assert _shared_holders(admin, results.waiter_keys) == 1
    waiter.close()


def _write_in_open_transaction(
    results: ResultStore, key: str, value: bytes, *, keyed: bool = True
) -> Any:
    """The result write's own statement in a transaction left open: a transaction to
    commit, whose write tried its waiter key (and holds it, if free) as the real one does."""
    row = {
        "key": key,
        "value": value,
        "state": "SUCCESS",
        "task_id": key,
        "message_id": None,
        "attempt": None,
        "expires_at_ms": None,
        "updated_at_ms": int(time.time() * 1000),
    }
    write = ResultWrite(
        row,
        None,
        False,
        None,
        None,
        results.notify_channel,
        waiter_key(results.waiter_keys, key) if keyed else None,
    )
    op = results.store.driver.result_put(write)
    conn = results.store.engine.connect()
    transaction = conn.begin()
    conn.execute(op.statement, op.params)
    return conn, transaction


@pytest.mark.timeout(60)
def test_a_client_that_starts_waiting_during_a_write_finds_its_result(
    results: ResultStore,
) -> None:
    """The write found no waiter, so it sends no notification; a client that starts to wait
    before the write commits must then read the result: its lock waits for the commit."""
    store = results.store
    with _raw_listener(store, results.notify_channel) as listener:
        conn, transaction = _write_in_open_transaction(results, "k-race", b'"done"')
        box: dict[str, Any] = {}

        def wait() -> None:
            waiter = store.driver.waker(results.notify_channel, shared_keys=results.waiter_keys)
            box["listening"] = waiter.fileno() is not None  # LISTEN, then the shared locks
            box["read"] = results.get("k-race")  # the read a waiting client makes first
            waiter.close()

        thread = threading.Thread(target=wait)
        thread.start()

        def blocked() -> bool:  # the waiter's connection waits on an advisory lock
            row = listener.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE '%-listen' "
                "AND wait_event_type = 'Lock' AND wait_event = 'advisory' "
                "AND datname = current_database()"
            ).fetchone()
            return row is not None and row[0] == 1

        _until(blocked)
        assert thread.is_alive()  # its lock waits for the write's commit
        transaction.commit()
        conn.close()
        thread.join(10)
        assert box == {"listening": True, "read": b'"done"'}
        assert _heard(listener) == []  # the write saw no waiter: the read alone found it


@pytest.fixture
def app(pg_database_url: str) -> Iterator[Celery]:
    app = isolated_app("waiters", pg_database_url)
    yield app
    app.close()


@pytest.mark.timeout(120)
def test_gets_that_start_as_their_results_are_written_miss_none(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each get() opens its listening connection while another thread writes the result,
    a few milliseconds apart either way. A result whose notification was skipped while its
    client had started to wait would leave the client napping until its safety interval
    (here its 2 s timeout) and reading it then: no nap may end without a notification."""
    writer = Celery("writer", broker=app.conf.broker_url, backend=app.conf.result_backend)
    writer.conf.broker_transport_options = app.conf.broker_transport_options
    writes = writer.backend  # made here once: the timers' threads write through it
    backend = app.backend
    naps = record_naps(monkeypatch, backend)
    rng = random.Random(7)
    try:
        for n in range(60):
            task_id = f"race-{n}"
            waker = getattr(backend._local, "waker", None)
            if waker is not None:
                waker.close()  # a fresh connection: its locks are taken during this get()
                backend._local.waker = None

            def write(task_id: str = task_id, n: int = n) -> None:
                writes.store_result(task_id, n, states.SUCCESS)

            timer = threading.Timer(rng.uniform(0, 0.006), write)
            timer.start()
            naps.clear()
            assert AsyncResult(task_id, app=app).get(timeout=2, interval=30) == n
            assert all(naps), (n, naps)  # woken by its notification, or read at once
            timer.join()
    finally:
        writer.close()


def test_a_get_or_join_of_stored_results_turns_no_notifications_on(app: Celery) -> None:
    """A wait whose first read finds everything (a chord's last part joining its header's
    results, a get() of a finished task) does not listen, so it holds no waiter key and
    result writes stay silent; one that finds a result missing listens, then reads again."""
    from celery.result import GroupResult

    backend = app.backend
    for n in range(3):
        backend.store_result(f"done-{n}", n, states.SUCCESS)
    group = GroupResult("g", [AsyncResult(f"done-{n}", app=app) for n in range(3)], app=app)
    assert group.join_native(timeout=5) == [0, 1, 2]
    assert AsyncResult("done-0", app=app).get(timeout=5) == 0
    waker = getattr(backend._local, "waker", None)
    assert waker is None or not waker.connected
    writer = threading.Timer(0.3, lambda: backend.store_result("later", 7, states.SUCCESS))
    writer.start()
    assert AsyncResult("later", app=app).get(timeout=5) == 7
    writer.join()
    assert backend._local.waker.connected  # this one had to wait: it listens
