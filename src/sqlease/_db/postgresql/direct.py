"""A PostgreSQL lane's statements straight through psycopg: one statement in autocommit.

Enqueue, claim, ack and result writes run for every task. SQLAlchemy's execution layer costs
about as much client CPU as the statement's round trip, so on PostgreSQL these statements
borrow a pooled connection from SQLAlchemy and run on the psycopg connection underneath.
Errors come out as SQLAlchemy's would (the same ``OperationalError`` for a dropped connection,
which the store's retry rides out; the same sqlease errors for refusals), and a broken
connection is invalidated so the pool replaces it. sqlease's own engines keep a few
connections out of the pool between calls (sqlease._db.spares), already in autocommit.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections import deque
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import psycopg
from psycopg.pq import ExecStatus
from psycopg.rows import dict_row
from psycopg.waiting import Ready, Wait
from sqlalchemy.engine import Engine
from sqlalchemy.sql.elements import TextClause

from sqlease._db import spares as spares_module
from sqlease._db.driver import WAIT_READ, WAIT_WRITE
from sqlease._db.postgresql.engine import desynced
from sqlease._db.spares import spares_of
from sqlease._db.translate import translate

TUPLES_OK = ExecStatus.TUPLES_OK

try:  # psycopg's own query conversion, cached by statement (see _StatementCursor)
    from psycopg._queries import PostgresQuery, _query2pg_nocache
except ImportError:  # a psycopg whose internals moved: its own (uncached past 4 KB) path
    PostgresQuery = None  # type: ignore[assignment,misc]


def _private_conversion_works() -> bool:
    """These are psycopg internals (tested with 3.1-3.3): use them only if they still
    behave as this module expects, else psycopg's public path."""
    if PostgresQuery is None:
        return False
    try:
        converted = _query2pg_nocache(b"SELECT %(a)s, %(b)s, %(a)s", "utf-8")
        query, formats, order, parts = converted
    except Exception:
        return False
    return (
        query == b"SELECT $1, $2, $1"
        and order == ["a", "b"]
        and len(formats) == 2
        and len(parts) == 4
        and all(hasattr(PostgresQuery, name) for name in ("convert", "dump"))
    )


if not _private_conversion_works():
    PostgresQuery = None  # type: ignore[assignment,misc]

