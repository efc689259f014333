"""Engines, one per database URL per process, set up for short lease transactions.

SQLite: a file in WAL mode with a busy timeout, every transaction opened with
``BEGIN IMMEDIATE`` so that a writer takes the write lock up front (a deferred transaction
that later upgrades to a writer can fail with SQLITE_BUSY instead of waiting).
PostgreSQL: psycopg 3 through SQLAlchemy's pool (a restarted server is survived by
discarding the pool on the first disconnect error), and
``idle_in_transaction_session_timeout`` as a backstop: no stalled worker can hold a row lock
that blocks a takeover.

Engines are shared by the threads of a process and disposed in a forked child (a pooled
connection must never be used by two processes).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine

from sqlease._db import translate
from sqlease._db.postgresql import pooler
from sqlease._db.spares import drop_all as drop_all_spares
from sqlease._db.sqlite.checkpoints import checkpointer
from sqlease.urls import to_sqlalchemy_url

_engines: dict[tuple[str, tuple[tuple[str, Any], ...]], Engine] = {}
_lock = threading.Lock()

SQLITE_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")


def get_engine(
    url: str | URL,
    *,
    sqlite_synchronous: str = "NORMAL",
    busy_timeout_ms: int = 30_000,
    pool_size: int = 5,
    generic_plans: bool = False,
    wait_for_flush: bool = True,
) -> Engine:
    """The process-wide engine for ``url`` (created on first use).

    ``generic_plans``: PostgreSQL, the hot path's own engine, whose sessions plan each
    prepared statement once (see postgresql_connect_args); ignored for SQLite.
    ``wait_for_flush=False``: PostgreSQL, commits return before their WAL reaches the disk
    (for the lease traffic only, see postgresql_connect_args); ignored for SQLite."""
    sa_url = to_sqlalchemy_url(url)
    options = (
        ("sqlite_synchronous", sqlite_synchronous.upper()),
        ("busy_timeout_ms", busy_timeout_ms),
        ("pool_size", pool_size),
        ("generic_plans", bool(generic_plans) and sa_url.get_backend_name() != "sqlite"),
        ("wait_for_flush", bool(wait_for_flush) or sa_url.get_backend_name() == "sqlite"),
    )
    key = (sa_url.render_as_string(hide_password=False), options)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _create(sa_url, dict(options))
            _engines[key] = engine
        return engine


def _create(url: URL, options: dict[str, Any]) -> Engine:
    if url.get_backend_name() == "sqlite":
        engine = _create_sqlite(url, options)
    else:
        engine = _create_postgresql(url, options)
    translate.install(engine)
    return engine


def _create_sqlite(url: URL, options: dict[str, Any]) -> Engine:
    synchronous = options["sqlite_synchronous"]
    busy_ms = int(options["busy_timeout_ms"])
    engine = create_engine(
        url,
        connect_args={"timeout": busy_ms / 1000.0, "check_same_thread": False},
        pool_size=options["pool_size"],
        max_overflow=10,
        pool_pre_ping=False,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from pysqlite so that "begin" below decides.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
            cursor.execute(f"PRAGMA synchronous={synchronous}")
            cursor.execute("PRAGMA foreign_keys=ON")
            # Checkpoints run on a thread of their own, not in this connection's commits
            # (sqlease._db.sqlite.checkpoints: a worker's event loop stalled 20-36 ms in them).
            cursor.execute("PRAGMA wal_autocheckpoint=0")
            path = next(
                (row[2] for row in cursor.execute("PRAGMA database_list") if row[1] == "main"),
                "",
            )
            if path:  # "" for an in-memory or temporary database: nothing to checkpoint
                checkpointer.watch(path)
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # Readers (sizes, snapshots, timelines) must not take the write lock.
        if connection.get_execution_options().get("sqlease_read_only"):
            connection.exec_driver_sql("BEGIN")
        else:
            connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


#: Startup settings of sqlease's PostgreSQL sessions (see postgresql_connect_args for why).
SESSION_OPTIONS = "-c idle_in_transaction_session_timeout=60000 -c jit=off"

#: Added for the hot path's engine (generic_plans=True).
GENERIC_PLANS_OPTION = "-c plan_cache_mode=force_generic_plan"
#: Added for the lease traffic's engine (wait_for_flush=False).
NO_FLUSH_WAIT_OPTION = "-c synchronous_commit=off"

#: Seconds a connection attempt may take (libpq's connect_timeout) unless the URL says.
CONNECT_TIMEOUT_S = 10


#: pg_stat_activity's application_name of sqlease's connections, unless the URL names one.
APPLICATION_NAME = "sqlease"


def application_name(url: URL) -> str:
    """The URL's ``application_name``, else sqlease's."""
    value = url.query.get("application_name")
    if isinstance(value, tuple):
        value = value[-1]
    return value or APPLICATION_NAME


def postgresql_connect_args(
    url: URL, *, generic_plans: bool = False, wait_for_flush: bool = True
) -> dict[str, Any]:
    """What sqlease adds to a PostgreSQL URL's connection parameters. The URL's own
    ``options`` (say ``-c search_path=app``) are kept, after sqlease's so that they win;
    its ``connect_timeout`` is kept too."""
    clean, pooling = pooler.split(url)
    query = clean.query
    own = query.get("options")
    if isinstance(own, tuple):  # given more than once
        own = " ".join(own)
    # A worker stopped (SIGSTOP) mid-transaction must not hold locks for long.
    # No JIT: the claim is a short OLTP statement whose estimated cost can cross
    # jit_above_cost on a large backlog, and compiling it costs more than running it.
    session = SESSION_OPTIONS
    if generic_plans:
        # The hot path's engine (fastpath: enqueue, claim, ack, result writes). psycopg
        # prepares a statement a connection runs five times, but on `auto` PostgreSQL kept
        # re-planning the claim and ack for each call (their generic plan's estimate looks
        # dearer than the custom one), and planning cost as much server time as running
        # them: one process claiming and acking batches of 32 went from 5,400 to 10,600
        # tasks/s, server CPU per task from 112 to 57 us. Those statements are written so
        # that their plan does not depend on the values. The mode applies to every
        # statement with parameters, so the rest of sqlease (admin, maintenance, reads, the
        # idle worker's offer) keeps `auto` on its own engine: a generic plan for, say,
        # "the next due time after now" scanned the whole table.
        session = f"{session} {GENERIC_PLANS_OPTION}"
    if not wait_for_flush:
        # The lease traffic's engine (claims and acks, see Store): a commit that returns
        # before its WAL is flushed can only be lost with the server itself (a crash of
        # PostgreSQL or of its machine), never with a worker. A lost claim leaves its message
        # ready again, a lost ack leaves it leased until its lease expires: redelivered
        # either way, never lost (the task, under its new attempt, finds any result it
        # stored: guarantees.md, invariant 9). Any later commit that waits for the flush
        # (every publish, result, checkpoint and step) makes the earlier ones durable with
        # it, since the WAL is flushed in order. Publishes, results and the task context
        # keep waiting.
        session = f"{session} {NO_FLUSH_WAIT_OPTION}"
    # Behind a pooler in transaction mode no startup options go out (see pooler.py); the
    # URL's own options are the user's business and go out as given.
    args: dict[str, Any] = {
        # The URL's own application_name wins (psycopg would otherwise get ours over it):
        # pg_stat_activity then tells one deployment's connections from another's.
        "application_name": application_name(clean),
        **pooler.connect_args(pooling, session if not own else f"{session} {own}"),
    }
    if pooling.transaction and own:
        args["options"] = own
    if "connect_timeout" not in query:
        # Without it, a host that drops packets holds each attempt for the kernel's TCP
        # timeout (minutes), and Kombu's connect_timeout and failover never get their turn.
        args["connect_timeout"] = CONNECT_TIMEOUT_S
    return args


def _create_postgresql(url: URL, options: dict[str, Any]) -> Engine:
    clean, pooling = pooler.split(url)
    # ?pool_size= / ?max_overflow= cap every engine of the URL (docs/howto/operations.md,
    # "Connections").
    pool_size, max_overflow = pooler.pool_limits(url)
    engine = create_engine(
        clean,
        pool_size=pool_size,
        max_overflow=max_overflow,
        # No pre-ping: it costs a round trip per operation. A connection broken by a server
        # restart raises a disconnect error once, SQLAlchemy then drops the whole pool, and
        # Kombu/Celery retry the operation as a connection error.
        pool_pre_ping=False,
        pool_recycle=3600,
        connect_args=postgresql_connect_args(
            url, generic_plans=options["generic_plans"], wait_for_flush=options["wait_for_flush"]
        ),
    )
    if pooling.transaction:
        where = clean.render_as_string(hide_password=True)

        @event.listens_for(engine, "first_connect")
        def _check(dbapi_connection: Any, _record: Any) -> None:
            pooler.check_settings(dbapi_connection, where)

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
    """Close and forget the engines of the SQLite files under ``folder`` (their kept
    connections, their pools, their checkpoints): for files about to be deleted, such as a
    test's. Returns how many engines went."""
    from sqlease._db import spares

    prefix = os.path.join(os.path.abspath(folder), "")
    with _lock:
        gone = [
            (key, engine)
            for key, engine in _engines.items()
            if engine.url.get_backend_name() == "sqlite"
            and os.path.abspath(engine.url.database or "").startswith(prefix)
        ]
        for key, _ in gone:
            del _engines[key]
    for _, engine in gone:
        spares.drop(spares.spares_of(engine))
        engine.dispose(close=True)
        checkpointer.forget(str(engine.url.database))
    return len(gone)


def _after_fork_in_child() -> None:
    # The lock may have been held by another thread at fork time: replace it.
    global _lock
    _lock = threading.Lock()
    for engine in list(_engines.values()):
        engine.dispose(close=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
