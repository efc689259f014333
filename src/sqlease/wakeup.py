"""Wake-ups for idle consumers: LISTEN/NOTIFY on PostgreSQL, ``PRAGMA data_version`` on SQLite.

Neither is relied on for correctness: a lost notification only costs latency, because every
consumer also polls on a safety interval.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import Any, Protocol

import psycopg
from sqlalchemy.engine import URL

logger = logging.getLogger(__name__)


def _close_quietly(conn: Any) -> None:
    if conn is not None:
        try:
            conn.close()
        except Exception:
            pass


class Waker(Protocol):
    def fileno(self) -> int | None:
        """A socket the event loop can watch, or None (then the loop polls)."""

    def ready(self) -> bool:
        """Consume pending signals without blocking; True if anything may have changed."""

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a signal; True if one came."""

    def close(self) -> None: ...


class PostgresListener:
    """A dedicated autocommit psycopg connection that LISTENs on the store's channel.

    A broken connection (server restart) is dropped and re-opened on next use; the caller's
    safety poll covers whatever was notified meanwhile.
    """

    def __init__(self, url: URL, channel: str, *, lock_key: int | None = None) -> None:
        self._dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._channel = channel
        # Held by this connection while it lives: the worker's handoff offers count only
        # while it is (see sqlease.handoff).
        self._lock_key = lock_key
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        #: Counts the connections made: while it is unchanged, no notification was missed.
        self.generation = 0

    def _connect(self) -> psycopg.Connection[tuple[object, ...]] | None:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        conn = None
        try:
            conn = psycopg.connect(self._dsn, autocommit=True, application_name="sqlease-listen")
            conn.execute(f'LISTEN "{self._channel}"')
            if self._lock_key is not None:
                conn.execute("SELECT pg_advisory_lock(%s)", (self._lock_key,))
        except psycopg.Error as exc:
            _close_quietly(conn)
            logger.warning(
                "sqlease could not LISTEN for wake-ups (%s); polling meanwhile", type(exc).__name__
            )
            self._conn = None
            return None
        self._conn = conn
        self.generation += 1
        return conn

    def fileno(self) -> int | None:
        conn = self._connect()
        return None if conn is None else conn.fileno()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        _close_quietly(conn)

    def ready(self) -> bool:
        return self.pending() != set()

    def pending(self) -> set[str] | None:
        """Consume pending notifications without blocking: the payloads they carried (the
        store notifies with the queue name), or None when it cannot tell (no connection, or
        the connection just broke), which means "look everywhere"."""
        conn = self._connect()
        if conn is None:
            return None
        try:
            return {notify.payload for notify in conn.notifies(timeout=0)}
        except (psycopg.OperationalError, psycopg.InterfaceError, OSError):
            self._drop()
            return None

    def wait(self, timeout: float) -> bool:
        conn = self._connect()
        if conn is None:
            time.sleep(timeout)
            return False
        try:
            for _ in conn.notifies(timeout=timeout, stop_after=1):
                return True
            return False
        except (psycopg.OperationalError, psycopg.InterfaceError, OSError):
            self._drop()
            return True

    def wait_payloads(self, timeout: float) -> list[str] | None:
        """Block up to ``timeout`` seconds for a notification; the payloads that came (empty
        if none did), or None when the connection could not tell (broken, not listening)."""
        conn = self._connect()
        if conn is None:
            time.sleep(timeout)
            return None
        try:
            payloads = [n.payload for n in conn.notifies(timeout=timeout, stop_after=1)]
            if payloads:  # and whatever else has already arrived
                payloads.extend(n.payload for n in conn.notifies(timeout=0))
            return payloads
        except (psycopg.OperationalError, psycopg.InterfaceError, OSError):
            self._drop()
            return None

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def close(self) -> None:
        self._drop()

    def __del__(self) -> None:
        # A listener dropped with its owner (a backend, a transport) closes its connection
        # instead of leaving psycopg to complain about an open one.
        self._drop()


class SqliteWatcher:
    """Notices commits by any other connection to the same SQLite file, cheaply: the
    ``data_version`` pragma changes when another connection commits, and reading it takes no
    lock."""

    def __init__(self, path: str, check_interval: float = 0.005) -> None:
        self._path = path
        self._check_interval = check_interval
        self._conn: sqlite3.Connection | None = None
        self._version: int | None = None

    def fileno(self) -> int | None:
        return None

    def _read(self) -> int | None:
        try:
            if self._conn is None:
                self._conn = sqlite3.connect(
                    self._path, isolation_level=None, check_same_thread=False
                )
            row = self._conn.execute("PRAGMA data_version").fetchone()
            return int(row[0])
        except sqlite3.Error:
            self.close()
            return None

    def ready(self) -> bool:
        version = self._read()
        changed = version is None or version != self._version
        self._version = version
        return changed

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if self.ready():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(self._check_interval, remaining))

    def close(self) -> None:
        conn, self._conn = self._conn, None
        _close_quietly(conn)

    def __del__(self) -> None:
        self.close()
