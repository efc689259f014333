"""What every part of the lease store shares: the driver, the statements, time, events.

The store's parts (messages, leases, transitions, offers, tasks, topology) are mixins over
this base; ``sqlease.store.Store`` puts them together and sets the attributes declared here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection
from sqlalchemy.engine import Engine

from sqlease._db.driver import Driver, event_params
from sqlease._db.retry import transient
from sqlease._db.tables import Tables
from sqlease.types import Fence

if TYPE_CHECKING:
    from sqlease._db.statements import Statements

Clock = Callable[[], int]


def dump(data: Any) -> str | None:
    return None if data is None else json.dumps(data, sort_keys=True, default=str)


class StoreBase:
    """The state the store's parts share (set by ``Store.__init__``)."""

    engine: Engine
    driver: Driver
    sql: Statements
    tables: Tables
    clock: Clock | None
    max_attempts: int
    max_payload_bytes: int
    publish_sync_commit: bool
    #: The channel publishes notify and idle workers listen on (PostgreSQL).
    notify_channel: str

    def _writing(self, statements: int = 2) -> AbstractContextManager[Connection]:
        """A short write transaction (one statement needs no BEGIN/COMMIT on PostgreSQL)."""
        return self.driver.writing(statements)

    def _reading(self) -> AbstractContextManager[Connection]:
        """A read-only transaction (on SQLite a deferred one: no write lock)."""
        return self.driver.reading()

    def fork_section(self) -> AbstractContextManager[None]:
        """On SQLite, a block a fork waits for (sqlease._db.sqlite.fork_guard); else nothing."""
        return self.driver.fork_section()

    # ---- time --------------------------------------------------------------------------

    def _now(self, now: int | None) -> int | None:
        if now is not None:
            return int(now)
        return None if self.clock is None else int(self.clock())

    @transient
    def now_ms(self) -> int:
        """The time the store compares leases against (the clock, else the database's)."""
        if self.clock is not None:
            return int(self.clock())
        with self._reading() as conn:
            value = conn.execute(self.sql.now, {"now": None}).scalar_one()
        return int(value)

    # ---- events ------------------------------------------------------------------------

    def _insert_event(
        self,
        conn: Connection,
        task_id: str | None,
        message_id: int | None,
        attempt: int | None,
        kind: str,
        data: str | None,
        now: int | None,
    ) -> None:
        """Append one event (``data`` already JSON) inside the caller's transaction."""
        conn.execute(
            self.sql.event_insert, event_params(task_id, message_id, attempt, kind, data, now)
        )

    def _event_on(
        self,
        conn: Connection,
        task_id: str | None,
        fence: Fence | None,
        kind: str,
        data: Any,
        now: int | None,
    ) -> None:
        """Append an event inside the caller's transaction."""
        self._insert_event(
            conn,
            task_id,
            None if fence is None else fence.message_id,
            None if fence is None else fence.attempt,
            kind,
            dump(data),
            now,
        )
