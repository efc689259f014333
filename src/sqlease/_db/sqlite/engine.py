"""SQLite's engine: a file in WAL mode with a busy timeout, every transaction opened with
``BEGIN IMMEDIATE`` so that a writer takes the write lock up front (a deferred transaction
that later upgrades to a writer can fail with SQLITE_BUSY instead of waiting); readers open
a deferred one."""

from __future__ import annotations

import os
import sqlite3
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine

from sqlease._db.sqlite.checkpoints import checkpointer

SQLITE_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")


def create(url: URL, options: dict[str, Any]) -> Engine:
    synchronous = options["sqlite_synchronous"]
    busy_ms = int(options["busy_timeout_ms"])
    engine = create_engine(
        url,
        connect_args={"timeout": busy_ms / 1000.0, "check_same_thread": False},
        pool_size=options["pool_size"],
        max_overflow=10,
        pool_pre_ping=False,
    )

    @event.listens_for(engine, "do_connect")
    def _open(_dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        try:
            return sqlite3.connect(*cargs, **cparams)
        except sqlite3.OperationalError as exc:
            # sqlite3 says "unable to open database file" without saying which.
            raise sqlite3.OperationalError(_why_not_opened(exc, url.database)) from exc

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


def _why_not_opened(error: sqlite3.OperationalError, database: str | None) -> str:
    if not database or database == ":memory:" or database.startswith("file:"):
        return str(error)
    path = os.path.abspath(database)
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        why = f"its directory {folder} does not exist"
    elif not os.access(folder, os.W_OK | os.X_OK):
        why = f"its directory {folder} is not writable by this process"
    elif os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        why = "the file is not readable and writable by this process"
    else:
        return f"{error} (SQLite database {path})"
    return f"{error}: SQLite database {path} ({why})"


def forget(engine: Engine) -> None:
    """The engine's file is about to go: stop checkpointing it."""
    checkpointer.forget(str(engine.url.database))
