"""SQLite WAL checkpoints on a thread of their own, not in the writers' commits.

In WAL mode SQLite copies the log back into the database file (a checkpoint) inside the
commit that takes the log past ``wal_autocheckpoint`` pages (1,000 by default): that commit
writes the pages and waits for two fsyncs. In a Celery worker that commit is the event loop's
ack or claim, so every thousand pages or so the loop stalled for 20-36 ms, and checkpoints
made a commit cost twice what it does without them on average (110 against 47 us, 20,000
single-row commits on this machine; benchmarks/sqlite_checkpoints.py).

So every connection sqlease opens to a SQLite file sets ``wal_autocheckpoint=0``, and one
daemon thread per process runs ``PRAGMA wal_checkpoint(PASSIVE)`` for each file it has seen,
every ``INTERVAL`` seconds while the log has changed. PASSIVE never waits for a lock: readers
and the writer go on, and whatever they still need is left for the next round. The thread
releases the GIL while SQLite writes and syncs. A process that ends before its thread's next
round leaves frames in the log; they are committed (``synchronous=NORMAL`` keeps them across a
crash of the process), and the next round of any process, or the last connection's close,
copies them back.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

#: Seconds between two looks at the logs. Short enough that the log stays small (at 15,000
#: commits/s of one page each, about 1,500 pages) and that a power loss, which can take what
#: is in the log and not yet synced, takes at most this much of it; long enough to cost
#: nothing measurable (an ``os.stat`` per file when nothing changed).
INTERVAL = 0.1


#: Seconds the checkpoint thread's own connection waits for a lock when it opens the file. A
#: fork waits for the round under way (see Checkpointer), so this bounds that wait too.
OPEN_TIMEOUT = 1.0


@dataclass
class _File:
    path: str
    #: (mtime_ns, size) of the ``-wal`` file before the last checkpoint that completed.
    seen: tuple[int, int] | None = None
    failures: int = field(default=0)


class Checkpointer:
    """The process's checkpoint thread and the files it looks after.

    Fork safety: a child forked while the thread is inside SQLite would inherit SQLite's
    internal mutexes locked, and its first connection would hang (a Celery worker forks a new
    pool process whenever one is replaced). So a round holds ``_busy`` from start to end, and
    ``os.register_at_fork`` makes every fork wait for the round under way and start none until
    it is done; the child starts its own thread when it first connects."""

    def __init__(self, interval: float = INTERVAL) -> None:
        self.interval = interval
        self._files: dict[str, _File] = {}
        self._lock = threading.Lock()  # the files and the thread
        self._busy = threading.Lock()  # a round is under way
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(
                before=self._before_fork,
                after_in_parent=self._after_fork_in_parent,
                after_in_child=self._after_fork_in_child,
            )

    def watch(self, path: str) -> None:
        """Checkpoint ``path`` from now on (the thread starts on first use in each process)."""
        path = os.path.abspath(path)
        with self._lock:
            if path not in self._files:
                self._files[path] = _File(path)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="sqlease-sqlite-checkpoints", daemon=True
                )
                self._thread.start()

    def forget(self, path: str) -> None:
        with self._lock:
            self._files.pop(os.path.abspath(path), None)

    def stop(self) -> None:
        """End the thread (after its round under way); ``watch`` starts a new one."""
        with self._lock:
            thread, self._thread = self._thread, None
            wake, self._wake = self._wake, threading.Event()
        wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def run_once(self) -> None:
        """One round over the files (the thread's loop body; tests call it directly)."""
        with self._busy:
            with self._lock:
                files = list(self._files.values())
            for file in files:
                self._checkpoint(file)

    def _run(self) -> None:
        wake = self._wake
        while not wake.wait(self.interval):
            try:
                self.run_once()
            except Exception:  # never let the thread die: writers rely on it
                logger.debug("sqlease: SQLite checkpoint round failed", exc_info=True)

    def _checkpoint(self, file: _File) -> None:
        try:
            stat = os.stat(file.path + "-wal")
        except FileNotFoundError:
            if not os.path.exists(file.path):
                self.forget(file.path)  # the database is gone (a test's temporary file)
            return
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen == file.seen:
            return  # nothing written since the last complete checkpoint
        try:
            # mode=rw: never create a database that was removed meanwhile.
            conn = sqlite3.connect(f"file:{file.path}?mode=rw", uri=True, timeout=OPEN_TIMEOUT)
        except sqlite3.Error:
            self.forget(file.path)
            return
        try:
            busy, log_frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if not busy and copied == log_frames:
                file.seen = seen  # complete: nothing to do until the log changes again
            file.failures = 0
        except sqlite3.Error as exc:
            file.failures += 1
            if file.failures == 3:
                logger.warning("sqlease: SQLite checkpoints of %s keep failing: %s", file.path, exc)
        finally:
            conn.close()

    # ---- fork --------------------------------------------------------------------------

    def _before_fork(self) -> None:
        self._busy.acquire()
        self._lock.acquire()

    def _after_fork_in_parent(self) -> None:
        self._lock.release()
        self._busy.release()

    def _after_fork_in_child(self) -> None:
        # The parent's thread is not here; locks are fresh (the parent's were held).
        self._lock = threading.Lock()
        self._busy = threading.Lock()
        self._wake = threading.Event()
        self._thread = None


#: The process-wide checkpointer.
checkpointer = Checkpointer()
