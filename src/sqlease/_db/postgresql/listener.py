"""PostgreSQL's waker: a LISTEN connection of its own, watched by the worker's event loop,
and the reaper that closes one nobody reads."""

from __future__ import annotations

import logging
import os
import select
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import psycopg
from sqlalchemy.engine import URL

from sqlease._db.postgresql.engine import CONNECT_TIMEOUT_S, keepalive_args
from sqlease._db.wakeup import close_quietly as _close_quietly

logger = logging.getLogger(__name__)

#: Every listener of this process, so that a forked child can let go of their sockets.
_listeners: weakref.WeakSet[PostgresListener] = weakref.WeakSet()

#: A listener whose notifications have waited unread this long is closed (see ``_reap``).
UNREAD_LIMIT_S = 30.0
#: How often the reaper looks.
REAP_EVERY_S = 5.0
#: After a LISTEN that failed, the least wait before the next try.
RETRY_LISTEN_S = 1.0
_reaper_pid: int | None = None
_reaper_lock = threading.Lock()


def _reap() -> None:
    """Close every listener whose notifications wait unread. A LISTEN connection that nobody
    reads (a client that ran ``app.control.ping()`` or ``AsyncResult.get()`` once and kept
    its connection) fills its socket with the channel's notifications; its server process
    then blocks writing to it while it holds a snapshot, and that snapshot holds back VACUUM
    on the whole database: dead rows pile up in every table, the claim index bloats and
    claims slow down (seen in a soak: 85,000 dead messages, a claim at 250 ms). A closed
    listener reopens at its next use, with a new ``generation``, so its user looks
    everywhere once."""
    while True:
        time.sleep(REAP_EVERY_S)
        for listener in list(_listeners):
            try:
                listener._reap_if_unread()
            except Exception:  # the reaper must live on
                logger.debug("sqlease: could not check a LISTEN connection", exc_info=True)


def _ensure_reaper() -> None:
    global _reaper_pid
    with _reaper_lock:
        if _reaper_pid == os.getpid():
            return
        _reaper_pid = os.getpid()  # a forked child starts its own when it listens
        threading.Thread(target=_reap, name="sqlease-listen-reaper", daemon=True).start()


