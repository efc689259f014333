"""A signal's handler waits for the main thread to leave SQLite (sqlease._db.signal_defer):
Python runs it between two bytecodes of the main thread, possibly inside a write transaction,
and a handler that takes its time (Celery's soft shutdown sleeps in its own) would hold the
database's write lock all along. Real SQLite transactions on this process's main thread, a
real signal; the waits are those of a thread holding the write lock for a moment."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from conftest import unique_prefix
from sqlease._db import signal_defer
from sqlease._db.sqlite.fork_guard import sqlite_section
from sqlease.store import Store

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        threading.current_thread() is not threading.main_thread(),
        reason="signal handlers run in the main thread",
    ),
]


def _lock_is_free(path: Path) -> bool:
    """Whether another connection can take the write lock at once."""
    probe = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        probe.close()


@pytest.fixture
def usr1() -> Iterator[None]:
    before = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, before)


def test_a_signal_inside_a_section_is_handled_as_the_thread_leaves_it(
    tmp_path: Path, usr1: None
) -> None:
    path = tmp_path / "db.sqlite"
    seen: list[tuple[str, bool]] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        seen.append(("handled", _lock_is_free(path)))

    signal.signal(signal.SIGUSR1, handler)
    assert signal_defer.defer_handlers([signal.SIGUSR1]) == [signal.SIGUSR1]
    assert signal_defer.defer_handlers([signal.SIGUSR1]) == []  # wrapped once

    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (x)")
    with sqlite_section():
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t VALUES (1)")
        signal.raise_signal(signal.SIGUSR1)  # Python runs the handler right after this call
        seen.append(("inside", _lock_is_free(path)))
        conn.execute("COMMIT")
    seen.append(("after", True))
    conn.close()
    # Handled once the section was left, with the write lock free.
    assert seen == [("inside", False), ("handled", True), ("after", True)]

    signal.raise_signal(signal.SIGUSR1)  # outside any section: at once
    assert seen[-1] == ("handled", True)


def _first_installs_second() -> list[str]:
    """SIGUSR1's handler ``first`` installs ``second``, as Celery's handlers install the next
    one; wrapped. Returns where each records its call."""
    calls: list[str] = []

    def second(signum: int, frame: FrameType | None) -> None:
        calls.append("second")

    def first(signum: int, frame: FrameType | None) -> None:
        calls.append("first")
        signal.signal(signal.SIGUSR1, second)

    signal.signal(signal.SIGUSR1, first)
    signal_defer.defer_handlers([signal.SIGUSR1])
    return calls


def test_a_handler_installed_by_a_handler_is_wrapped_too(usr1: None) -> None:
    """Celery's handlers install the next one (the first Ctrl+C the cold shutdown's)."""
    calls = _first_installs_second()
    signal.raise_signal(signal.SIGUSR1)
    assert calls == ["first"]
    installed = getattr(signal.getsignal(signal.SIGUSR1), "sqlease_deferred", None)
    assert installed is not None and installed.__name__ == "second"
    with sqlite_section():
        signal.raise_signal(signal.SIGUSR1)
        assert calls == ["first"]
    assert calls == ["first", "second"]


def test_signals_inside_a_section_run_the_handlers_installed_when_it_is_left(
    usr1: None,
) -> None:
    """Each signal once, as the OS keeps them, and by the handler installed by then: Celery's
    first Ctrl+C installs the cold shutdown's handler, which a second Ctrl+C must reach."""
    calls = _first_installs_second()
    with sqlite_section():
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)
        assert calls == []
    assert calls == ["first"]  # the two came as one
    with sqlite_section():
        signal.raise_signal(signal.SIGUSR1)
    assert calls == ["first", "second"]


def test_the_count_of_sections_never_goes_below_zero(usr1: None) -> None:
    """A handler that raised as a section was entered may keep its count from being taken;
    the section's exit must not leave signals waiting for good."""
    calls: list[str] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append("handled"))
    signal_defer.defer_handlers([signal.SIGUSR1])
    signal_defer.left()  # an exit without its entry
    signal.raise_signal(signal.SIGUSR1)
    assert calls == ["handled"]


def test_a_signal_during_a_store_write_waits_for_its_commit(tmp_path: Path, usr1: None) -> None:
    """The case met with Celery's soft shutdown: the main thread waits in ``BEGIN
    IMMEDIATE`` for another connection's write lock, the signal comes meanwhile, and its
    handler runs as the wait ends, inside the store's transaction, unless it is deferred."""
    path = tmp_path / "sqlease.db"
    prefix = unique_prefix()
    store = Store(f"sqlite:///{path}", table_prefix=prefix)
    try:
        store.enqueue("q", "first")
        seen: list[bool] = []
        signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(_lock_is_free(path)))
        signal_defer.defer_handlers([signal.SIGUSR1])

        main = threading.main_thread().ident
        assert main is not None
        held = threading.Event()

        def hold_signal_then_let_go() -> None:
            holder = sqlite3.connect(path, isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")
            held.set()
            deadline = time.monotonic() + 10
            while not signal_defer._depth and time.monotonic() < deadline:
                threading.Event().wait(0.005)  # until the main thread is in its section
            threading.Event().wait(0.05)  # and waiting for the lock
            signal.pthread_kill(main, signal.SIGUSR1)
            threading.Event().wait(0.1)
            holder.execute("COMMIT")
            holder.close()

        thread = threading.Thread(target=hold_signal_then_let_go)
        thread.start()
        assert held.wait(5)
        store.enqueue("q", "second")  # waits for the holder's lock
        thread.join()
        assert seen == [True]  # handled after the enqueue's commit, the lock free
        with sqlite3.connect(path) as check:
            assert check.execute(f"SELECT count(*) FROM {prefix}messages").fetchone() == (2,)
    finally:
        store.engine.dispose()
