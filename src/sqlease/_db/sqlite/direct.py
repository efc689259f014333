"""The SQLite hot path: the per-task write transactions straight through ``sqlite3``.

On SQLite the database work of an enqueue, claim or ack is a few tens of microseconds; the
SQLAlchemy execution layer around it (pool checkout and checkin, events, compiled caches,
result objects) cost two to three times that (an enqueue: 818 against 263 us of CPU,
measured with benchmarks/store.py). In a worker these transactions run in the
event loop, and every producer's ``delay()`` is one. So, like the PostgreSQL DirectLane, the
store runs them on the ``sqlite3`` connection underneath a pooled one, which the engine keeps
between transactions (sqlease._db.spares), through ``Transaction``: the small part of
SQLAlchemy's Connection API that those operations use (``execute`` with one parameter dict or
a list of them, and results' ``fetchall``, ``scalar_one``, ``scalar``, ``rowcount``, rows'
``_mapping``).

Errors come out as SQLAlchemy's would (``OperationalError`` for a busy or locked database,
which the store's retry rides out) or as the same sqlease errors (a read-only file), and the
transaction is rolled back, as ``engine.begin()`` does.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Engine
from sqlalchemy.sql.elements import ClauseElement

from sqlease._db import spares as spares_module
from sqlease._db.spares import spares_of
from sqlease._db.sqlite.fork_guard import sqlite_section
from sqlease._db.translate import translate

#: Compiles statements with ``:name`` placeholders, which sqlite3 binds from a dict itself.
_NAMED = sqlite_dialect.dialect(paramstyle="named")


class Row:
    """One result row: by position, by name (``row.id``) and as ``row._mapping``."""

    __slots__ = ("_fields", "_mapping", "_values")

    def __init__(self, fields: tuple[str, ...], values: tuple[Any, ...]) -> None:
        self._fields = fields
        self._values = values
        self._mapping = dict(zip(fields, values, strict=True))

    def __getitem__(self, index: int) -> Any:
        return self._values[index]

    def __getattr__(self, name: str) -> Any:
        try:
            return self._mapping[name]
        except KeyError:
            raise AttributeError(name) from None

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


class Result:
    def __init__(self, rows: list[Row], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def fetchall(self) -> list[Row]:
        return self._rows

    def __iter__(self) -> Iterator[Row]:
        return iter(self._rows)

    def first(self) -> Row | None:
        return self._rows[0] if self._rows else None

    def scalar(self) -> Any:
        return self._rows[0][0] if self._rows else None

    def scalar_one(self) -> Any:
        if not self._rows:
            raise sa_exc.NoResultFound("no row was found when exactly one was required")
        if len(self._rows) > 1:
            raise sa_exc.MultipleResultsFound("multiple rows were found when one was required")
        return self._rows[0][0]


class Transaction:
    """A write transaction on one raw ``sqlite3`` connection (see the module's docstring)."""

    def __init__(self, raw: sqlite3.Connection, sql_of: Any, where: str) -> None:
        self._raw = raw
        self._sql_of = sql_of
        self._where = where

    def execute(
        self, statement: ClauseElement, params: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> Result:
        sql = self._sql_of(statement)
        cursor = self._raw.cursor()
        try:
            if isinstance(params, list | tuple):  # many parameter sets: executemany
                cursor.executemany(sql, params)
                return Result([], cursor.rowcount)
            cursor.execute(sql, params)
            description = cursor.description
            if description is None:
                return Result([], cursor.rowcount)
            fields = tuple(column[0] for column in description)
            rows = [Row(fields, values) for values in cursor.fetchall()]
            return Result(rows, cursor.rowcount)
        except sqlite3.Error as error:
            raise _as_sqlalchemy_error(error, sql, params, self._where) from error
        finally:
            cursor.close()


class DirectTransactions:
    """Runs the store's per-task write transactions on one SQLite engine."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._compiled: dict[int, tuple[ClauseElement, str]] = {}
        self._where = engine.url.render_as_string(hide_password=True)
        self._spares = spares_of(engine)

    def _sql(self, statement: ClauseElement) -> str:
        # Keyed by identity: the store's statements are built once and live as long as it.
        cached = self._compiled.get(id(statement))
        if cached is None or cached[0] is not statement:
            cached = (statement, str(statement.compile(dialect=_NAMED)))
            self._compiled[id(statement)] = cached
        return cached[1]

    @contextmanager
    def begin(self) -> Iterator[Transaction]:
        """``BEGIN IMMEDIATE`` (the write lock up front, as the engine's transactions take
        it), the block's statements, then COMMIT; ROLLBACK if the block raises."""
        # A fork waits for it (sqlease._db.sqlite.fork_guard).
        with sqlite_section(), self._transaction() as transaction:
            yield transaction

    @contextmanager
    def _transaction(self) -> Iterator[Transaction]:
        fairy = self._take()
        raw: sqlite3.Connection = fairy.driver_connection
        try:
            try:
                raw.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as error:
                raise _as_sqlalchemy_error(error, "BEGIN IMMEDIATE", {}, self._where) from error
            try:
                yield Transaction(raw, self._sql, self._where)
                try:
                    raw.execute("COMMIT")
                except sqlite3.Error as error:
                    raise _as_sqlalchemy_error(error, "COMMIT", {}, self._where) from error
            except BaseException:
                if raw.in_transaction:
                    try:
                        raw.execute("ROLLBACK")
                    except sqlite3.Error:
                        fairy.invalidate()  # unknown state: never reused
                raise
        except BaseException:
            self._give_back(fairy)
            raise
        self._give_back(fairy)

    def spares_kept(self) -> int:
        return spares_module.count(self._spares, self._engine.pool)

    def _take(self) -> Any:
        fairy = spares_module.take(self._spares, self._engine.pool)
        if fairy is not None:
            return fairy
        try:
            return self._engine.raw_connection()
        except sqlite3.Error as error:  # as SQLAlchemy's Connection reports it
            raise _as_sqlalchemy_error(error, None, None, self._where) from error

    def _give_back(self, fairy: Any) -> None:
        invalidated = fairy.dbapi_connection is None
        if invalidated or not spares_module.keep(self._spares, fairy, self._engine.pool):
            fairy.close()


def _as_sqlalchemy_error(
    error: sqlite3.Error, sql: str | None, params: Any, where: str
) -> BaseException:
    return translate(
        error, where=where, dialect=_NAMED, dbapi_base=sqlite3.Error, sql=sql, params=params
    )
