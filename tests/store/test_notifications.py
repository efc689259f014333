"""PostgreSQL wake-ups: what announces itself on the store's notification channel (workers
LISTEN on it, see docs/howto/postgresql.md)."""

from __future__ import annotations

import psycopg
import pytest

from conftest import unique_prefix
from sqlease import Store
from sqlease._db.driver import Lane

pytestmark = pytest.mark.pg


def test_a_publish_names_its_queue(pg_database_url: str) -> None:
    store = Store(pg_database_url, table_prefix=unique_prefix())
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{store.notify_channel}"')
        store.enqueue("a", "1")
        store.enqueue("b", "2", delay_ms=60_000)  # a delayed one too: its due time is looked up
        heard = [n.payload for n in listener.notifies(timeout=0.3, stop_after=5)]
    assert heard == ["a", "b"]


def test_a_release_to_claim_now_wakes_idle_workers(pg_database_url: str) -> None:
    """Released messages (warm shutdown, requeue) are announced like a publish, so an idle
    worker takes them at once instead of at its next safety poll; a delayed release, a park
    or a failure announce nothing."""
    store = Store(pg_database_url, table_prefix=unique_prefix())
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{store.notify_channel}"')

        def heard() -> list[str]:
            return [n.payload for n in listener.notifies(timeout=0.3, stop_after=5)]

        for n in range(4):
            store.enqueue("jobs", f"m{n}")
        assert heard() == ["jobs"] * 4
        first, second, third, fourth = store.claim(["jobs"], "w", lease_ms=60_000, limit=4)
        assert store.release([first.fence]) == {first.id}
        assert heard() == ["jobs"]
        assert store.release([second.fence], delay_ms=5_000) == {second.id}
        assert store.park(third.fence, "paused") and store.fail(fourth.fence, "rejected")
        assert heard() == []


_FORKING_LISTENER = """
import os, signal, sys, time
from sqlalchemy.engine import make_url
from sqlease._db.postgresql.listener import PostgresListener

listener = PostgresListener(make_url(sys.argv[1]), "fork_test", lock_key=int(sys.argv[2]))
assert listener.fileno() is not None  # connected, listening, advisory lock held
child = os.fork()
if child == 0:  # a pool process forked after the listener connected: it just lives on
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the worker dies without closing anything
"""


@pytest.mark.timeout(60)
def test_a_forked_child_does_not_keep_a_killed_workers_listen_session(
    pg_database_url: str,
) -> None:
    """The listener's session holds the advisory lock that makes a worker's handoff offers
    count. A prefork child forked after it connected must not keep that session (and lock)
    alive once the worker is SIGKILLed, or publishes would go on handing tasks to the dead
    worker's offers."""
    import os
    import signal
    import subprocess
    import sys
    import time

    key = 0x5E1EA5E0 + os.getpid()
    # (Popen and one line: the child keeps the pipe open, so run() would wait for it.)
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORKING_LISTENER, pg_database_url, str(key)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(30) == -signal.SIGKILL
    child = int(line.strip())
    try:
        with psycopg.connect(pg_database_url, autocommit=True) as conn:
            deadline = time.monotonic() + 10
            while True:
                row = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()
                if row is not None and row[0]:
                    break
                assert time.monotonic() < deadline, "the dead worker's lock is still held"
                time.sleep(0.05)
            os.kill(child, 0)  # the child is still alive: it was not what let go
    finally:
        os.kill(child, signal.SIGKILL)


def test_sqlease_keeps_the_urls_own_session_options_and_connect_timeout() -> None:
    from sqlalchemy.engine import make_url

    from sqlease._db.postgresql.engine import (
        CONNECT_TIMEOUT_S,
        GENERIC_PLANS_OPTION,
        SESSION_OPTIONS,
    )
    from sqlease._db.postgresql.engine import connect_args as postgresql_connect_args

    plain = postgresql_connect_args(make_url("postgresql+psycopg://u@h/db"))
    assert plain["options"] == SESSION_OPTIONS
    assert plain["connect_timeout"] == CONNECT_TIMEOUT_S
    hot = postgresql_connect_args(make_url("postgresql+psycopg://u@h/db"), generic_plans=True)
    assert hot["options"] == f"{SESSION_OPTIONS} {GENERIC_PLANS_OPTION}"
    own = postgresql_connect_args(
        make_url("postgresql+psycopg://u@h/db?options=-csearch_path%3Dapp&connect_timeout=3"),
        generic_plans=True,
    )
    # The URL's settings come last, so that they win over sqlease's.
    assert own["options"] == f"{SESSION_OPTIONS} {GENERIC_PLANS_OPTION} -csearch_path=app"
    assert "connect_timeout" not in own  # the URL's own is used


def test_generic_plans_only_on_the_hot_paths_engine(pg_database_url: str) -> None:
    """The hot path (claim, ack, enqueue, offers, results) plans each prepared statement
    once; everything else keeps PostgreSQL's `auto`, where a statement is planned for its
    values. A URL's own session options reach both."""
    from sqlalchemy import text

    url = pg_database_url + "?options=-c%20statement_timeout%3D12345"
    store = Store(url, table_prefix=unique_prefix())
    assert store.driver.lane(Lane.DEFAULT) is not None
    with store.engine.connect() as conn:
        assert conn.execute(text("SHOW statement_timeout")).scalar() == "12345ms"
        assert conn.execute(text("SHOW plan_cache_mode")).scalar() == "auto"
        assert conn.execute(text("SHOW jit")).scalar() == "off"
    [row] = store.driver.lane(Lane.DEFAULT).rows(
        text(
            "SELECT current_setting('plan_cache_mode') AS mode, "
            "current_setting('statement_timeout') AS timeout"
        ),
        {},
    )
    assert row == {"mode": "force_generic_plan", "timeout": "12345ms"}
