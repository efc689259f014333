"""Signal handlers wait for the main thread to leave its database section.

Python runs a signal's handler in the main thread, between two bytecodes of whatever it was
doing: possibly inside a SQLite ``BEGIN IMMEDIATE`` transaction, with the database's write
lock held. A handler that takes its time then holds that lock for as long. Celery's soft
shutdown does exactly that: on ``SIGQUIT`` (or a second Ctrl+C) with
``worker_soft_shutdown_timeout`` set, its handler sleeps for that timeout in the main thread.
Caught inside one of the worker's transactions, the lock stayed held for the whole window: the
process's own heartbeat could not renew its leases (the tasks it was still running lost them
to another worker), and every other process's writes, ``delay()`` included, waited for it or
failed.

So the handlers a sqlease worker runs with (Celery's shutdown handlers, ``defer_handlers``)
are wrapped: a signal that comes while the main thread (the OS thread: under gevent or
eventlet, any greenlet on it) is inside a section (``entered`` and
``left``, called by the SQLite driver's fork guard around each transaction,
sqlease._db.sqlite.fork_guard) is handled as the thread leaves it, after its ``COMMIT`` or
``ROLLBACK``. A section is one short transaction, so the delay is that of a statement, or of
SQLite's busy timeout at worst. A handler that raises (Celery's hard shutdown) raises there,
after the commit. PostgreSQL's hot path holds no transaction open between two statements of
the loop's thread, and does not use sections.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any]

#: The main thread's nesting in sections (only code on the main thread changes it).
_depth = 0
#: The signals that came inside a section, in their order, each once (as the OS keeps them).
_pending: dict[int, FrameType | None] = {}
#: The main thread by its OS id: under gevent or eventlet every greenlet on it runs its signal
#: handlers, and ``threading.get_ident`` names the greenlet.
_main = threading.main_thread().native_id


def on_main_thread() -> bool:
    return threading.get_native_id() == _main


def entered() -> None:
    """(Main thread.) Called before taking any lock of a section."""
    global _depth
    _depth += 1


def left() -> None:
    """(Main thread.) Called once a section's locks are given up. Leaving the outermost one,
    the signals that came meanwhile are handled, in their order, each by the handler
    installed for it now (a handler may have installed the next one meanwhile, as Celery's
    first Ctrl+C installs the cold shutdown's)."""
    global _depth
    # Never below 0: a handler that raised as a section was entered may have kept its count
    # from being taken (the section's exit still calls this).
    if _depth > 0:
        _depth -= 1
    while not _depth and _pending:
        signum = next(iter(_pending))
        frame = _pending.pop(signum)
        handler = signal.getsignal(signum)
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(signum)  # its default action, as it would have had


def deferred(handler: Handler, rewrap: tuple[int, ...] = ()) -> Handler:
    """``handler``, run at once outside a section and as the main thread leaves one inside.
    After it ran, the handlers then installed for ``rewrap`` are wrapped too: Celery's
    handlers install the next ones (the first Ctrl+C the cold shutdown's, the cold shutdown
    the hard one's)."""

    def run_outside_sqlite(signum: int, frame: FrameType | None) -> Any:
        if _depth:
            _pending[signum] = frame
            return None
        try:
            return handler(signum, frame)
        finally:
            if rewrap:
                defer_handlers(rewrap)

    run_outside_sqlite.sqlease_deferred = handler  # type: ignore[attr-defined]
    return run_outside_sqlite


def defer_handlers(signums: Iterable[int]) -> list[int]:
    """Wrap the Python handlers installed for ``signums`` (once each; from the main thread
    only, where handlers are set). Returns the signals wrapped now."""
    if not on_main_thread():
        return []
    watched = tuple(signums)
    wrapped = []
    for signum in watched:
        handler = signal.getsignal(signum)
        if not callable(handler) or hasattr(handler, "sqlease_deferred"):
            continue
        signal.signal(signum, deferred(handler, watched))
        wrapped.append(signum)
    return wrapped


def _after_fork_in_child() -> None:
    # The forking thread is the child's main thread; the parent's sections are not its own.
    global _depth, _main
    _depth = 0
    _pending.clear()
    _main = threading.get_native_id()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