class PostgresListener:
    """A dedicated autocommit psycopg connection that LISTENs on the store's channel.

    A broken connection (server restart) is dropped and re-opened on next use; the caller's
    safety poll covers whatever was notified meanwhile.
    """

    pushes = True
    watches = False

    def __init__(
        self,
        url: URL,
        channel: str,
        lock_key: int | None = None,
        shared_keys: Sequence[int] = (),
        *,
        lease_ms: int = 60_000,
    ) -> None:
        self._dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._connect_args: dict[str, Any] = {}
        name = url.query.get("application_name")
        self._application_name = (name[-1] if isinstance(name, tuple) else name) or "sqlease"
        if "connect_timeout" not in url.query:
            self._connect_args["connect_timeout"] = CONNECT_TIMEOUT_S  # as the engines
        self._connect_args.update(keepalive_args(url, lease_ms))  # as the engines
        # Connections a forked child inherited and let go of (see _detach_after_fork).
        self._inherited: list[psycopg.Connection[tuple[object, ...]]] = []
        _listeners.add(self)
        self._channel = channel
        # Held by this connection while it lives: the worker's handoff offers count only
        # while it is (see sqlease._core.handoff).
        self._lock_key = lock_key
        # Held shared while it lives, taken once it listens: result writes notify only while
        # a waiting client holds them (see sqlease._core.waiters).
        self._shared_keys = list(shared_keys)
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        #: Counts the connections made: while it is unchanged, no notification was missed.
        self.generation = 0
        # Held while the connection is used; the reaper only takes it when it is free.
        self._lock = threading.RLock()
        self._read_at = time.monotonic()
        # While LISTEN fails (the server is down): since when, and the next try (at most one
        # a second: every caller polls meanwhile, and one warning tells the outage).
        self._failing_since: float | None = None
        self._retry_at = 0.0
        _ensure_reaper()

    def _reap_if_unread(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # in use: being read right now
        try:
            conn = self._conn
            if conn is None or conn.closed:
                return
            if time.monotonic() - self._read_at < UNREAD_LIMIT_S:
                return
            waiting, _, _ = select.select([conn.fileno()], [], [], 0)
            if waiting:
                logger.info(
                    "sqlease: closed a LISTEN connection whose notifications went unread for "
                    "%.0f s (unread, they hold back VACUUM); it reopens when next used",
                    time.monotonic() - self._read_at,
                )
                self._drop()
        finally:
            self._lock.release()

    def _connect(self) -> psycopg.Connection[tuple[object, ...]] | None:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        now = time.monotonic()
        if now < self._retry_at:
            return None
        conn = None
        try:
            conn = psycopg.connect(
                self._dsn,
                autocommit=True,
                application_name=f"{self._application_name}-listen",
                **self._connect_args,
            )
            conn.execute(f'LISTEN "{self._channel}"')
            if self._lock_key is not None:
                conn.execute("SELECT pg_advisory_lock(%s)", (self._lock_key,))
            if self._shared_keys:
                # Each waits at most for a result write's commit (its one statement holds the
                # key until then); a far longer wait is a fault: listen again later, and poll
                # meanwhile (logged below as LockNotAvailable).
                conn.execute("SET lock_timeout = '10s'")
                conn.execute(
                    "SELECT count(pg_advisory_lock_shared(k)) FROM unnest(%s::bigint[]) AS k",
                    (self._shared_keys,),
                )
        except psycopg.Error as exc:
            _close_quietly(conn)
            if self._failing_since is None:
                self._failing_since = now
                logger.warning(
                    "sqlease could not LISTEN for wake-ups (%s); polling meanwhile",
                    type(exc).__name__,
                )
            else:
                logger.debug("sqlease could not LISTEN for wake-ups (%s)", type(exc).__name__)
            self._retry_at = now + RETRY_LISTEN_S
            self._conn = None
            return None
        if self._failing_since is not None:
            logger.info(
                "sqlease: listening for wake-ups again, after %.1f s of polling",
                now - self._failing_since,
            )
            self._failing_since = None
        self._conn = conn
        self.generation += 1
        return conn

    def fileno(self) -> int | None:
        with self._lock:
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
        with self._lock:
            conn = self._connect()
            if conn is None:
                return None
            try:
                return {notify.payload for notify in conn.notifies(timeout=0)}
            except (psycopg.OperationalError, psycopg.InterfaceError, OSError):
                self._drop()
                return None
            finally:
                self._read_at = time.monotonic()

    def wait(self, timeout: float) -> bool:
        with self._lock:
            generation = self.generation
            conn = self._connect()
            if conn is None:
                time.sleep(timeout)
                return False
            if self.generation != generation:
                return True  # listening anew: what came meanwhile went unheard, look now
            try:
                for _ in conn.notifies(timeout=timeout, stop_after=1):
                    return True
                return False
            except (psycopg.OperationalError, psycopg.InterfaceError, OSError):
                self._drop()
                return True
            finally:
                self._read_at = time.monotonic()

    def wait_payloads(self, timeout: float) -> list[str] | None:
        """Block up to ``timeout`` seconds for a notification; the payloads that came (empty
        if none did), or None when the connection could not tell (broken, not listening, or
        opened anew just now: returned at once, so the caller reads what came meanwhile
        while listening, and holding the shared keys, before it waits)."""
        with self._lock:
            generation = self.generation
            conn = self._connect()
            if conn is None:
                time.sleep(timeout)
                return None
            if self.generation != generation:
                return None
            try:
                payloads = [n.payload for n in conn.notifies(timeout=timeout, stop_after=1)]
                if payloads:  # and whatever else has already arrived
                    payloads.extend(n.payload for n in conn.notifies(timeout=0))
                return payloads
            except (psycopg.OperationalError, psycopg.InterfaceError, OSError):
                self._drop()
                return None
            finally:
                self._read_at = time.monotonic()

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def _detach_after_fork(self) -> None:
        """In a forked child: let go of the parent's LISTEN socket without touching it.

        A child (a prefork pool process) that kept the socket open would keep the session,
        and so the worker's advisory lock, alive after the worker itself was SIGKILLed: the
        publishes would go on handing messages to a dead worker's offers. Closing the
        connection here would instead send the parent's session a Terminate. So the socket's
        descriptor is pointed at /dev/null (whatever psycopg writes to it later goes nowhere)
        and the connection is kept, unused, so that nothing finalizes it on the socket."""
        # The lock may have been held by a thread of the parent (the reaper) at the fork.
        self._lock = threading.RLock()
        conn, self._conn = self._conn, None
        if conn is None:
            return
        self._inherited.append(conn)
        try:
            fd = conn.pgconn.socket
        except Exception:  # closed or broken: nothing is held
            return
        null = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)

    def close(self) -> None:
        self._drop()

    def __del__(self) -> None:
        # A listener dropped with its owner (a backend, a transport) closes its connection
        # instead of leaving psycopg to complain about an open one.
        self._drop()


def _detach_listeners_in_child() -> None:
    for listener in list(_listeners):
        try:
            listener._detach_after_fork()
        except Exception:  # never fail a fork over a wake-up socket
            logger.debug("sqlease: could not detach a LISTEN socket after fork", exc_info=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_detach_listeners_in_child)
