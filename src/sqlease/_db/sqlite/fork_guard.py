"""Forks wait for this process's other threads to leave SQLite.

A child forked while another thread is inside SQLite inherits SQLite's process-wide mutexes
in the state they were in: with this build's memory statistics on (SQLite's default), every
allocation takes one, so a thread caught in the middle of any statement leaves it locked, and
the child hangs at its first SQLite call. A Celery worker forks a new pool process whenever
one is replaced (``--max-tasks-per-child``, a hard time limit, a crashed child) while its
heartbeat and maintenance threads may be renewing leases or pruning events.

So sqlease's SQLite work runs inside ``sqlite_section()``, and ``os.register_at_fork`` makes a
fork wait until no other thread is inside one and lets none enter until the fork is done. The
wait is bounded (``WAIT_SECONDS``): a fork is never blocked for good by a thread stuck behind
another process's write lock. (The checkpoint thread has its own guard, in
sqlease._db.sqlite.checkpoints.)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from sqlease._db import signal_defer

# Imported first so that the checkpointer's fork hooks are registered before ours: Python runs
# "before fork" hooks in reverse order, so ours runs first and waits for threads to leave
# their sections while the checkpointer's locks (which a thread opening a connection inside
# a section takes) are still free; the checkpointer's hook then waits for its own round.
from sqlease._db.sqlite import checkpoints as sqlite_checkpoints  # noqa: F401

logger = logging.getLogger(__name__)

#: The longest a fork waits for other threads to leave SQLite. A section is one short
#: transaction or one maintenance pass; SQLite's busy timeout bounds its waits for locks.
WAIT_SECONDS = 10.0


class ForkGuard:
    """Counts the threads inside SQLite; forks wait for the others to leave."""

    def __init__(self, wait_seconds: float = WAIT_SECONDS) -> None:
        self.wait_seconds = wait_seconds
        self._cond = threading.Condition()
        self._inside: dict[int, int] = {}  # thread ident -> nesting depth
        self._forking = False
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(
                before=self._before_fork,
                after_in_parent=self._after_fork_in_parent,
                after_in_child=self._after_fork_in_child,
            )

    @contextmanager
    def section(self) -> Iterator[None]:
        me = threading.get_ident()
        # The main thread's signals wait for it to leave (sqlease._db.signal_defer),
        # counted before the lock is taken so that no handler runs while it is held.
        main = signal_defer.on_main_thread()
        try:
            if main:
                signal_defer.entered()
            with self._cond:
                # A thread already inside never waits (the fork waits for it to leave instead).
                while self._forking and me not in self._inside:
                    self._cond.wait()
                self._inside[me] = self._inside.get(me, 0) + 1
            try:
                yield
            finally:
                with self._cond:
                    depth = self._inside[me] - 1
                    if depth:
                        self._inside[me] = depth
                    else:
                        del self._inside[me]
                        self._cond.notify_all()
        finally:
            if main:
                signal_defer.left()

    def others_inside(self) -> int:
        me = threading.get_ident()
        with self._cond:
            return sum(1 for ident in self._inside if ident != me)

    def _before_fork(self) -> None:
        me = threading.get_ident()
        with self._cond:
            self._forking = True
            deadline = time.monotonic() + self.wait_seconds
            while any(ident != me for ident in self._inside):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning(
                        "sqlease: forking while another thread is still inside SQLite "
                        "(waited %.0f s); the child may hang at its first SQLite call",
                        self.wait_seconds,
                    )
                    break
                self._cond.wait(remaining)

    def _after_fork_in_parent(self) -> None:
        with self._cond:
            self._forking = False
            self._cond.notify_all()

    def _after_fork_in_child(self) -> None:
        # Only the forking thread exists here; its sections (if any) are the parent's.
        self._cond = threading.Condition()
        self._inside = {}
        self._forking = False


#: The process-wide guard.
fork_guard = ForkGuard()


def sqlite_section() -> AbstractContextManager[None]:
    """A block of SQLite work that a fork must not cut in two."""
    return fork_guard.section()
