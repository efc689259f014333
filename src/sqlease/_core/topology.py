"""Queues and exchange bindings."""

from __future__ import annotations

from sqlalchemy import Connection

from sqlease._core.base import StoreBase
from sqlease._db.retry import transient


class Topology(StoreBase):
    """Queues and bindings."""

    @transient
    def declare_queue(self, queue: str, *, connection: Connection | None = None) -> None:
        params = {"queue": queue, "now": self._now(None)}
        if connection is not None:  # inside the caller's transaction (transactional enqueue)
            connection.execute(self.sql.declare_queue, params)
            return
        with self.engine.begin() as conn:
            conn.execute(self.sql.declare_queue, params)

    @transient
    def has_queue(self, queue: str) -> bool:
        with self._reading() as conn:
            found = conn.execute(self.sql.has_queue, {"queue": queue}).first() is not None
        return found

    @transient
    def delete_queue(self, queue: str, *, now: int | None = None) -> None:
        """Forget a queue: its bindings and undelivered messages."""
        with self.engine.begin() as conn:
            params = {"queue": queue, "now": self._now(now)}
            conn.execute(self.sql.delete_queue_messages, params)
            conn.execute(self.sql.delete_queue_bindings, params)
            conn.execute(self.sql.delete_queue, params)

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
        params = {
            "exchange": exchange,
            "queue": queue,
            "routing_key": routing_key or "",
            "pattern": pattern or "",
        }
        if connection is not None:  # inside the caller's transaction
            connection.execute(self.sql.bind, params)
            return
        with self.engine.begin() as conn:
            conn.execute(self.sql.bind, params)

    @transient
    def unbind(self, exchange: str, queue: str, routing_key: str = "", pattern: str = "") -> None:
        with self.engine.begin() as conn:
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
        with self.engine.begin() as conn:
            conn.execute(
                b.delete().where(
                    b.c.exchange == exchange,
                    b.c.queue == queue,
                    b.c.routing_key == (routing_key or ""),
                )
            )

    @transient
    def bindings(self, exchange: str) -> list[tuple[str, str, str]]:
        """``(routing_key, pattern, queue)`` for every binding of ``exchange``."""
        with self._reading() as conn:
            rows = conn.execute(self.sql.bindings_for, {"exchange": exchange}).fetchall()
        return [(r.routing_key, r.pattern, r.queue) for r in rows]
