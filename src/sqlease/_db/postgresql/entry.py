"""PostgreSQL as ``sqlease._db.dialects`` knows it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from sqlalchemy import Connection
from sqlalchemy.engine import URL, Engine

from sqlease._db.driver import Driver
from sqlease._db.postgresql import engine as pg_engine
from sqlease._db.postgresql import pooler, schema
from sqlease._db.postgresql import statements as pg_statements
from sqlease._db.postgresql.dialect import capabilities
from sqlease._db.postgresql.driver import PostgresDriver
from sqlease._db.statements import Capabilities, Statements
from sqlease._db.tables import Tables


class _PostgreSQL:
    name: str = "postgresql"
    #: what its driver raises for a lost or refused connection that reaches a caller
    #: unwrapped (its own sockets: the listener)
    connection_errors: tuple[type[BaseException], ...] = (
        psycopg.OperationalError,
        psycopg.InterfaceError,
    )
    engine_options: tuple[str, ...] = ("generic_plans", "wait_for_flush", "lease_ms")

    def create_engine(self, url: URL, options: Mapping[str, Any]) -> Engine:
        return pg_engine.create(url, dict(options))

    def forget_engine(self, engine: Engine) -> None:
        pg_engine.forget(engine)

    def file_of(self, url: URL) -> str | None:
        return None

    def database_key(self, url: URL) -> tuple[object, ...]:
        return (self.name, url.host, url.port, url.database or "")

    def capabilities(self, url: URL) -> Capabilities:
        return capabilities(pooler.split(url)[1])

    def commits_each_statement(self, dbapi_connection: Any) -> bool:
        # psycopg 3 and psycopg2 both: autocommit on, and no BEGIN sent (IDLE is 0 in both).
        # A driver without these attributes cannot tell, and is taken as transactional.
        if getattr(dbapi_connection, "autocommit", False) is not True:
            return False
        status = getattr(getattr(dbapi_connection, "info", None), "transaction_status", None)
        return status is not None and int(status) == 0

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
        return PostgresDriver(
            url,
            engine,
            tables,
            lease_sync_commit=lease_sync_commit,
            publish_sync_commit=publish_sync_commit,
            engines=engines,
        )

    def statements(self, tables: Tables) -> Statements:
        return pg_statements(tables)

    def lock_schema(self, conn: Connection, tables: Tables) -> None:
        schema.lock(conn, tables)

    def schema_step(self, version: int, conn: Connection, tables: Tables) -> None:
        schema.step(version, conn, tables)


POSTGRESQL = _PostgreSQL()
