"""The driver for a database URL or engine."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from sqlalchemy.engine import URL, Engine

from sqlease._db.driver import Driver
from sqlease._db.postgresql.driver import PostgresDriver
from sqlease._db.sqlite.driver import SqliteDriver

if TYPE_CHECKING:
    from sqlease._db.statements import Statements


def same_database(mine: URL, theirs: URL) -> bool:
    """Do two URLs name one database (SQLite: one file, whatever the relative path)?"""

    def key(url: URL) -> tuple[object, ...]:
        database = url.database or ""
        if url.get_backend_name() == "sqlite" and not database.startswith("file:"):
            database = os.path.abspath(database)
        return (url.get_backend_name(), url.host, url.port, database)

    return key(mine) == key(theirs)


def driver_for(
    url: str | URL | Engine,
    engine: Engine,
    sql: Statements,
    *,
    lease_sync_commit: bool = False,
    publish_sync_commit: bool = True,
) -> Driver:
    """PostgreSQL (psycopg) or SQLite (sqlite3), by the engine's dialect."""
    if engine.dialect.name == "postgresql":
        return PostgresDriver(
            url,
            engine,
            lease_sync_commit=lease_sync_commit,
            publish_sync_commit=publish_sync_commit,
        )
    return SqliteDriver(url, engine, sql)
