"""Unique tasks: a publish whose uniqueness key still holds enqueues nothing.

A key is held by one task (the ``uniques`` row) under a scope the publish named:

- ``queued``: while the task waits to start (ready and not leased, scheduled for later,
  paused or waiting for a person), so a running task lets a new one queue behind it;
- ``active``: while it is queued or running, until its message is acked or dead;
- ``period``: for ``unique_for_ms`` after its publish, however it ends.

Whether a key holds is read from its task's messages, not kept in the row, so no claim, ack
or transition writes the uniques table. The decision runs in the publish's transaction:

1. ``INSERT … ON CONFLICT DO NOTHING``: a new key is taken at once.
2. Otherwise the key's row is locked (``SELECT … FOR UPDATE`` on PostgreSQL; on SQLite the
   first statement already took the database's one write lock). A concurrent publish of the
   key waits here until the first commits, and then, in a statement of its own (a fresh
   snapshot under READ COMMITTED), sees that publish's message: two publishes of one key are
   decided one after the other, never both against the state before either.
3. A publish of the same task id (Celery's ``retry``, a republish) is never a duplicate.
   Otherwise, if the holder still holds, the publish is a duplicate: nothing is enqueued, a
   ``duplicate`` event is written on the original and the duplicate's task id is recorded
   (``duplicates``), so that its result reads as the original's. If not, the publish takes
   the key over.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Connection, select

from sqlease._core.base import Aggregate, StoreParts
from sqlease._core.names import utf8_size
from sqlease._core.timeline import Timeline
from sqlease._db.retry import transient
from sqlease._db.unique_sql import UniqueStatements
from sqlease.errors import ConfigurationError

#: The scopes a uniqueness key may have.
SCOPES = ("queued", "active", "period")
#: Longest key accepted (as concurrency keys).
MAX_UNIQUE_KEY_LENGTH = 200


def check_unique(key: Any, scope: Any, for_ms: Any) -> tuple[str | None, str | None, int | None]:
    """A publish's uniqueness key, scope and period (ms). Without a scope the key holds while
    the task is active, or for the period if one is given; a period needs scope ``period``."""
    if key is None:
        if scope is not None or for_ms is not None:
            raise ConfigurationError(
                f"unique_scope {scope!r} / unique_for {for_ms!r} were given without a "
                "unique_key: give the key too"
            )
        return None, None, None
    if not isinstance(key, str) or not key or len(key) > MAX_UNIQUE_KEY_LENGTH:
        raise ConfigurationError(
            f"unique_key must be a non-empty string of at most {MAX_UNIQUE_KEY_LENGTH} "
            f"characters, not {key!r}"
        )
    utf8_size("unique_key", key)
    if scope is None:
        scope = "active" if for_ms is None else "period"
    if scope not in SCOPES:
        raise ConfigurationError(
            f"unique_scope of key {key!r} must be one of {', '.join(SCOPES)}, not {scope!r}"
        )
    if scope == "period":
        if isinstance(for_ms, bool) or not isinstance(for_ms, int) or for_ms < 1:
            raise ConfigurationError(
                f"unique key {key!r} with scope 'period' needs unique_for, a number of "
                f"seconds > 0 (at least 1 ms), not {for_ms!r}"
            )
    elif for_ms is not None:
        raise ConfigurationError(
            f"unique_for is only for scope 'period'; key {key!r} has scope {scope!r}"
        )
    return key, scope, for_ms


@dataclass(frozen=True)
class Duplicate:
    """A publish turned away: the task that holds its key, and that task's newest message
    (None once it is gone)."""

    original_id: str | None
    message_id: int | None


@dataclass
class UniqueState:
    """One uniqueness key, as ``Admin.unique`` reports it."""

    key: str
    #: the task that holds (or last held) the key
    task_id: str | None
    scope: str
    #: whether a publish of the key now would be turned away
    holding: bool
    #: scope ``period``: the key holds until then (ms since the epoch)
    until_ms: int | None
    created_at_ms: int
    #: publishes turned away since the task took the key
    duplicates: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Uniques(Aggregate):
    """The uniqueness decision of a publish, and the reads ``Admin`` makes of keys."""

    def __init__(self, parts: StoreParts, timeline: Timeline) -> None:
        super().__init__(parts)
        self._timeline = timeline

    @property
    def _unique_sql(self) -> UniqueStatements:
        return self.sql.unique

    def _holder(self, conn: Connection, task_id: str | None, scope: str, now: int) -> int | None:
        """The newest message of ``task_id`` that holds its key under ``scope``, if any."""
        if task_id is None:
            return None
        sql = self._unique_sql
        statement = sql.holding_queued if scope == "queued" else sql.holding_active
        found = conn.execute(statement, {"holder": task_id, "now": now}).scalar()
        return None if found is None else int(found)

    def admit(self, conn: Connection, row: dict[str, Any], now: int | None) -> Duplicate | None:
        """Take the row's key for its task, or return the Duplicate it is (see the module)."""
        if now is None:  # the database's clock, as the publish statement itself reads it
            now = int(conn.execute(self.sql.now, {"now": None}).scalar_one())
        assert now is not None
        sql = self._unique_sql
        key, scope, task_id = row["unique_key"], row["unique_scope"], row["task_id"]
        until = now + row["unique_for_ms"] if scope == "period" else now
        terms = {"key": key, "task_id": task_id, "scope": scope, "until_ms": until, "now": now}
        if conn.execute(sql.take_new, terms).first() is not None:
            return None
        held = conn.execute(sql.lock, {"key": key}).first()
        assert held is not None  # rows go only in retention, which skips a held key's row
        if task_id is not None and held.task_id == task_id:
            return None  # the same task again (a retry): it keeps its key
        holder = self._holder(conn, held.task_id, held.scope, now)
        holds = held.until_ms > now if held.scope == "period" else holder is not None
        if not holds:
            conn.execute(sql.take_over, terms)
            return None
        conn.execute(sql.count, {"key": key})
        if task_id is not None:
            conn.execute(
                sql.record, {"task_id": task_id, "holder": held.task_id, "key": key, "now": now}
            )
        data = {"unique_key": key, "scope": held.scope, "duplicate_id": task_id}
        self._timeline.insert(conn, held.task_id, holder, None, "duplicate", json.dumps(data), now)
        return Duplicate(held.task_id, holder)

    @transient
    def unique(self, key: str, *, now: int | None = None) -> UniqueState | None:
        """The state of one uniqueness key, or None if no task has taken it (or its row has
        been pruned)."""
        at = self._now(now)
        u = self.tables.uniques
        with self.driver.reading() as conn:
            now = int(conn.execute(self.sql.now, {"now": at}).scalar_one())
            row = conn.execute(select(u).where(u.c.key == key)).first()
            if row is None:
                return None
            holder = self._holder(conn, row.task_id, row.scope, now)
        period = row.scope == "period"
        return UniqueState(
            key=row.key,
            task_id=row.task_id,
            scope=row.scope,
            holding=row.until_ms > now if period else holder is not None,
            until_ms=int(row.until_ms) if period else None,
            created_at_ms=int(row.created_at_ms),
            duplicates=int(row.duplicates),
        )

    @transient
    def originals_of(self, task_ids: list[str]) -> dict[str, str]:
        """For each of these task ids that was a duplicate publish, the original's task id."""
        if not task_ids:
            return {}
        d = self.tables.duplicates
        with self.driver.reading() as conn:
            rows = conn.execute(
                select(d.c.task_id, d.c.original_id).where(d.c.task_id.in_(task_ids))
            ).all()
        return {str(r.task_id): str(r.original_id) for r in rows if r.original_id is not None}
