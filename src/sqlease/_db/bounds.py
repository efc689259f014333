"""Database calls bounded by what is left of a lease (guarantees.md, invariant 14).

A call made for a delivery (its heartbeat renewal, a checkpoint, a step record, its result) is
worth nothing once the delivery's lease may be gone: another worker may hold the task. The
caller runs it inside ``bounded(remaining)``, where ``remaining()`` says how many seconds are
left (None: no bound is known). Everything below honours it, in the calling thread:

- the retry of transient errors (sqlease._db.retry) stops when the bound passes;
- on PostgreSQL, every wait for the server (a statement's answer, a commit, a new connection)
  stops at the bound, and the connection is closed, since its state is unknown
  (sqlease._db.postgresql.bounded);
- a call started with nothing left fails at once, without touching the network.

The error is SQLAlchemy's ``OperationalError`` (``CallBoundPassed`` as its ``orig``), as a
dropped connection's would be: the caller, which knows the lease, decides what it means.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from sqlalchemy.exc import OperationalError

#: Seconds left for the calls of this thread (None inside: no bound known).
Remaining = Callable[[], float | None]

_bound: ContextVar[Remaining | None] = ContextVar("sqlease_call_bound", default=None)


class CallBoundPassed(Exception):
    """The bound of a call passed before the database answered."""


@contextmanager
def bounded(remaining: Remaining) -> Iterator[None]:
    """Calls made inside (in this thread) end by the time ``remaining()`` reaches 0."""
    token = _bound.set(remaining)
    try:
        yield
    finally:
        _bound.reset(token)


def left() -> float | None:
    """Seconds left for the current call, None when unbounded (0.0 or less: passed)."""
    remaining = _bound.get()
    return None if remaining is None else remaining()


def passed_error(what: str = "the database call") -> OperationalError:
    """The error of a call whose bound passed."""
    reason = CallBoundPassed(f"{what} did not finish within the lease it was made for")
    return OperationalError(what, None, reason)


def check() -> None:
    """Raise ``passed_error`` if the current call's bound has passed."""
    seconds = left()
    if seconds is not None and seconds <= 0:
        raise passed_error()
