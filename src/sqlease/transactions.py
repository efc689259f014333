"""Transactional enqueue: ``with sqlease.transaction(conn): task.delay()`` writes the task in
the caller's SQLAlchemy transaction, so it exists iff that transaction commits.

A framework adapter may also offer the transactions its users open in its own way (Django's
``transaction.atomic()``, ``sqlease.contrib.django``): it registers a joiner, and a publish
made while one of those is open joins it as it would join ``sqlease.transaction()``'s."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection
from sqlalchemy.engine import URL

from sqlease._db.dialects import commits_each_statement, same_database
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
    if commits_each_statement(conn):
        raise ConfigurationError(
            "sqlease.transaction() was given a connection in autocommit mode with no "
            "transaction begun: the publish would commit on its own, whatever became of your "
            "writes. Begin a transaction on it (conn.begin(), or an engine without "
            "isolation_level='AUTOCOMMIT')"
        )
    return conn


@dataclass(frozen=True, slots=True)
class OpenTransaction:
    """A transaction a framework adapter found open in the calling thread."""

    #: How the error messages name it ("Django's atomic() block on database alias 'default'").
    name: str
    #: The database it runs on.
    url: URL
    #: Entered for one publish: the transaction's connection as SQLAlchemy's, inside a
    #: savepoint (a refused publish rolls back to it, and the caller's transaction goes on).
    enter: Callable[[], AbstractContextManager[Connection]]


#: The adapters' joiners: each lists the transactions open in the calling thread.
_joiners: list[Callable[[], Sequence[OpenTransaction]]] = []


def register_joiner(joiner: Callable[[], Sequence[OpenTransaction]]) -> None:
    """Make publishes join the transactions ``joiner`` finds open (once per joiner)."""
    if joiner not in _joiners:
        _joiners.append(joiner)


@contextmanager
def joined(url: URL) -> Iterator[Connection | None]:
    """The connection a publish to ``url`` (the broker's database) runs on, for as long as the
    publish lasts: ``sqlease.transaction()``'s, else an open transaction a joiner found on that
    database, else None (the publish commits on its own). A transaction open only on other
    databases raises ``ConfigurationError``: the publish would silently escape it."""
    conn = current_connection(url)
    if conn is not None or not _joiners:
        yield conn
        return
    found = [t for joiner in _joiners for t in joiner()]
    for candidate in found:
        if same_database(url, candidate.url):
            with candidate.enter() as joined_conn:
                yield joined_conn
            return
    if found:
        names = ", ".join(t.name for t in found)
        raise ConfigurationError(
            f"this publish goes to the broker's database ({url.render_as_string()}) while "
            f"{names} is open on another database: it cannot join that transaction and "
            "would escape it. Publish after the commit (transaction.on_commit) or outside "
            "the block, or put the broker on that database"
        )
    yield None


def open_transactions() -> tuple[object, ...]:
    """What a publish would join now, as a value to compare (``sqlease.batches``): the
    ``sqlease.transaction()`` connection and the transactions the joiners find open."""
    conn = _current.get()
    found = tuple(t.name for joiner in _joiners for t in joiner())
    return (None if conn is None else id(conn), found)
