"""Queues and exchange bindings."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, update

from sqlease._core.base import Aggregate
from sqlease._core.leases import promote_runs
from sqlease._core.names import check_name
from sqlease._db.retry import transient


class Topology(Aggregate):
    """Queues and bindings."""

    @transient
    def declare_queue(
        self,
        queue: str,
        *,
        expires_ms: int | None = None,
        connection: Connection | None = None,
    ) -> None:
        """Make sure ``queue`` exists. ``expires_ms``: the queue is deleted (with its
        bindings and messages) once nobody declared it or consumed from it for that long
        (``touch_queues``); a declaration without it leaves any expiry as it was."""
        check_name("queue name", queue)
        params = {"queue": queue, "now": self._now(None)}
        if connection is not None:  # inside the caller's transaction (transactional enqueue)
            self._declare(connection, params, expires_ms)
            return
        with self.driver.writing() as conn:
            self._declare(conn, params, expires_ms)

    def _declare(self, conn: Connection, params: Mapping[str, Any], expires_ms: int | None) -> None:
        conn.execute(self.sql.declare_queue, params)
        if expires_ms is not None:
            q = self.tables.queues
            now = int(conn.execute(self.sql.now, {"now": params["now"]}).scalar_one())
            conn.execute(
                update(q)
                .where(q.c.name == params["queue"])
                .values(expires_ms=int(expires_ms), expires_at_ms=now + int(expires_ms))
            )

    @transient
    def touch_queues(self, queues: Iterable[str], *, now: int | None = None) -> set[str]:
        """A live consumer's sign: push the idle expiry of these queues forward. Returns the
        queues that have an expiry and still exist (one missing was deleted while its
        consumer did not touch it: the consumer declares it again)."""
        names = sorted(set(queues))
        if not names:
            return set()
        q = self.tables.queues
        with self.driver.writing() as conn:
            at = int(conn.execute(self.sql.now, {"now": self._now(now)}).scalar_one())
            rows = conn.execute(
                update(q)
                .where(q.c.name.in_(names), q.c.expires_ms.isnot(None))
                .values(expires_at_ms=at + q.c.expires_ms)
                .returning(q.c.name)
            ).scalars()
            return set(rows)

    @transient
    def has_queue(self, queue: str) -> bool:
        with self.driver.reading() as conn:
            found = conn.execute(self.sql.has_queue, {"queue": queue}).first() is not None
        return found

    @transient
    def delete_queue(self, queue: str, *, now: int | None = None) -> None:
        """Forget a queue: its bindings and undelivered messages."""
        now = self._now(now)
        with self.driver.writing() as conn:
            params = {"queue": queue, "now": now}
            gone = conn.execute(self.sql.delete_queue_messages, params).fetchall()
            conn.execute(self.sql.delete_queue_bindings, params)
            conn.execute(self.sql.delete_queue, params)
        # Runs whose head was deleted with the queue go on in their other queues.
        promote_runs(self.driver, (r.run_id for r in gone if r.run_id is not None), now)

    @transient
    def bind(
        self,
        exchange: str,
        queue: str,
        routing_key: str = "",
        pattern: str = "",
        *,
        connection: Connection | None = None,
    ) -> None:
        check_name("exchange name", exchange)
        check_name("queue name", queue)
        check_name("routing key", routing_key or "")
        params = {
            "exchange": exchange,
            "queue": queue,
            "routing_key": routing_key or "",
            "pattern": pattern or "",
        }
        self._write(self.sql.bind, params, connection)

    def _write(
        self, statement: Any, params: Mapping[str, Any], connection: Connection | None
    ) -> None:
        """One write, inside the caller's transaction if it gave one, else in its own."""
        if connection is not None:
            connection.execute(statement, params)
            return
        with self.driver.writing() as conn:
            conn.execute(statement, params)

    @transient
    def unbind(self, exchange: str, queue: str, routing_key: str = "", pattern: str = "") -> None:
        with self.driver.writing() as conn:
            conn.execute(
                self.sql.unbind,
                {
                    "exchange": exchange,
                    "queue": queue,
                    "routing_key": routing_key or "",
                    "pattern": pattern or "",
                },
            )

    @transient
    def unbind_key(self, exchange: str, queue: str, routing_key: str = "") -> None:
        """Remove a binding whatever its pattern (the unbinding side may not know the
        exchange's type, and so not the pattern it was bound with)."""
        b = self.tables.bindings
        with self.driver.writing() as conn:
            conn.execute(
                b.delete().where(
                    b.c.exchange == exchange,
                    b.c.queue == queue,
                    b.c.routing_key == (routing_key or ""),
                )
            )

    @transient
    def declare_exchange(
        self, exchange: str, type: str, *, connection: Connection | None = None
    ) -> None:
        """Record ``exchange``'s type (``direct``, ``topic``, ``fanout``): a process that
        publishes to it by name without declaring it routes by that type, as a broker's
        publishers do. The latest declaration's type stands."""
        check_name("exchange name", exchange)
        self._write(self.sql.declare_exchange, {"exchange": exchange, "type": type}, connection)

    @transient
    def exchange_type(self, exchange: str) -> str | None:
        """The type ``exchange`` was last declared with, or None if it never was."""
        with self.driver.reading() as conn:
            found = conn.execute(self.sql.exchange_type, {"exchange": exchange}).scalar()
        return None if found is None else str(found)

    @transient
    def delete_exchange(self, exchange: str) -> None:
        """Forget ``exchange``: its type and its bindings (its queues stay)."""
        with self.driver.writing() as conn:
            conn.execute(self.sql.delete_exchange_bindings, {"exchange": exchange})
            conn.execute(self.sql.delete_exchange, {"exchange": exchange})

    @transient
    def bindings(self, exchange: str) -> list[tuple[str, str, str]]:
        """``(routing_key, pattern, queue)`` for every binding of ``exchange``."""
        with self.driver.reading() as conn:
            rows = conn.execute(self.sql.bindings_for, {"exchange": exchange}).fetchall()
        return [(r.routing_key, r.pattern, r.queue) for r in rows]
