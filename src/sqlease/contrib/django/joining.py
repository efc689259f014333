"""Publishes inside ``transaction.atomic()`` join Django's transaction, on Django's connection.

Joining is automatic: ``sqlease.contrib.django``'s app registers ``open_atomic_blocks`` with
``sqlease.transactions``, and every sqlease publish (``delay``, ``apply_async``, ``send_task``,
canvas, the tasks backend) made while an ``atomic()`` block is open on the broker's database
writes its rows through that block's connection. Why automatic: a task published inside the
block but outside its transaction can run before the row it needs is committed, or be lost
when the block rolls back, and that is never what the code inside an ``atomic()`` block
means; ``transaction.on_commit(lambda: task.delay())`` keeps working as before (it runs after
the commit, outside any block). A publish while blocks are open only on other databases
raises ``ConfigurationError`` (``sqlease.transactions.joined``) instead of escaping them.

Each publish runs in a nested ``atomic()`` (a savepoint): a refused publish (a bad header, a
database error) rolls back to it and the caller's transaction goes on; Django's own
bookkeeping of the block stays right because the savepoint is Django's. Inside it, sqlease's
statements run on Django's DB-API connection through a SQLAlchemy engine whose pool hands out
that connection and never commits, rolls back or closes it: Django owns it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from sqlalchemy import Connection, create_engine
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import ConnectionPoolEntry, Pool

from sqlease.contrib.django.conf import url_of_alias
from sqlease.transactions import OpenTransaction

_engines: dict[tuple[str, str], Engine] = {}
_lock = threading.Lock()


def open_atomic_blocks() -> list[OpenTransaction]:
    """The ``atomic()`` blocks open in the calling thread, one per database alias."""
    from django.db import connections

    found = []
    for wrapper in connections.all(initialized_only=True):
        if wrapper.in_atomic_block:
            alias = wrapper.alias
            found.append(
                OpenTransaction(
                    name=f"Django's atomic() block on database alias {alias!r}",
                    url=url_of_alias(alias),
                    enter=partial(_savepoint, alias),
                )
            )
    return found


@contextmanager
def _savepoint(alias: str) -> Iterator[Connection]:
    from django.db import connections, transaction

    with transaction.atomic(using=alias):
        wrapper = connections[alias]
        wrapper.ensure_connection()
        with _engine_for(alias).connect() as conn:
            yield conn


def _engine_for(alias: str) -> Engine:
    url = url_of_alias(alias)
    key = (alias, url.render_as_string(hide_password=False))
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = _borrowing_engine(url, partial(_raw_connection, alias))
        return engine


def _raw_connection(alias: str) -> Any:
    from django.db import connections

    return connections[alias].connection


def _borrowing_engine(url: URL, raw: Callable[[], Any]) -> Engine:
    """A SQLAlchemy engine over the calling thread's Django connection."""
    engine = create_engine(url, pool=_BorrowedPool(raw))
    dialect: Any = engine.dialect
    # Django ends the transaction and closes the connection; SQLAlchemy does neither (closing
    # the SQLAlchemy connection "rolls back" its transaction: here that does nothing).
    dialect.do_commit = dialect.do_rollback = dialect.do_close = _leave_it
    return engine


def _leave_it(dbapi_connection: Any) -> None:
    return None


class _BorrowedPool(Pool):
    """Hands out the calling thread's Django connection: one pool record per thread, made
    again when Django has opened a new connection; nothing is reset, returned or closed."""

    def __init__(self, raw: Callable[[], Any], **kwargs: Any) -> None:
        kwargs.setdefault("reset_on_return", None)
        super().__init__(raw, **kwargs)
        self._raw = raw
        self._local = threading.local()

    def _do_get(self) -> ConnectionPoolEntry:
        record: Any = getattr(self._local, "record", None)
        if record is None or record.dbapi_connection is not self._raw():
            record = self._local.record = self._create_connection()
        return record  # type: ignore[no-any-return]

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        return None

    def recreate(self) -> Pool:
        return _BorrowedPool(self._raw, dialect=self._dialect, reset_on_return=None)

    def dispose(self) -> None:
        self._local = threading.local()

    def status(self) -> str:
        return "borrowed Django connection"
