"""Transactional enqueue: ``with sqlease.transaction(conn): task.delay()`` writes the task in
the caller's SQLAlchemy transaction, so it exists iff that transaction commits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection
from sqlalchemy.engine import URL

from sqlease._db.dialects import same_database
from sqlease.errors import ConfigurationError

if TYPE_CHECKING:
    from sqlease.store import Store

_current: ContextVar[Connection | None] = ContextVar("sqlease_transaction", default=None)


@contextmanager
def transaction(conn_or_session: Any) -> Iterator[Connection]:
    """Publish sqlease messages inside the given Connection's (or Session's) transaction."""
    if isinstance(conn_or_session, Connection):
        conn = conn_or_session
    elif hasattr(conn_or_session, "connection") and callable(conn_or_session.connection):
        conn = conn_or_session.connection()  # an ORM Session: its current connection
    else:
        raise TypeError(
            "sqlease.transaction() takes a SQLAlchemy Connection or Session, not "
            f"{type(conn_or_session).__name__}"
        )
    token = _current.set(conn)
    try:
        yield conn
    finally:
        _current.reset(token)


def current_connection(store: Store | URL) -> Connection | None:
    """The caller's transaction to publish in, if one is active (and on the broker's
    database; given the store or just its URL)."""
    conn = _current.get()
    if conn is None:
        return None
    mine = store if isinstance(store, URL) else store.engine.url
    if not same_database(mine, conn.engine.url):
        raise ConfigurationError(
            "sqlease.transaction() was given a connection to a different database than the "
            "broker's; the enqueue cannot join that transaction"
        )
    return conn
