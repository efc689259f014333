"""Riding out database restarts and dropped connections.

A pooled connection that the server closed (restart, failover, ``pg_terminate_backend``,
an idle timeout) fails once; SQLAlchemy then invalidates the pool. Store operations retry such
operational errors with a short backoff for a bounded time instead of failing the task or the
worker. Every operation is safe to repeat: fenced writes are refused when their first try
already committed (an ack is then reported as stale), compare-and-set sees the new revision,
upserts are idempotent, and a publish looks for what its try before committed before it
stores anything (``sqlease._core.messages``).

A call bounded by a lease (sqlease._db.bounds) retries for as long as its bound lasts,
whatever the store's own window (an outage shorter than the lease costs a task's checkpoint or
result nothing: the transport rides it out too, sqlease.transport._outage), and does not start
once it has passed.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from sqlease._db import bounds

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: How long an operation keeps retrying before the error is raised to the caller.
RETRY_SECONDS = 20.0


def lost_connection(exc: BaseException) -> bool:
    """The error says the statement's connection dropped (a lost connection of another
    error class included): it may have run, unheard. Not a program limit the server reported
    (SQLSTATE class 54: an index entry or a NOTIFY payload too large), which psycopg also
    calls operational and which no retry changes."""
    if isinstance(exc, OperationalError):
        return not _program_limit(exc)
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def _program_limit(exc: DBAPIError) -> bool:
    sqlstate = getattr(exc.orig, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate.startswith("54")


def retry_transient(fn: F, seconds: float = RETRY_SECONDS) -> F:
    """Retry ``fn`` on operational errors for up to ``seconds`` (see the module's docstring)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("connection") is not None:  # the caller's transaction: theirs to retry
            return fn(*args, **kwargs)
        delay = 0.05
        deadline = time.monotonic() + seconds
        while True:
            bounds.check()
            try:
                return fn(*args, **kwargs)
            except (OperationalError, PoolTimeout, DBAPIError) as exc:
                if not isinstance(exc, PoolTimeout) and not lost_connection(exc):
                    raise
                left = bounds.left()
                if left is not None and left <= delay:
                    # No retry fits in what is left of the lease: wait out the lease. A
                    # renewal confirmed meanwhile (the heartbeat reconnected) moves the bound
                    # on, and the call goes on; else the caller learns at its end (then its
                    # lease clock has run out, and it knows what that means).
                    time.sleep(max(0.0, left))
                    still = bounds.left()
                    if still is not None and still > 0:
                        continue
                    raise
                if left is None and time.monotonic() + delay > deadline:
                    raise
                logger.info(
                    "sqlease: database operation %s failed (%s); retrying in %.2fs",
                    fn.__name__,
                    str(exc).splitlines()[0][:200],
                    delay,
                )
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    return wrapper  # type: ignore[return-value]


def transient(fn: F) -> F:
    """Mark an operation as safe to repeat: it retries operational errors for up to
    ``RETRY_SECONDS`` (see the module's docstring). A call given the caller's ``connection``
    is not retried: the caller's transaction is theirs to retry."""
    return retry_transient(fn)
