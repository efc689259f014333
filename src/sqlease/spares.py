"""Connections an engine keeps checked out between the per-task statements, for the next one
on any thread (sqlease.fastpath on PostgreSQL, sqlease.sqlite_fast on SQLite).

Checking a connection out of SQLAlchemy's pool and back in (with, on PostgreSQL, the switch to
autocommit and back) cost more client CPU than the statement itself: about a third of a
``delay()``. One registry per process, keyed by engine, so that every store on an engine (one
per Celery app, Admin, result backend...) shares the same few. A forked child never uses its
parent's: they are set aside untouched (the parent owns their sockets and files).
"""

from __future__ import annotations

import os
import threading
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


def drop_all() -> None:
    """Close every engine's kept connections (engine.dispose_all(close=True))."""
    with _lock:
        every = list(_kept.values())
    for spares in every:
        while spares:
            try:
                fairy = spares.pop()
            except IndexError:
                break
            fairy.invalidate()
            fairy.close()


def _set_aside_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    for spares in list(_kept.values()):
        _inherited.extend(spares)
        spares.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_set_aside_in_child)
