"""Engines, one per database URL and set of options per process; each dialect makes its own
(sqlease._db.postgresql.engine, sqlease._db.sqlite.engine).

Engines are shared by the threads of a process and disposed in a forked child (a pooled
connection must never be used by two processes).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from sqlalchemy.engine import URL, Engine

from sqlease._db import translate
from sqlease._db.dialects import dialect_for
from sqlease._db.spares import drop_all as drop_all_spares
from sqlease.urls import to_sqlalchemy_url

_engines: dict[tuple[str, tuple[tuple[str, Any], ...]], Engine] = {}
_lock = threading.Lock()


def get_engine(
    url: str | URL,
    *,
    sqlite_synchronous: str = "NORMAL",
    busy_timeout_ms: int = 30_000,
    pool_size: int = 5,
    generic_plans: bool = False,
    wait_for_flush: bool = True,
    lease_ms: int = 60_000,
) -> Engine:
    """The process-wide engine for ``url`` and the options its dialect takes (created on
    first use; the others are ignored).

    ``sqlite_synchronous``, ``busy_timeout_ms``, ``pool_size``: SQLite's.
    ``generic_plans``: PostgreSQL, the hot path's own engine, whose sessions plan each
    prepared statement once (see sqlease._db.postgresql.engine.connect_args).
    ``wait_for_flush=False``: PostgreSQL, commits return before their WAL reaches the disk
    (for the lease traffic only). ``lease_ms``: PostgreSQL, the leases of the stores on it,
    which its connections' TCP keepalives follow."""
    sa_url = to_sqlalchemy_url(url)
    dialect = dialect_for(sa_url.get_backend_name())
    given = {
        "sqlite_synchronous": sqlite_synchronous.upper(),
        "busy_timeout_ms": busy_timeout_ms,
        "pool_size": pool_size,
        "generic_plans": bool(generic_plans),
        "wait_for_flush": bool(wait_for_flush),
        "lease_ms": int(lease_ms),
    }
    options = tuple((name, given[name]) for name in dialect.engine_options)
    key = (sa_url.render_as_string(hide_password=False), options)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = dialect.create_engine(sa_url, dict(options))
            translate.install(engine)
            _engines[key] = engine
        return engine


def dispose_all(close: bool = False) -> None:
    """Forget pooled connections (after fork, pass ``close=False``: the parent owns them)."""
    if close:
        drop_all_spares()
    with _lock:
        for engine in _engines.values():
            engine.dispose(close=close)
        if close:
            _engines.clear()


def dispose_files(folder: str) -> int:
    """Close and forget the engines of the database files under ``folder`` (their kept
    connections, their pools, their checkpoints): for files about to be deleted, such as a
    test's. Returns how many engines went."""
    from sqlease._db import spares

    prefix = os.path.join(os.path.abspath(folder), "")
    with _lock:
        gone = [
            (key, engine)
            for key, engine in _engines.items()
            if (path := dialect_for(engine.url.get_backend_name()).file_of(engine.url))
            and path.startswith(prefix)
        ]
        for key, _ in gone:
            del _engines[key]
    for _, engine in gone:
        spares.drop(spares.spares_of(engine))
        engine.dispose(close=True)
        dialect_for(engine.url.get_backend_name()).forget_engine(engine)
    return len(gone)


def _after_fork_in_child() -> None:
    # The lock may have been held by another thread at fork time: replace it.
    global _lock
    _lock = threading.Lock()
    for engine in list(_engines.values()):
        engine.dispose(close=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
