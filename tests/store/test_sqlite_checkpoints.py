"""SQLite: WAL checkpoints run on the checkpointer's thread, never inside a writer's commit, and
nothing written is lost or left behind because of it."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

import pytest

from conftest import unique_prefix
from sqlease._db.sqlite.checkpoints import Checkpointer, checkpointer
from sqlease.store import NewMessage, Store

PAYLOAD = "x" * 3000  # about one page per message: a few hundred messages pass 1,000 pages


def _fill(store: Store, count: int) -> None:
    for start in range(0, count, 50):
        store.enqueue_many([NewMessage("q", PAYLOAD, task_id=f"t{start + i}") for i in range(50)])


def _wal_frames(path: Path) -> int:
    """Frames in the log, from its size (a 32-byte header, then a 24-byte header and one
    page per frame), so that looking does not checkpoint anything."""
    conn = sqlite3.connect(path)
    try:
        page = int(conn.execute("PRAGMA page_size").fetchone()[0])
    finally:
        conn.close()
    return (os.path.getsize(f"{path}-wal") - 32) // (page + 24)


def _watched(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str = "app.db",
    interval: float = 3600,
) -> tuple[Path, Store, Checkpointer]:
    """A database with a store on it, looked after by a checkpointer of the test's own (an
    hour's interval: no round by itself). The process's checkpointer is kept off the file for
    the whole test, not only at its start: every new connection would hand the file back to it
    and its rounds would race the test's (a PASSIVE checkpoint finds the other one busy)."""
    path = tmp_path / name
    real_watch = checkpointer.watch
    ours = os.path.abspath(path)
    monkeypatch.setattr(
        checkpointer,
        "watch",
        lambda watched: None if os.path.abspath(watched) == ours else real_watch(watched),
    )
    store = Store(f"sqlite:///{path}", table_prefix=unique_prefix())
    checkpointer.forget(str(path))
    own = Checkpointer(interval=interval)
    own.watch(str(path))
    return path, store, own


def test_sqlease_connections_leave_checkpoints_to_the_thread(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    store = Store(f"sqlite:///{path}", table_prefix=unique_prefix())
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar_one() == 0
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar_one() == "wal"
    assert str(path) in checkpointer._files


def test_commits_do_not_checkpoint_and_a_round_copies_the_log_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, store, own = _watched(tmp_path, monkeypatch)
    _fill(store, 1500)  # well past SQLite's default autocheckpoint of 1,000 pages
    frames = _wal_frames(path)
    assert frames > 1200, "the writers' commits checkpointed the log themselves"
    before = os.path.getsize(path)
    own.run_once()
    assert os.path.getsize(path) > before + 1200 * 4096 // 2  # the pages were copied back
    # Everything committed is there, read by a plain connection.
    conn = sqlite3.connect(path)
    try:
        count = conn.execute(f"SELECT count(*) FROM {store.tables.messages.name}").fetchone()[0]
    finally:
        conn.close()
    assert count == 1500
    # The log is reused from its start by the next writer: it does not keep growing.
    _fill(store, 100)
    frames_after = _wal_frames(path)
    assert frames_after <= frames
    own.run_once()
    assert own._files[str(path)].seen is not None


def test_an_unchanged_log_is_not_checkpointed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, store, own = _watched(tmp_path, monkeypatch)
    _fill(store, 50)
    own.run_once()
    opened: list[str] = []
    real_connect = sqlite3.connect
    monkeypatch.setattr(
        "sqlease._db.sqlite.checkpoints.sqlite3.connect",
        lambda *a, **k: opened.append(a[0]) or real_connect(*a, **k),
    )
    own.run_once()
    assert opened == []  # nothing written since: not even a connection
    _fill(store, 50)
    own.run_once()
    assert len(opened) == 1


def test_a_removed_database_is_forgotten_and_never_recreated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, store, own = _watched(tmp_path, monkeypatch, "gone.db")
    _fill(store, 10)
    store.engine.dispose()
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{path}{suffix}"):
            os.remove(f"{path}{suffix}")
    own.run_once()
    assert not path.exists()
    assert str(path) not in own._files


def test_the_thread_starts_once_per_process_and_checkpoints_by_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, store, own = _watched(tmp_path, monkeypatch, interval=0.01)
    thread = own._thread
    assert thread is not None and thread.is_alive() and thread.daemon
    own.watch(str(path))
    assert own._thread is thread
    _fill(store, 300)
    before = os.path.getsize(path)
    # The thread's own rounds copy the log back (a bounded wait on a real thread).
    for _ in range(500):
        if os.path.getsize(path) > before:
            break
        threading.Event().wait(0.01)
    assert os.path.getsize(path) > before
    own.stop()
    assert not thread.is_alive()


def test_a_fork_waits_for_the_round_under_way_and_the_child_checkpoints_on_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child forked while the thread is inside SQLite would inherit SQLite's mutexes locked
    (a replaced Celery pool process hung on its first connection): forks wait for the round."""
    path, store, own = _watched(tmp_path, monkeypatch)
    _fill(store, 20)
    order: list[str] = []
    in_round = threading.Event()

    def round_under_way() -> None:
        with own._busy:  # what run_once holds while it is inside SQLite
            in_round.set()
            threading.Event().wait(0.1)
            order.append("round done")

    holder = threading.Thread(target=round_under_way)
    holder.start()
    assert in_round.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: its own thread and locks, and a round that works
        code = 1
        try:
            assert own._thread is None and not own._busy.locked()
            own.watch(str(path))
            own.run_once()
            code = 0
        finally:
            os._exit(code)
    order.append("forked")
    holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert order == ["round done", "forked"]
    own.stop()
