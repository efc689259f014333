"""PostgreSQL connections whose waits end at the bound of the call (sqlease._db.bounds).

psycopg runs every statement, commit and setting change as a generator that yields what it
waits for on the socket, and its ``Connection.wait`` drives it until the server answers,
however long that takes. A network partition that keeps the socket open (no reset, no error)
makes that forever, or until the kernel gives up on the connection (minutes). Every
connection sqlease's engines make is a :class:`BoundedConnection`: inside a bounded call it
drives the generator itself, polling the socket only until the bound; past it, the
connection is closed (its state is unknown: the statement may or may not have run) and the
call raises psycopg's ``OperationalError``, which the pool takes as a disconnect (the
connection is dropped, the next call makes a new one). Outside a bounded call it is
psycopg's own wait, unchanged. A new connection made inside a bounded call is given up
once the bound passes too: libpq's ``connect_timeout`` counts whole seconds, at least 2, so
psycopg's connection generator is wrapped to end at the bound (psycopg's wait resumes it at
least every 0.1 s), with ``connect_timeout`` no longer than what is left, rounded up, as the
outer limit. And a call that finds its engine's pool exhausted waits for a connection no
longer than its bound (``BoundedQueuePool``), not for the pool's timeout.
"""

from __future__ import annotations

import math
import select
from collections.abc import Generator
from typing import Any

import psycopg
from psycopg.abc import PQGenConn
from psycopg.waiting import Ready, Wait
from sqlalchemy.pool import QueuePool

from sqlease._db import bounds

#: libpq's (and psycopg's) least connect_timeout, in seconds.
MIN_CONNECT_TIMEOUT_S = 2

_READ = int(Wait.R)
_WRITE = int(Wait.W)
# (Linux's values where select has none: its poll is then not used.)
_POLLIN = getattr(select, "POLLIN", 0x001)
_POLLOUT = getattr(select, "POLLOUT", 0x004)
_POLL_READABLE = _POLLIN | getattr(select, "POLLERR", 0x008) | getattr(select, "POLLHUP", 0x010)
_POLL_WRITABLE = _POLLOUT | getattr(select, "POLLERR", 0x008) | getattr(select, "POLLHUP", 0x010)


def _ready(fileno: int, wanted: int, timeout: float) -> int:
    """Wait up to ``timeout`` seconds for the socket to be ready as ``wanted`` says; the
    ``Ready`` bits (0: not yet). ``select.poll`` is looked for at each call: eventlet's
    monkey-patching removes it (its green ``select.select`` is taken then)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(
            fileno, (_POLLIN if wanted & _READ else 0) | (_POLLOUT if wanted & _WRITE else 0)
        )
        ready = 0
        for _fd, event in poller.poll(max(0, math.ceil(timeout * 1000))):
            if event & _POLL_READABLE:
                ready |= int(Ready.R)
            if event & _POLL_WRITABLE:
                ready |= int(Ready.W)
        return ready
    readers = [fileno] if wanted & _READ else []
    writers = [fileno] if wanted & _WRITE else []
    r, w, _ = select.select(readers, writers, [], max(0.0, timeout))
    return (int(Ready.R) if r else 0) | (int(Ready.W) if w else 0)


class BoundedConnection(psycopg.Connection[Any]):
    """A psycopg connection whose waits honour the bound of the call (see the module's
    docstring)."""

    @classmethod
    def _connect_gen(cls, conninfo: str = "", *args: Any, **kwargs: Any) -> PQGenConn[Any]:
        # psycopg's connect drives this generator; within a bounded call it ends at the bound.
        gen = super()._connect_gen(conninfo, *args, **kwargs)
        return gen if bounds.left() is None else _until_bound(gen)

    def wait(self, gen: Generator[Any, Any, Any], *args: Any, **kwargs: Any) -> Any:
        if bounds.left() is None:
            return super().wait(gen, *args, **kwargs)
        return self._wait_bounded(gen)

    def _wait_bounded(self, gen: Generator[Any, Any, Any]) -> Any:
        fileno = self.pgconn.socket
        try:
            wanted = int(next(gen))
            while True:
                left = bounds.left()
                if left is None:  # the bound went (not expected within one call): no limit
                    left = 1.0
                elif left <= 0:
                    raise self._give_up(gen)
                ready = _ready(fileno, wanted, left)
                if ready:
                    wanted = int(gen.send(Ready(ready)))
        except StopIteration as done:
            return done.value
        except OSError as exc:  # the socket went away under us
            raise psycopg.OperationalError("connection socket closed") from exc

    def _give_up(self, gen: Generator[Any, Any, Any]) -> psycopg.OperationalError:
        gen.close()
        # The statement may or may not have reached the server: nothing more can be sent on
        # this connection. Closed here, it reads as broken to the pool (a disconnect).
        self.pgconn.finish()
        return psycopg.OperationalError(
            "sqlease: no answer from the database within the lease the call was made for; "
            "connection closed"
        )


def _until_bound(gen: PQGenConn[Any]) -> PQGenConn[Any]:
    """psycopg's connection generator, given up once the bound of the call passes. psycopg's
    wait sends it what the socket is ready for, or nothing, at least every 0.1 s: the bound is
    looked at each time, and the half-made connection is dropped with the generator."""
    try:
        _check_bound(gen)  # psycopg tries each address of the host: none once it has passed
        wanted = next(gen)
        while True:
            _check_bound(gen)
            wanted = gen.send((yield wanted))
    except StopIteration as done:
        return done.value


def _check_bound(gen: PQGenConn[Any]) -> None:
    left = bounds.left()
    if left is not None and left <= 0:
        gen.close()
        raise psycopg.OperationalError(
            "sqlease: no connection to the database within the lease the call was made for"
        )


def connect(*args: Any, **kwargs: Any) -> BoundedConnection:
    """``psycopg.connect`` for sqlease's engines: a :class:`BoundedConnection`. Within a
    bounded call the connection is given up at the bound, and libpq's ``connect_timeout``
    (whole seconds, at least 2) is no longer than what is left, rounded up."""
    left = bounds.left()
    if left is not None:
        if left <= 0:
            raise psycopg.OperationalError(
                "sqlease: no time left within the lease to open a database connection"
            )
        given = kwargs.get("connect_timeout")
        limit = max(MIN_CONNECT_TIMEOUT_S, math.ceil(left))
        try:
            given_s = float(given) if given is not None else None
        except (TypeError, ValueError):
            given_s = None
        if given_s is None or given_s <= 0 or given_s > limit:
            kwargs["connect_timeout"] = limit
    return BoundedConnection.connect(*args, **kwargs)


class BoundedQueuePool(QueuePool):
    """SQLAlchemy's ``QueuePool`` whose wait for a free connection, when every one is checked
    out, ends at the bound of the call (SQLAlchemy's ``TimeoutError`` then, as at the pool's
    own timeout): a gevent worker's hundred tasks share the engine's fifteen connections, and
    in a partition every one of those hangs until its own delivery's bound, which may be
    later than the waiting delivery's. The pool reads its timeout in the calling thread, so
    the timeout is what the bound leaves of it."""

    @property  # type: ignore[override]
    def _timeout(self) -> float:
        left = bounds.left()
        if left is None:
            return self._configured_timeout
        return max(0.0, min(self._configured_timeout, left))

    @_timeout.setter
    def _timeout(self, value: float) -> None:
        self._configured_timeout = value

    def recreate(self) -> QueuePool:
        pool = super().recreate()  # given the bounded timeout if called within a bound
        pool._timeout = self._configured_timeout
        return pool