if PostgresQuery is not None:
    # psycopg turns named placeholders into $n on every execute and caches the result only
    # for statements up to 4 KB; the busy worker's combined ack + claim is longer, and was
    # parsed again on each call (about a third of the client's CPU per statement at batch 1).
    # The store's statements are few and fixed, so each is converted once.
    _convert = lru_cache(maxsize=512)(_query2pg_nocache)

    class _StatementQuery(PostgresQuery):
        def convert(self, query: Any, vars: Any) -> None:
            if not isinstance(query, bytes) or vars is None:
                super().convert(query, vars)
                return
            try:
                self.query, self._want_formats, self._order, self._parts = _convert(
                    query, self._tx.encoding
                )
            except (AttributeError, TypeError, ValueError):
                super().convert(query, vars)  # psycopg's internals changed: its own path
                return
            self.dump(vars)

    class _StatementCursor(psycopg.Cursor[Any]):
        _query_cls = _StatementQuery

    def _cursor(driver: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
        return _StatementCursor(driver, row_factory=dict_row)

else:

    def _cursor(driver: psycopg.Connection[Any]) -> psycopg.Cursor[Any]:
        return driver.cursor(row_factory=dict_row)


class DirectLane:
    """Runs the store's own statements (``text()`` clauses) on one engine's pooled
    connections, through psycopg directly.

    ``spares``: keep a few connections checked out between calls, in autocommit
    (sqlease._db.spares); only for sqlease's own engines, never for one a user passed in, whose
    pool may be small."""

    def __init__(self, engine: Engine, *, spares: bool = False) -> None:
        self._engine = engine
        #: The engine whose pool (and session setup) this runs on.
        self.engine = engine
        self._compiled: dict[int, tuple[TextClause, bytes]] = {}
        self._where = engine.url.render_as_string(hide_password=True)
        self._threads = threading.local()  # per thread: pinned?, its connection, its pid
        self._spares: deque[Any] | None = spares_of(engine) if spares else None

    def _sql(self, statement: TextClause) -> bytes:
        # Keyed by identity: the store's statements are built once and live as long as it.
        cached = self._compiled.get(id(statement))
        if cached is None or cached[0] is not statement:
            sql = str(statement.compile(dialect=self._engine.dialect))
            cached = (statement, sql.encode())
            self._compiled[id(statement)] = cached
        return cached[1]

    def pin_thread(self) -> None:
        """From now on the calling thread keeps one pooled connection, in autocommit, between
        calls, until ``release_thread()``. For a thread that does nothing else (the worker's
        background claims): checking a connection out of SQLAlchemy's pool and back in, and
        switching autocommit on and off, cost about a quarter of the client's CPU per
        statement (155 -> 120 us for an ack of 4 with a claim of 4)."""
        self._threads.pinned = True

    def release_thread(self) -> None:
        """Give the calling thread's kept connection back to the pool (at the thread's end)."""
        self._threads.pinned = False
        fairy = getattr(self._threads, "fairy", None)
        self._threads.fairy = None
        if fairy is not None and getattr(self._threads, "pid", None) == os.getpid():
            _give_back(fairy)

    def rows(self, statement: TextClause, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Execute in autocommit; the rows it returns (as dicts), or [] if none."""
        if getattr(self._threads, "pinned", False):
            return self._rows_pinned(statement, params)
        if self._spares is not None:
            return self._rows_spare(statement, params)
        sql = self._sql(statement)
        with self._engine.connect() as conn:
            driver = conn.connection.dbapi_connection
            assert isinstance(driver, psycopg.Connection)
            try:
                driver.autocommit = True
                try:
                    return _execute(driver, sql, params)
                finally:
                    if not driver.closed:
                        driver.autocommit = False
            except psycopg.Error as error:
                raise self._as_sqlalchemy_error(conn, sql.decode(), params, error) from error

    def _rows_pinned(
        self, statement: TextClause, params: Mapping[str, Any]
    ) -> list[dict[str, Any]]:
        threads = self._threads
        fairy = getattr(threads, "fairy", None)
        if fairy is None or threads.pid != os.getpid():  # none yet, or a forked child's copy
            fairy = self.kept_connection()
            threads.fairy, threads.pid = fairy, os.getpid()
        sql = self._sql(statement)
        driver = fairy.driver_connection
        assert isinstance(driver, psycopg.Connection)
        try:
            return _execute(driver, sql, params)
        except psycopg.Error as error:
            # The next call starts from a fresh checkout, whatever went wrong here.
            threads.fairy = None
            raise self._failed(fairy, sql, params, error) from error

    def _rows_spare(self, statement: TextClause, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        spares = self._spares
        assert spares is not None
        pool = self._engine.pool
        fairy = spares_module.take(spares, pool) or self.kept_connection()
        sql = self._sql(statement)
        try:
            rows = _execute(fairy.driver_connection, sql, params)
        except psycopg.Error as error:
            raise self._failed(fairy, sql, params, error) from error
        except BaseException:  # interrupted mid-statement: the connection's state is unknown
            self.give_back(fairy, busy=True)
            raise
        if not spares_module.keep(spares, fairy, pool):
            _give_back(fairy)
        return rows

    def drop_spares(self) -> None:
        """Close the engine's kept connections (after a disconnect they are as suspect as
        the pool's; also when the engine is disposed for good)."""
        if self._spares is not None:
            spares_module.drop(self._spares)

    def spares_kept(self) -> int:
        """How many connections the engine keeps checked out between calls."""
        return 0 if self._spares is None else spares_module.count(self._spares, self._engine.pool)

    def _failed(
        self, fairy: Any, sql: bytes, params: Mapping[str, Any], error: psycopg.Error
    ) -> BaseException:
        """A kept connection's statement failed: the connection goes back (dropped if the
        failure was a disconnect), and the error to raise, as SQLAlchemy would have."""
        disconnected = self._is_disconnect(fairy, error)  # a refusal never is one
        if disconnected:
            # Every connection made before now is suspect, and this one is dropped
            # (invalidated and checked in) as on the unpinned path.
            self._engine.pool._invalidate(fairy, error)
            self.drop_spares()
        else:
            _give_back(fairy)
        return self._error(error, sql.decode(), params, disconnected)

    # ---- statements sent without waiting (the worker's event loop) ------------------------

    def kept_connection(self) -> Any:
        """A pooled connection in autocommit for the caller to keep (``send`` runs on it);
        given back with ``give_back``, or by a failed statement."""
        try:
            fairy = self._engine.raw_connection()
        except psycopg.Error as error:
            # As SQLAlchemy's Connection reports a failed connect: its OperationalError, which
            # the store's retry (and the event loop's) rides out while the server is away.
            raise self._connect_error(error) from error
        try:
            fairy.driver_connection.autocommit = True  # type: ignore[union-attr]
        except BaseException:
            fairy.close()
            raise
        return fairy

    def give_back(self, fairy: Any, *, busy: bool = False) -> None:
        """Return a kept connection; ``busy``: a statement is still under way on it, so it
        cannot be reused and is dropped."""
        if busy:
            fairy.invalidate()
            fairy.close()
        else:
            _give_back(fairy)

    def send(self, statement: TextClause, params: Mapping[str, Any], fairy: Any) -> Sending:
        """Send ``statement`` on a kept connection and return at once; the caller waits for
        the socket as ``Sending.waits_for`` says and calls ``resume`` (see Sending)."""
        return Sending(self, fairy, self._sql(statement), params)

    def _connect_error(self, error: psycopg.Error) -> BaseException:
        # A new connection's own set-up can meet a terminated server connection too (behind
        # a pooler, the settings check's ROLLBACK gets the server's FATAL as a second
        # result): a connection lost, retried like any other, never the caller's error.
        dialect = self._engine.dialect
        found = dialect.is_disconnect(error, None, None)  # type: ignore[arg-type]
        return self._error(error, None, None, bool(found) or desynced(error))

    def _is_disconnect(self, fairy: Any, error: psycopg.Error) -> bool:
        dialect = self._engine.dialect
        found = dialect.is_disconnect(error, fairy.dbapi_connection, None)  # type: ignore[arg-type]
        return bool(found) or desynced(error)

    def _error(
        self,
        error: psycopg.Error,
        sql: str | None,
        params: Mapping[str, Any] | None,
        disconnected: bool,
    ) -> BaseException:
        return translate(
            error,
            where=self._where,
            dialect=self._engine.dialect,
            dbapi_base=psycopg.Error,
            sql=sql,
            params=params,
            disconnected=disconnected,
        )

    def _as_sqlalchemy_error(
        self, conn: Any, sql: str, params: Mapping[str, Any], error: psycopg.Error
    ) -> BaseException:
        wrapper = conn.connection
        disconnected = self._is_disconnect(wrapper, error)
        if disconnected:
            # As SQLAlchemy does on a disconnect: every pooled connection made before now is
            # suspect (a restarted server dropped them all), and this one is gone.
            self._engine.pool._invalidate(wrapper, error)
            conn.invalidate(error)
            self.drop_spares()
        return self._error(error, sql, params, disconnected)


#: psycopg runs a statement as a generator that yields what it waits for on the socket
#: (psycopg.waiting drives it with select/poll): an event loop can drive it instead. Private,
#: so used only where it is there (psycopg 3.1-3.3 have it).
NONBLOCKING = inspect.isgeneratorfunction(getattr(psycopg.Cursor, "_execute_gen", None))
# What psycopg's generator waits for, as the driver seam names it.
assert (int(Wait.R), int(Wait.W)) == (WAIT_READ, WAIT_WRITE)


class Sending:
    """One statement under way on a kept connection, driven by its caller's event loop:
    wait until the socket ``fileno`` is ready as ``waits_for`` says (``WAIT_READ``, with
    ``WAIT_WRITE`` set while the request is not all sent), then ``resume(ready)``; once
    ``waits_for`` is 0 it is done: ``rows`` are its rows, or ``error`` is what to raise
    (as DirectLane.rows would have, and the connection has then been given back)."""

    def __init__(self, lane: DirectLane, fairy: Any, sql: bytes, params: Mapping[str, Any]) -> None:
        self._lane, self._fairy, self._sql, self._params = lane, fairy, sql, params
        driver = fairy.driver_connection
        assert isinstance(driver, psycopg.Connection)
        self.fileno: int = driver.pgconn.socket
        self._cursor = _cursor(driver)
        self.rows: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._gen = self._cursor._execute_gen(sql, params)
        self.waits_for = self._advance(None)

    def resume(self, ready: int) -> int:
        """The socket is ready (``WAIT_READ`` / ``WAIT_WRITE`` bits): go on; what it waits
        for next (0: done)."""
        self.waits_for = self._advance(ready)
        return self.waits_for

    def _advance(self, ready: int | None) -> int:
        try:
            wait = next(self._gen) if ready is None else self._gen.send(Ready(ready))
        except StopIteration:
            try:
                self.rows = _fetch(self._cursor)
            except psycopg.Error as error:
                self.error = self._lane._failed(self._fairy, self._sql, self._params, error)
            self._cursor.close()
            return 0
        except psycopg.Error as error:
            self._cursor.close()
            self.error = self._lane._failed(self._fairy, self._sql, self._params, error)
            return 0
        except Exception as error:  # psycopg's internals misbehaved: the connection is dropped
            self._lane.give_back(self._fairy, busy=True)
            self.error = error
            return 0
        return int(wait)


def _execute(
    driver: psycopg.Connection[Any], sql: bytes, params: Mapping[str, Any]
) -> list[dict[str, Any]]:
    with _cursor(driver) as cursor:
        cursor.execute(sql, params)
        return _fetch(cursor)


def _fetch(cursor: psycopg.Cursor[Any]) -> list[dict[str, Any]]:
    # (Not `cursor.description`: it builds a Column per column per call.)
    result = cursor.pgresult
    returned = result is not None and result.status == TUPLES_OK
    return cursor.fetchall() if returned else []


def _give_back(fairy: Any) -> None:
    """Return a kept connection to the pool as the pool lends them: not in autocommit (the
    store's transactions on the same engine expect that)."""
    try:
        driver = fairy.driver_connection
        if driver is not None and not driver.closed:
            driver.autocommit = False
    except psycopg.Error:
        fairy.invalidate()
        return
    fairy.close()
