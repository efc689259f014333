"""Connections an engine keeps checked out between the per-task statements, for the next one
on any thread (sqlease._db.postgresql.direct on PostgreSQL, sqlease._db.sqlite.direct on SQLite).

Checking a connection out of SQLAlchemy's pool and back in (with, on PostgreSQL, the switch to
autocommit and back) cost more client CPU than the statement itself: about a third of a
``delay()``. One registry per process, keyed by engine, so that every store on an engine (one
per Celery app, Admin, result backend...) shares the same few. A forked child never uses its
parent's: they are set aside untouched (the parent owns their sockets and files).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from typing import Any

from sqlalchemy.engine import Engine

#: How many an engine keeps: a producer thread and a pool process's result writes each find
#: one; more callers at once go through the pool as before.
SPARES_PER_ENGINE = 2

_kept: weakref.WeakKeyDictionary[Engine, deque[Any]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
#: A forked child's copies of its parent's: never used, never closed, only kept from being
#: finalized (which could reset a connection the parent is using).
_inherited: list[Any] = []


def spares_of(engine: Engine) -> deque[Any]:
    """The engine's kept connections (SQLAlchemy pool fairies): pop one, append it back."""
    with _lock:
        spares = _kept.get(engine)
        if spares is None:
            spares = _kept[engine] = deque()
        return spares


def take(spares: deque[Any], pool: Any) -> Any | None:
    """A kept connection the pool would still lend, or None. One it would not (the engine
    was disposed since, the connection is older than ``pool_recycle``, or made before the pool
    was last invalidated: a disconnect seen by any of its users) is closed on the way."""
    while True:
        try:
            fairy = spares.pop()
        except IndexError:
            return None
        if fairy._pool is pool and fairy.dbapi_connection is not None and _current(fairy, pool):
            return fairy
        _close(fairy)


def room(pool: Any) -> int:
    """How many connections the engine may keep: SPARES_PER_ENGINE, but under a hard cap
    (``max_overflow=0``) always one fewer than the pool's size, so that a caller of the
    pool itself never waits for a connection that sits idle here."""
    size = pool.size() if hasattr(pool, "size") else SPARES_PER_ENGINE + 1
    overflow = getattr(pool, "_max_overflow", 1)
    if overflow != 0:
        return SPARES_PER_ENGINE
    return max(0, min(SPARES_PER_ENGINE, size - 1))


def keep(spares: deque[Any], fairy: Any, pool: Any) -> bool:
    """Keep ``fairy`` for the next call if there is room (False: the caller gives it back)."""
    if len(spares) < room(pool) and fairy._pool is pool:
        spares.append(fairy)
        return True
    return False


def count(spares: deque[Any], pool: Any) -> int:
    """How many of the kept connections belong to the engine's current pool."""
    return sum(fairy._pool is pool for fairy in list(spares))


def drop(spares: deque[Any]) -> None:
    """Close the kept connections (after a disconnect they are as suspect as the pool's)."""
    while spares:
        try:
            fairy = spares.pop()
        except IndexError:
            break
        _close(fairy)


def drop_all() -> None:
    """Close every engine's kept connections (engine.dispose_all(close=True))."""
    with _lock:
        every = list(_kept.values())
    for spares in every:
        drop(spares)


def _current(fairy: Any, pool: Any) -> bool:
    record = getattr(fairy, "_connection_record", None)
    if record is None:
        return False
    recycle = getattr(pool, "_recycle", -1)
    if recycle >= 0 and time.time() - record.starttime > recycle:
        return False
    invalidated = getattr(pool, "_invalidate_time", 0)
    return not (invalidated and record.starttime < invalidated)


def _close(fairy: Any) -> None:
    if fairy.dbapi_connection is not None:
        fairy.invalidate()  # closes the driver's connection: never lent again
    fairy.close()


def _set_aside_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    for spares in list(_kept.values()):
        _inherited.extend(spares)
        spares.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_set_aside_in_child)
