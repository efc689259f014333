"""The PostgreSQL hot path: one statement in autocommit, straight through psycopg.

Enqueue, claim, ack and result writes run for every task. SQLAlchemy's execution layer costs
about as much client CPU as the statement's round trip, so on PostgreSQL these statements
borrow a pooled connection from SQLAlchemy and run on the psycopg connection underneath.
Errors come out as SQLAlchemy's would (the same ``OperationalError`` for a dropped connection,
which the store's retry rides out; the same sqlease errors for refusals), and a broken
connection is invalidated so the pool replaces it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine
from sqlalchemy.sql.elements import TextClause

from .engine import refusal


class FastPath:
    """Runs the store's own statements (``text()`` clauses) on one engine."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._compiled: dict[int, tuple[TextClause, str]] = {}
        self._where = engine.url.render_as_string(hide_password=True)

    def _sql(self, statement: TextClause) -> str:
        # Keyed by identity: the store's statements are built once and live as long as it.
        cached = self._compiled.get(id(statement))
        if cached is None or cached[0] is not statement:
            cached = (statement, str(statement.compile(dialect=self._engine.dialect)))
            self._compiled[id(statement)] = cached
        return cached[1]

    def rows(self, statement: TextClause, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Execute in autocommit; the rows it returns (as dicts), or [] if none."""
        sql = self._sql(statement)
        with self._engine.connect() as conn:
            driver = conn.connection.dbapi_connection
            assert isinstance(driver, psycopg.Connection)
            try:
                driver.autocommit = True
                try:
                    with driver.cursor(row_factory=dict_row) as cursor:
                        cursor.execute(sql, params)
                        return cursor.fetchall() if cursor.description else []
                finally:
                    if not driver.closed:
                        driver.autocommit = False
            except psycopg.Error as error:
                raise self._as_sqlalchemy_error(conn, sql, params, error) from error

    def _as_sqlalchemy_error(
        self, conn: Any, sql: str, params: Mapping[str, Any], error: psycopg.Error
    ) -> BaseException:
        translated = refusal(error, self._where)
        if translated is not None:
            return translated
        dialect = self._engine.dialect
        wrapper = conn.connection
        disconnected = bool(dialect.is_disconnect(error, wrapper.dbapi_connection, None))  # type: ignore[arg-type]
        if disconnected:
            # As SQLAlchemy does on a disconnect: every pooled connection made before now is
            # suspect (a restarted server dropped them all), and this one is gone.
            self._engine.pool._invalidate(wrapper, error)
            conn.invalidate(error)
        return sa_exc.DBAPIError.instance(
            sql,
            dict(params),
            error,
            psycopg.Error,
            connection_invalidated=disconnected,
            dialect=dialect,
        )
