"""The dialects sqlease supports, by name: the only place that chooses between them, and
what a dialect is to the rest of ``sqlease._db`` (``Dialect``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from sqlalchemy import Connection
from sqlalchemy.engine import URL, Engine

from sqlease._db.driver import Driver
from sqlease._db.postgresql.beat_fires import PgScheduleFires
from sqlease._db.postgresql.entry import POSTGRESQL
from sqlease._db.schedules import ScheduleFires
from sqlease._db.sqlite.beat_fires import SqliteScheduleFires
from sqlease._db.sqlite.entry import SQLITE
from sqlease._db.statements import Capabilities, Statements
from sqlease._db.tables import Tables


class Dialect(Protocol):
    """A dialect as the rest of ``sqlease._db`` knows it (each dialect package's ``entry``):
    how to reach it, what it can do, and what its schema needs besides the shared tables.
    ``sqlease._db.dialects`` finds one by name; nothing else chooses between them."""

    name: str
    #: what its driver raises for a lost or refused connection that reaches a caller unwrapped
    connection_errors: tuple[type[BaseException], ...]
    #: the ``get_engine`` options this dialect's engines take (the rest are ignored)
    engine_options: tuple[str, ...]

    def create_engine(self, url: URL, options: Mapping[str, Any]) -> Engine:
        """A new engine for ``url`` with ``options`` (those of ``engine_options``)."""

    def forget_engine(self, engine: Engine) -> None:
        """The engine is going for good: let go of what the dialect keeps for it."""

    def file_of(self, url: URL) -> str | None:
        """The file the database lives in, if it is one."""

    def database_key(self, url: URL) -> tuple[object, ...]:
        """What names one database: two URLs with one key reach the same one."""

    def commits_each_statement(self, dbapi_connection: Any) -> bool:
        """Would a write on this DBAPI connection (the caller's, whatever its driver) commit
        at once: autocommit mode with no transaction begun? False when it cannot tell."""

    def capabilities(self, url: URL) -> Capabilities:
        """What the database behind ``url`` can do (known before connecting)."""

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
        """The driver for a store on ``engine`` (``engines``: get_engine, for more)."""

    def statements(self, tables: Tables) -> Statements:
        """The statements for ``tables``, built once."""

    def lock_schema(self, conn: Connection, tables: Tables) -> None:
        """Inside a migration's transaction: serialize concurrent migrators."""

    def schema_step(self, version: int, conn: Connection, tables: Tables) -> None:
        """What migration ``version`` does on this dialect besides the shared part."""


def dialect_for(name: str) -> Dialect:
    """PostgreSQL for ``"postgresql"``, otherwise SQLite (the two dialects sqlease
    supports; sqlease.urls refuses any other scheme first)."""
    return POSTGRESQL if name == "postgresql" else SQLITE


def schedule_fires_for(
    name: str, tables: Tables, timeline_prefix: str, channel: str
) -> ScheduleFires:
    """The beat's batch of fires (``sqlease._db.schedules``) on the dialect ``name``."""
    if name == "postgresql":
        return PgScheduleFires(tables, timeline_prefix, channel)
    return SqliteScheduleFires(tables, timeline_prefix)


def capabilities_of(url: URL) -> Capabilities:
    """What the database behind ``url`` can do."""
    return dialect_for(url.get_backend_name()).capabilities(url)


def statements_for(name: str, tables: Tables) -> Statements:
    return dialect_for(name).statements(tables)


def same_database(mine: URL, theirs: URL) -> bool:
    """Do two URLs name one database (SQLite: one file, whatever the relative path)?"""
    first, second = dialect_for(mine.get_backend_name()), dialect_for(theirs.get_backend_name())
    return first.database_key(mine) == second.database_key(theirs)


def commits_each_statement(conn: Connection) -> bool:
    """Would a write on ``conn`` (a caller's connection) commit on its own, apart from the
    caller's other writes?"""
    dbapi_connection = conn.connection.dbapi_connection
    if dbapi_connection is None:  # closed: its own error comes with its first statement
        return False
    return dialect_for(conn.engine.url.get_backend_name()).commits_each_statement(dbapi_connection)


#: Errors of the dialects' own drivers that mean the connection was lost or refused (Kombu's
#: ``connection_errors`` lists them: a worker reconnects on one).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    *POSTGRESQL.connection_errors,
    *SQLITE.connection_errors,
)
