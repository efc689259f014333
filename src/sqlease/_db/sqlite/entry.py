"""SQLite as ``sqlease._db.dialects`` knows it."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import URL, Engine

from sqlease._db.driver import Driver
from sqlease._db.sqlite import engine as sqlite_engine
from sqlease._db.sqlite import statements as sqlite_statements
from sqlease._db.sqlite.dialect import CAPABILITIES
from sqlease._db.sqlite.driver import SqliteDriver
from sqlease._db.statements import Capabilities, Statements
from sqlease._db.tables import Tables


class _SQLite:
    name: str = "sqlite"
    #: what its driver raises for a lost or refused connection that reaches a caller
    #: unwrapped (its own sockets: the listener)
    connection_errors: tuple[type[BaseException], ...] = ()
    engine_options: tuple[str, ...] = ("sqlite_synchronous", "busy_timeout_ms", "pool_size")

    def create_engine(self, url: URL, options: Mapping[str, Any]) -> Engine:
        return sqlite_engine.create(url, dict(options))

    def forget_engine(self, engine: Engine) -> None:
        sqlite_engine.forget(engine)

    def file_of(self, url: URL) -> str | None:
        database = url.database or ""
        if not database or database == ":memory:" or database.startswith("file:"):
            return None
        return os.path.abspath(database)

    def database_key(self, url: URL) -> tuple[object, ...]:
        # One file, whatever the relative path that names it.
        database = url.database or ""
        if not database.startswith("file:"):
            database = os.path.abspath(database)
        return (self.name, url.host, url.port, database)

    def capabilities(self, url: URL) -> Capabilities:
        return CAPABILITIES

    def commits_each_statement(self, dbapi_connection: Any) -> bool:
        # sqlite3 begins a transaction before a write by itself unless it is in autocommit
        # mode: ``autocommit=True`` (Python 3.12), or ``isolation_level=None`` under the legacy
        # control (sqlease's own connections: they send BEGIN themselves, so ``in_transaction``
        # is what tells).
        autocommit = getattr(dbapi_connection, "autocommit", None)
        if autocommit is False:  # PEP 249 mode: always inside a transaction
            return False
        manual = autocommit is True or (getattr(dbapi_connection, "isolation_level", "") is None)
        return manual and getattr(dbapi_connection, "in_transaction", True) is False

    def driver(
        self,
        url: str | URL | Engine,
        engine: Engine,
        tables: Tables,
        *,
        lease_sync_commit: bool,
        publish_sync_commit: bool,
        engines: Callable[..., Engine],
    ) -> Driver:
        # Every commit waits for SQLite's own `synchronous` setting; there are no lanes.
        return SqliteDriver(url, engine, tables)

    def statements(self, tables: Tables) -> Statements:
        return sqlite_statements(tables)

    def lock_schema(self, conn: Connection, tables: Tables) -> None:
        pass  # BEGIN IMMEDIATE already holds the database's write lock

    def schema_step(self, version: int, conn: Connection, tables: Tables) -> None:
        pass  # no table settings, sequences or batch rows of its own


SQLITE = _SQLite()
