"""Forks wait for other threads to leave SQLite (sqlease._db.sqlite.fork_guard): a child forked
while a heartbeat or maintenance thread is inside SQLite would inherit SQLite's mutexes locked
and hang at its first SQLite call. Real threads and forks, short waits."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from conftest import unique_prefix
from sqlease._db.sqlite.fork_guard import ForkGuard, fork_guard
from sqlease.store import NewMessage, Store

pytestmark = pytest.mark.timeout(60)


def _wait_child(pid: int, seconds: float = 10.0) -> int:
    """The child's exit code; a child that hangs is killed and reported as -9."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -9


def test_a_fork_waits_for_a_thread_inside_a_section() -> None:
    guard = ForkGuard()
    order: list[str] = []
    inside = threading.Event()

    def section_under_way() -> None:
        with guard.section():
            inside.set()
            threading.Event().wait(0.1)
            order.append("left")

    thread = threading.Thread(target=section_under_way)
    thread.start()
    assert inside.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: a fresh guard it can use at once
        code = 1
        try:
            with guard.section():
                code = 0 if guard.others_inside() == 0 else 2
        finally:
            os._exit(code)
    order.append("forked")
    thread.join()
    assert _wait_child(pid) == 0
    assert order == ["left", "forked"]


def test_no_thread_enters_while_a_fork_is_under_way_and_reentry_never_waits() -> None:
    guard = ForkGuard()
    entered = threading.Event()

    def enter() -> None:
        with guard.section():
            entered.set()

    with guard.section():
        guard._before_fork()  # the forking thread's own section does not hold it up
        with guard.section():  # nor does it wait to re-enter
            pass
        thread = threading.Thread(target=enter)
        thread.start()
        assert not entered.wait(0.2)  # held back while the fork is under way
        guard._after_fork_in_parent()
    assert entered.wait(5)
    thread.join()
    assert guard.others_inside() == 0


def test_the_wait_is_bounded_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    guard = ForkGuard(wait_seconds=0.2)
    release = threading.Event()
    inside = threading.Event()

    def stuck() -> None:
        with guard.section():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=stuck)
    thread.start()
    assert inside.wait(5)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="sqlease._db.sqlite.fork_guard"):
        guard._before_fork()
    waited = time.monotonic() - started
    guard._after_fork_in_parent()
    release.set()
    thread.join()
    assert 0.15 < waited < 5
    assert "still inside SQLite" in caplog.text


def test_children_forked_beside_a_busy_sqlite_thread_never_hang(tmp_path: Path) -> None:
    """A thread writes as the heartbeat and maintenance threads do (the direct transactions and
    SQLAlchemy transactions) while the main thread forks, as a worker replacing pool
    processes does; every child opens the database and reads it at once."""
    path = tmp_path / "app.db"
    store = Store(f"sqlite:///{path}", table_prefix=unique_prefix())
    stop = threading.Event()
    written = [0]

    def busy() -> None:
        while not stop.is_set():
            store.enqueue_many([NewMessage("q", "{}") for _ in range(5)])  # direct transactions
            store.size("q")  # SQLAlchemy, read transaction
            written[0] += 1

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        while written[0] < 3:
            time.sleep(0.01)
        for _ in range(25):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    conn = sqlite3.connect(path, timeout=5)
                    conn.execute(f"SELECT count(*) FROM {store.tables.messages.name}").fetchone()
                    conn.close()
                    code = 0 if fork_guard.others_inside() == 0 else 2
                finally:
                    os._exit(code)
            assert _wait_child(pid) == 0
    finally:
        stop.set()
        thread.join(10)
    assert written[0] > 3


def test_every_write_of_sqlease_runs_inside_the_fork_guard(tmp_path: Path) -> None:
    """A write transaction outside a section could be cut in two by a fork (see the module
    above). Every write the store, the results, the steps, Admin and maintenance make opens
    its transaction inside one: through the driver's ``writing()`` or its kept sqlite3
    connections, never an ``engine.begin()`` of its own."""
    from sqlalchemy import event

    from sqlease._core.maintenance import run_pass
    from sqlease._core.results import ResultStore
    from sqlease._core.steps import StepStore
    from sqlease.admin import Admin
    from sqlease.testing import FakeClock

    clock = FakeClock()
    store = Store(f"sqlite:///{tmp_path / 'guarded.db'}", table_prefix=unique_prefix(), clock=clock)
    outside: list[str] = []

    def begin(conn: object) -> None:
        if threading.get_ident() not in fork_guard._inside:
            outside.append("".join(__import__("traceback").format_stack(limit=8)))

    event.listen(store.engine, "begin", begin)
    admin = Admin(store.engine.url, store=store)
    results = ResultStore(store)
    store.enqueue("q", "{}", task_id="a")
    store.enqueue("q", "{}", task_id="b", run_id="r")
    store.enqueue("q", "{}", task_id="c")
    a, b, c = store.claim(["q"], "w", lease_ms=10_000, limit=3)
    store.renew([a.fence], lease_ms=10_000)
    store.compare_and_set(a.fence, "a", 0, checkpoint={"x": 1})
    StepStore(store).start(a.fence, "a", "step")
    results.put("celery-task-meta-a", b"{}", state="SUCCESS", task_id="a", fence=a.fence)
    results.incr("chord-counter")
    store.ack([a.fence])
    store.release([b.fence])
    store.fail(c.fence, "rejected")
    admin.requeue("c")
    admin.pause("b")
    admin.resume("b")
    admin.cancel("b")
    store.purge("q")
    store.declare_queue("other", expires_ms=1000)
    store.bind("ex", "other", "rk", "")
    store.set_limits({"queue:q": 2})
    run_pass(store, event_retention_ms=1)
    assert not outside, outside[0]
