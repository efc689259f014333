"""The PostgreSQL hot path (enqueue, claim, ack and result writes straight through psycopg)
behaves as the SQLAlchemy path does when the database misbehaves: a dropped connection is
retried on a fresh one and other errors are SQLAlchemy's. (A refusal becoming the same
sqlease error: tests/store/test_bad_input.py, whose claim takes this path.)"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from conftest import unique_prefix
from sqlease import Store
from sqlease._db.driver import Lane
from sqlease._db.postgresql import direct

pytestmark = pytest.mark.pg


def _terminate_pooled_backends(store: Store) -> int:
    """Kill the server side of every connection the store's pool holds, as a restart would."""
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND application_name LIKE 'sqlease%%'"
        ).fetchall()
    return len(rows)


#: Fails at execution (division by zero) and leaves the connection usable.
DIVISION_BY_ZERO = text("SELECT 1 / (SELECT count(*) FROM (SELECT 1 WHERE false) s)")
BACKEND_PID = text("SELECT pg_backend_pid() AS pid")


@pytest.fixture
def fresh_store(pg_database_url: str) -> Store:
    """A store whose hot-path engine starts with an empty pool. The engine is process-wide:
    this drops connections an earlier test killed (a raw ``fast.rows`` call does not retry,
    as store operations do)."""
    store = Store(pg_database_url, table_prefix=unique_prefix())
    assert (
        store.driver.lane(Lane.DEFAULT) is not None and store.driver.lane(Lane.LEASES) is not None
    )
    for fast in (store.driver.lane(Lane.DEFAULT), store.driver.lane(Lane.LEASES)):
        fast.drop_spares()
        fast._engine.dispose()
    return store


def test_a_dropped_connection_is_replaced_and_the_operation_retried(
    pg_database_url: str,
) -> None:
    store = Store(pg_database_url, table_prefix=unique_prefix())
    assert store.driver.lane(Lane.DEFAULT) is not None
    store.enqueue("q", "a")
    assert _terminate_pooled_backends(store) >= 1
    store.enqueue("q", "b")  # the first try fails on the dead connection
    assert _terminate_pooled_backends(store) >= 1
    claimed = store.claim(["q"], "w", lease_ms=60_000, limit=2)
    assert [m.payload for m in claimed] == ["a", "b"]
    assert _terminate_pooled_backends(store) >= 1
    assert store.ack([m.fence for m in claimed]) == {m.id for m in claimed}
    assert store.size(["q"]) == 0
    # The worker's own bookkeeping rides it out too: after a reconnect it clears its offers
    # (a chaos run logged "could not clear handoff offers after relistening" without this).
    assert _terminate_pooled_backends(store) >= 1
    store.withdraw_offers("w", handed_too=True)
    assert _terminate_pooled_backends(store) >= 1
    assert store.leased_to("w") == []


def test_other_errors_are_sqlalchemys(fresh_store: Store) -> None:
    store = fresh_store
    assert store.driver.lane(Lane.DEFAULT) is not None
    with pytest.raises(sa_exc.ProgrammingError):
        store.driver.lane(Lane.DEFAULT).rows(text("SELECT * FROM no_such_table_here"), {})
    with pytest.raises(sa_exc.DataError):
        store.driver.lane(Lane.DEFAULT).rows(DIVISION_BY_ZERO, {})
    assert store.driver.lane(Lane.DEFAULT).rows(text("SELECT 1 AS one"), {}) == [
        {"one": 1}
    ]  # connection still fine


def test_long_statements_are_converted_once_and_bind_their_parameters(
    pg_database_url: str,
) -> None:
    """psycopg caches its placeholder conversion only for statements up to 4 KB; the busy
    worker's ack + claim is longer. The hot path converts each statement once, and the
    parameters still land in the right places."""

    store = Store(pg_database_url, table_prefix=unique_prefix())
    assert len(str(store.sql.ack_claim_single)) > 4096
    for i in range(4):
        store.enqueue("q", f"p{i}", task_id=f"t{i}")
    [first] = store.claim(["q"], "w", lease_ms=60_000)
    before = direct._convert.cache_info()
    acked, second = store.ack_and_claim([first.fence], ["q"], "w", lease_ms=60_000, limit=2)
    acked2, third = store.ack_and_claim(
        [m.fence for m in second], ["q"], "w", lease_ms=60_000, limit=2
    )
    after = direct._convert.cache_info()
    assert acked == {first.id} and acked2 == {m.id for m in second}
    assert [m.payload for m in second + third] == ["p1", "p2", "p3"]
    assert all(m.lease_owner == "w" and m.attempt == 1 for m in second + third)
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)


