"""The PostgreSQL hot path (enqueue, claim, ack and result writes straight through psycopg)
behaves as the SQLAlchemy path does when the database misbehaves: a dropped connection is
retried on a fresh one and other errors are SQLAlchemy's. (A refusal becoming the same
sqlease error: tests/reliability/test_bad_input.py, whose claim takes this path.)"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from conftest import unique_prefix
from sqlease import Store

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
    assert store.fast is not None and store.fast_leases is not None
    store.fast._engine.dispose()
    store.fast_leases._engine.dispose()
    return store


def test_a_dropped_connection_is_replaced_and_the_operation_retried(
    pg_database_url: str,
) -> None:
    store = Store(pg_database_url, table_prefix=unique_prefix())
    assert store.fast is not None
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
    assert store.fast is not None
    with pytest.raises(sa_exc.ProgrammingError):
        store.fast.rows(text("SELECT * FROM no_such_table_here"), {})
    with pytest.raises(sa_exc.DataError):
        store.fast.rows(DIVISION_BY_ZERO, {})
    assert store.fast.rows(text("SELECT 1 AS one"), {}) == [{"one": 1}]  # connection still fine


def test_long_statements_are_converted_once_and_bind_their_parameters(
    pg_database_url: str,
) -> None:
    """psycopg caches its placeholder conversion only for statements up to 4 KB; the busy
    worker's ack + claim is longer. The hot path converts each statement once, and the
    parameters still land in the right places."""
    from sqlease import fastpath

    store = Store(pg_database_url, table_prefix=unique_prefix())
    assert len(str(store.sql.ack_claim_single)) > 4096
    for i in range(4):
        store.enqueue("q", f"p{i}", task_id=f"t{i}")
    [first] = store.claim(["q"], "w", lease_ms=60_000)
    before = fastpath._convert.cache_info()
    acked, second = store.ack_and_claim([first.fence], ["q"], "w", lease_ms=60_000, limit=2)
    acked2, third = store.ack_and_claim(
        [m.fence for m in second], ["q"], "w", lease_ms=60_000, limit=2
    )
    after = fastpath._convert.cache_info()
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
    from sqlease import fastpath

    assert fastpath._private_conversion_works()

    def moved(query: bytes, encoding: str) -> tuple[bytes, list[object]]:
        raise TypeError("internals moved")

    monkeypatch.setattr(fastpath, "_convert", moved)
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
    fast = fresh_store.fast
    assert fast is not None
    pid = BACKEND_PID
    pool = fast._engine.pool

    def pinned() -> tuple[set[int], int, int]:
        fast.pin_thread()
        pids = {fast.rows(pid, {})[0]["pid"] for _ in range(5)}
        held = pool.checkedout()  # type: ignore[attr-defined]
        fast.release_thread()
        return pids, held, pool.checkedout()  # type: ignore[attr-defined]

    pids, held, after = _in_thread(pinned)
    assert len(pids) == 1 and held == 1 and after == 0
    # Given back as the pool lends connections: not in autocommit.
    with fast._engine.connect() as conn:
        driver = conn.connection.dbapi_connection
        assert isinstance(driver, psycopg.Connection)
        assert driver.autocommit is False
    # Unpinned calls borrow and return a connection each time (nothing stays checked out).
    assert fast.rows(pid, {})[0]["pid"] > 0 and pool.checkedout() == 0  # type: ignore[attr-defined]


def test_a_pinned_connection_that_breaks_is_replaced_on_the_next_call(
    fresh_store: Store,
) -> None:
    store = fresh_store
    fast = store.fast_leases  # the claim below runs on it, pinned, as the busy worker's do
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
    assert fast._engine.pool.checkedout() == 0  # type: ignore[attr-defined]