def test_psycopg_internals_that_changed_fall_back_to_its_public_path(
    pg_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cached conversion uses psycopg internals. This psycopg's must pass the import-time
    check; and if a later one's stop behaving at call time, each statement falls back to
    psycopg's own conversion instead of failing."""

    assert direct._private_conversion_works()

    def moved(query: bytes, encoding: str) -> tuple[bytes, list[object]]:
        raise TypeError("internals moved")

    monkeypatch.setattr(direct, "_convert", moved)
    store = Store(pg_database_url, table_prefix=unique_prefix())
    store.enqueue("q", "p0", task_id="t0")
    [claimed] = store.claim(["q"], "w", lease_ms=60_000)
    assert claimed.payload == "p0"
    assert store.ack([claimed.fence]) == {claimed.id}


def _in_thread(call: Any) -> Any:
    """Run ``call`` on a thread of its own (pinning is per thread); its result or error."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_a_pinned_thread_keeps_one_connection_in_autocommit_until_released(
    fresh_store: Store,
) -> None:
    fast = fresh_store.driver.lane(Lane.DEFAULT)
    assert fast is not None
    pid = BACKEND_PID
    pool = fast._engine.pool

    def pinned() -> tuple[set[int], int, int]:
        fast.pin_thread()
        pids = {fast.rows(pid, {})[0]["pid"] for _ in range(5)}
        held = pool.checkedout()  # type: ignore[attr-defined]
        fast.release_thread()
        return pids, held, pool.checkedout()  # type: ignore[attr-defined]

    spares = fast.spares_kept()
    pids, held, after = _in_thread(pinned)
    assert len(pids) == 1 and held == 1 + spares and after == spares
    # Given back as the pool lends connections: not in autocommit.
    with fast._engine.connect() as conn:
        driver = conn.connection.dbapi_connection
        assert isinstance(driver, psycopg.Connection)
        assert driver.autocommit is False
    # Unpinned calls use the engine's spares: nothing else stays checked out.
    assert fast.rows(pid, {})[0]["pid"] > 0
    assert pool.checkedout() == fast.spares_kept() >= 1  # type: ignore[attr-defined]


def test_a_pinned_connection_that_breaks_is_replaced_on_the_next_call(
    fresh_store: Store,
) -> None:
    store = fresh_store
    fast = store.driver.lane(
        Lane.LEASES
    )  # the claim below runs on it, pinned, as the busy worker's do
    assert fast is not None
    pid = BACKEND_PID

    def scenario() -> tuple[int, int, int]:
        fast.pin_thread()
        try:
            first = fast.rows(pid, {})[0]["pid"]
            with pytest.raises(sa_exc.DataError):  # an error that leaves the connection fine
                fast.rows(DIVISION_BY_ZERO, {})
            second = fast.rows(pid, {})[0]["pid"]
            assert _terminate_pooled_backends(store) >= 1
            with pytest.raises(sa_exc.OperationalError) as dropped:
                fast.rows(pid, {})
            assert dropped.value.connection_invalidated
            # And the store's own retry rides it out, as on the unpinned path.
            store.enqueue("q", "after the drop")
            assert _terminate_pooled_backends(store) >= 1
            [claimed] = store.claim(["q"], "w", lease_ms=60_000)
            third = fast.rows(pid, {})[0]["pid"]
            assert claimed.payload == "after the drop"
            return first, second, third
        finally:
            fast.release_thread()

    first, second, third = _in_thread(scenario)
    assert first > 0 and second > 0 and third not in (first, second)
    assert fast._engine.pool.checkedout() == fast.spares_kept()  # type: ignore[attr-defined]


def _concurrently(fast: Any, count: int) -> set[int]:
    """``count`` one-statement calls at the same time (each holds its connection 0.2 s);
    the backends that served them."""
    barrier = threading.Barrier(count)
    pids: set[int] = set()

    def call() -> None:
        barrier.wait(10)
        pids.add(fast.rows(text("SELECT pg_backend_pid() AS pid, pg_sleep(0.2)"), {})[0]["pid"])

    threads = [threading.Thread(target=call) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return pids


def test_one_statement_calls_reuse_the_engines_spares_without_the_pool(
    fresh_store: Store,
) -> None:
    """A producer's ``delay()`` no longer checks a connection out of SQLAlchemy's pool and back
    in, switching autocommit each way (measured: 1,349-1,464 -> 927-1,129 us of client CPU per
    ``delay()``, interleaved runs): the engine keeps a few connections in autocommit."""
    from sqlalchemy import event

    from sqlease._db.spares import SPARES_PER_ENGINE

    fast = fresh_store.driver.lane(Lane.DEFAULT)
    assert fast is not None
    checkouts: list[int] = []

    def on_checkout(*args: Any) -> None:
        checkouts.append(1)

    event.listen(fast._engine, "checkout", on_checkout)
    try:
        pids = {fast.rows(BACKEND_PID, {})[0]["pid"] for _ in range(20)}
        assert len(pids) == 1 and len(checkouts) == 1  # one connection, checked out once
        assert fast.spares_kept() == 1
        # Many callers at once each get a connection; the engine keeps only a few of them.
        assert len(_concurrently(fast, 4)) == 4
        assert fast.spares_kept() == SPARES_PER_ENGINE
        assert fast._engine.pool.checkedout() == SPARES_PER_ENGINE  # type: ignore[attr-defined]
        # Every DirectLane of the engine (a store per Celery app, per Admin...) shares them.
        other = Store(fresh_store.engine.url, table_prefix=unique_prefix()).driver.lane(
            Lane.DEFAULT
        )
        assert other is not None and other.spares_kept() == SPARES_PER_ENGINE
    finally:
        event.remove(fast._engine, "checkout", on_checkout)


def test_a_disconnect_drops_every_spare(fresh_store: Store) -> None:
    fast = fresh_store.driver.lane(Lane.DEFAULT)
    assert fast is not None
    _concurrently(fast, 2)
    assert fast.spares_kept() == 2
    assert _terminate_pooled_backends(fresh_store) >= 2
    with pytest.raises(sa_exc.OperationalError) as dropped:
        fast.rows(BACKEND_PID, {})
    assert dropped.value.connection_invalidated
    assert fast.spares_kept() == 0  # the other one was as dead: not kept for the next call
    assert fast.rows(BACKEND_PID, {})[0]["pid"] > 0
    # And a store operation rides such a drop out by itself.
    assert _terminate_pooled_backends(fresh_store) >= 1
    fresh_store.enqueue("q", "after the drop")
    assert fresh_store.size("q") == 1


def test_a_forked_child_never_uses_its_parents_spares(fresh_store: Store) -> None:
    import os

    fast = fresh_store.driver.lane(Lane.DEFAULT)
    assert fast is not None
    parent = fast.rows(BACKEND_PID, {})[0]["pid"]
    assert fast.spares_kept() == 1
    child = os.fork()
    if child == 0:
        code = 1
        try:
            assert fast.spares_kept() == 0
            fast._engine.dispose(close=False)  # as sqlease does after a fork
            code = 0 if fast.rows(BACKEND_PID, {})[0]["pid"] != parent else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fast.rows(BACKEND_PID, {})[0]["pid"] == parent  # the parent's is untouched


def test_an_engine_passed_in_keeps_no_spares(pg_database_url: str) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    engine = create_engine(make_url(pg_database_url).set(drivername="postgresql+psycopg"))
    try:
        store = Store(engine, table_prefix=unique_prefix())
        assert store.driver.lane(Lane.DEFAULT) is not None
        store.enqueue("q", "a")
        assert store.driver.lane(Lane.DEFAULT).spares_kept() == 0
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        engine.dispose()


def test_a_spare_older_than_the_pools_recycle_time_is_replaced(fresh_store: Store) -> None:
    fast = fresh_store.driver.lane(Lane.DEFAULT)
    assert fast is not None
    first = fast.rows(BACKEND_PID, {})[0]["pid"]
    [fairy] = list(fast._spares or [])
    fairy._connection_record.starttime -= 3601  # pool_recycle is an hour
    assert fast.rows(BACKEND_PID, {})[0]["pid"] != first
    assert fast.spares_kept() == 1


def test_a_connect_that_fails_is_sqlalchemys_operational_error(
    fresh_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chaos run's restart: a pool process storing a result found no spare, its connect was
    refused (the server shutting down), and psycopg's own error escaped the store's retry."""
    fast = fresh_store.driver.lane(Lane.DEFAULT)
    assert fast is not None

    def refused() -> Any:
        raise psycopg.OperationalError("connection failed: the database system is shutting down")

    monkeypatch.setattr(fast._engine, "raw_connection", refused)
    with pytest.raises(sa_exc.OperationalError):
        fast.rows(BACKEND_PID, {})
    with pytest.raises(sa_exc.OperationalError):
        fast.kept_connection()  # the event loop's statements take this one


def test_a_spare_made_before_the_pool_was_invalidated_is_replaced(fresh_store: Store) -> None:
    """A disconnect seen through SQLAlchemy's own path invalidates the pool; a spare made
    before it is not used, as the pool would not lend it either."""
    fast = fresh_store.driver.lane(Lane.DEFAULT)
    assert fast is not None
    first = fast.rows(BACKEND_PID, {})[0]["pid"]
    assert _terminate_pooled_backends(fresh_store) >= 1
    fast._engine.pool._invalidate_time = __import__("time").time()  # type: ignore[attr-defined]
    assert fast.rows(BACKEND_PID, {})[0]["pid"] != first
