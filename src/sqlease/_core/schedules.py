"""Periodic task entries and the beat's leader lease, in SQL.

An entry's row holds what to send (task, args, kwargs, options), when (its schedule as JSON
and ``next_run_at_ms``, the next slot) and what happened last. Firing a slot is one
transaction, opened by ``firing``: the leader's lease is renewed under a row lock first (a
stale leader's fire fails there), then ``advance`` moves the entry's next slot with a
compare-and-set on the slot it expected and on the entry's revision, and the caller enqueues
the task and writes the event in the same transaction. So a slot fires once or not at all,
whoever crashes or stalls when.

The schedule arithmetic (Celery's ``celery.schedules``) is not here: the core knows slots
only as epoch milliseconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, insert, select, update

from sqlease._core.base import dump
from sqlease._core.leaders import LeaderLease, Term
from sqlease._core.store import Store
from sqlease._db.schedules import schedule_statements
from sqlease.errors import DuplicateSchedule, LeadershipLost, UnknownSchedule

#: The events of an entry's timeline carry this task id prefix and the entry's name.
TIMELINE_PREFIX = "schedule:"
#: The beat's leader lease (one per table prefix).
BEAT_LEADER = "beat"
#: Columns an edit may set (``revise``).
EDITABLE = (
    "task",
    "schedule",
    "args",
    "kwargs",
    "options",
    "enabled",
    "catch_up",
    "catch_up_limit",
    "source",
    "config_digest",
)


def timeline_id(name: str) -> str:
    """The task id under which an entry's events are recorded."""
    return f"{TIMELINE_PREFIX}{name}"


@dataclass(frozen=True)
class EntryRow:
    """One periodic task entry as stored (JSON columns decoded)."""

    name: str
    task: str
    schedule: dict[str, Any]
    #: JSON text as the caller stored it (kombu's JSON: the adapter decodes it).
    args: str
    kwargs: str
    options: str
    enabled: bool
    catch_up: str
    catch_up_limit: int
    source: str
    config_digest: str | None
    next_run_at_ms: int | None
    run_requested_at_ms: int | None
    last_run_at_ms: int | None
    last_task_id: str | None
    total_run_count: int
    revision: int
    created_at_ms: int
    updated_at_ms: int


def _row(row: Any) -> EntryRow:
    return EntryRow(
        name=row["name"],
        task=row["task"],
        schedule=json.loads(row["schedule"]),
        args=row["args"],
        kwargs=row["kwargs"],
        options=row["options"],
        enabled=bool(row["enabled"]),
        catch_up=row["catch_up"],
        catch_up_limit=int(row["catch_up_limit"]),
        source=row["source"],
        config_digest=row["config_digest"],
        next_run_at_ms=row["next_run_at_ms"],
        run_requested_at_ms=row["run_requested_at_ms"],
        last_run_at_ms=row["last_run_at_ms"],
        last_task_id=row["last_task_id"],
        total_run_count=int(row["total_run_count"]),
        revision=int(row["revision"]),
        created_at_ms=int(row["created_at_ms"]),
        updated_at_ms=int(row["updated_at_ms"]),
    )


def _encode(values: Mapping[str, Any]) -> dict[str, Any]:
    """Column values with the JSON columns encoded (``args`` and friends arrive encoded by
    the caller, which knows the app's serializer; ``schedule`` as a dict)."""
    out = dict(values)
    if isinstance(out.get("schedule"), dict):
        out["schedule"] = json.dumps(out["schedule"], sort_keys=True)
    return out


class ScheduleStore(LeaderLease):
    """Entries and the leader lease on one store."""

    def __init__(
        self,
        store: Store,
        leader: str = BEAT_LEADER,
        *,
        clock: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(store, leader, clock=clock)
        self.t = store.tables.schedules
        self._sql = schedule_statements(store.tables)

    # ---- reading -----------------------------------------------------------------------

    def get(self, name: str, conn: Connection | None = None) -> EntryRow | None:
        query = select(self.t).where(self.t.c.name == name)
        if conn is not None:
            row = conn.execute(query).mappings().first()
        else:
            with self.store.driver.reading() as reading:
                row = reading.execute(query).mappings().first()
        return None if row is None else _row(row)

    def require(self, name: str) -> EntryRow:
        entry = self.get(name)
        if entry is None:
            raise UnknownSchedule(f"no periodic task entry named {name!r}")
        return entry

    def all(self) -> list[EntryRow]:
        with self.store.driver.reading() as conn:
            rows = conn.execute(select(self.t).order_by(self.t.c.name)).mappings().all()
        return [_row(r) for r in rows]

    def due(self, now: int, limit: int) -> list[EntryRow]:
        """Enabled entries whose next slot has come, oldest first (the due index)."""
        c = self.t.c
        query = (
            select(self.t)
            .where(c.enabled.is_(True), c.next_run_at_ms <= now)
            .order_by(c.next_run_at_ms, c.name)
            .limit(limit)
        )
        with self.store.driver.reading() as conn:
            return [_row(r) for r in conn.execute(query).mappings().all()]

    def upcoming(self, after: tuple[int, str], until_ms: int, limit: int) -> list[EntryRow]:
        """Enabled entries whose next slot is after ``after`` (a slot, and the name of the
        last entry of that slot already seen) and at most ``until_ms``, in (slot, name)
        order: what the leader builds ahead of the slots (the due index)."""
        c = self.t.c
        slot, name = after
        query = (
            select(self.t)
            .where(
                c.enabled.is_(True),
                c.next_run_at_ms <= until_ms,
                (c.next_run_at_ms > slot) | ((c.next_run_at_ms == slot) & (c.name > name)),
            )
            .order_by(c.next_run_at_ms, c.name)
            .limit(limit)
        )
        with self.store.driver.reading() as conn:
            return [_row(r) for r in conn.execute(query).mappings().all()]

    def unplanned(self, limit: int) -> list[EntryRow]:
        """Entries whose next slot the leader has to compute, and "run now" requests."""
        c = self.t.c
        with self.store.driver.reading() as conn:
            fresh = conn.execute(
                select(self.t).where(c.enabled.is_(True), c.next_run_at_ms.is_(None)).limit(limit)
            ).mappings()
            rows = {r["name"]: r for r in fresh}
            asked = conn.execute(
                select(self.t).where(c.run_requested_at_ms.is_not(None)).limit(limit)
            ).mappings()
            rows.update({r["name"]: r for r in asked})
        return [_row(r) for r in rows.values()]

    def next_due_ms(self) -> int | None:
        """The earliest next slot of an enabled entry (one index read)."""
        c = self.t.c
        with self.store.driver.reading() as conn:
            value = conn.execute(
                select(func.min(c.next_run_at_ms)).where(c.enabled.is_(True))
            ).scalar()
        return None if value is None else int(value)

    # ---- edits (Admin, the CLI, a config sync) ---------------------------------------------

    def add(self, values: Mapping[str, Any], *, now: int | None = None) -> EntryRow:
        at = self._now(now)
        row = dict(_encode(values), created_at_ms=at, updated_at_ms=at, revision=0)
        row.setdefault("next_run_at_ms", None)
        with self.store.driver.writing() as conn:
            if self.get(row["name"], conn) is not None:
                raise DuplicateSchedule(row["name"])
            conn.execute(insert(self.t).values(row))
            self.event(conn, row["name"], "schedule_added", {"source": row["source"]}, at)
        return self.require(row["name"])

    def revise(
        self,
        name: str,
        changes: Mapping[str, Any],
        *,
        replan: bool = False,
        kind: str = "schedule_changed",
        now: int | None = None,
    ) -> EntryRow:
        """Apply ``changes`` (EDITABLE columns) and bump the revision; ``replan``: the next
        slot is computed again by the leader (the schedule changed, or it was enabled)."""
        unknown = set(changes) - set(EDITABLE)
        if unknown:
            raise ValueError(f"not editable: {', '.join(sorted(unknown))}")
        at = self._now(now)
        values = dict(_encode(changes), updated_at_ms=at, revision=self.t.c.revision + 1)
        if replan:
            values["next_run_at_ms"] = None
        with self.store.driver.writing() as conn:
            done = conn.execute(update(self.t).where(self.t.c.name == name).values(values))
            if done.rowcount != 1:
                raise UnknownSchedule(f"no periodic task entry named {name!r}")
            self.event(conn, name, kind, {"fields": sorted(changes)}, at)
        return self.require(name)

    def remove(self, name: str, *, now: int | None = None) -> None:
        at = self._now(now)
        with self.store.driver.writing() as conn:
            done = conn.execute(self.t.delete().where(self.t.c.name == name))
            if done.rowcount != 1:
                raise UnknownSchedule(f"no periodic task entry named {name!r}")
            self.event(conn, name, "schedule_removed", None, at)

    def request_run(self, name: str, *, now: int | None = None) -> None:
        at = self._now(now)
        with self.store.driver.writing() as conn:
            done = conn.execute(
                update(self.t)
                .where(self.t.c.name == name)
                .values(run_requested_at_ms=at, updated_at_ms=at)
            )
            if done.rowcount != 1:
                raise UnknownSchedule(f"no periodic task entry named {name!r}")
            self.event(conn, name, "run_requested", None, at)

    # ---- the leader's writes (inside ``firing``) --------------------------------------------

    @contextmanager
    def firing(self, term: Term, lease_ms: int) -> Iterator[Connection]:
        """One transaction of the leader's: its lease renewed and the row locked first;
        LeadershipLost (and nothing written) when the lease is no longer this leader's."""
        with self.store.driver.writing(statements=4) as conn:
            if not self._renew_on(conn, term, lease_ms):
                raise LeadershipLost(
                    f"the beat leader lease {self.leader!r} is no longer held by "
                    f"{term.owner} (term {term.term}): the write was refused"
                )
            yield conn

    def advance(
        self,
        conn: Connection,
        entry: EntryRow,
        *,
        next_ms: int,
        fired_ms: int | None,
        task_id: str | None,
        manual: bool = False,
    ) -> bool:
        """Move the entry from the slot it was read with to ``next_ms`` (and record a fire
        of ``fired_ms``); False when an edit or another fire got there first."""
        sql = self._sql
        params: dict[str, Any] = {
            "name": entry.name,
            "revision": entry.revision,
            "next": next_ms,
            "expected": entry.next_run_at_ms,
            "fired": fired_ms,
            "task_id": task_id,
        }
        if manual:
            params["expected"] = entry.run_requested_at_ms
            statement = sql.fire_requested
        elif entry.next_run_at_ms is None:
            statement = sql.plan
        else:
            statement = sql.fire if task_id is not None else sql.move
        return bool(conn.execute(statement, params).rowcount == 1)

    def on_task(self, conn: Connection, task_id: str, name: str, slot_ms: int | None) -> None:
        """The link from a sent task's own timeline back to the entry and slot it came from."""
        data = {"schedule": name, "slot_ms": slot_ms}
        self.store.timeline.insert(
            conn, task_id, None, None, "sent_by_schedule", dump(data), self._at(None)
        )

    def event(
        self, conn: Connection, name: str, kind: str, data: Any, now: int | None = None
    ) -> None:
        """Append an event to the entry's timeline inside the caller's transaction."""
        at = self._at(now)
        self.store.timeline.insert(conn, timeline_id(name), None, None, kind, dump(data), at)


def sync_config(
    entries: ScheduleStore,
    conn: Connection,
    config: Mapping[str, tuple[dict[str, Any], str]],
    now: int,
) -> dict[str, list[str]]:
    """Make the config's entries the stored ones, inside the leader's transaction ``conn``.

    ``config`` maps a name to (its columns, their digest). An entry whose digest is unchanged
    is left alone, runtime edits and all; a changed one is rewritten (its next slot computed
    again if its schedule changed); a config entry that left the config is removed; entries
    added at runtime stay."""
    t = entries.t
    stored = {
        r["name"]: r
        for r in conn.execute(
            select(t.c.name, t.c.source, t.c.config_digest, t.c.schedule)
        ).mappings()
    }
    done: dict[str, list[str]] = {"added": [], "changed": [], "removed": []}
    added: list[dict[str, Any]] = []
    for name, (columns, digest) in config.items():
        row = dict(_encode(columns), source="config", config_digest=digest)
        old = stored.get(name)
        if old is None:
            row.update(created_at_ms=now, updated_at_ms=now, revision=0, next_run_at_ms=None)
            added.append(row)
            done["added"].append(name)
        elif old["config_digest"] != digest or old["source"] != "config":
            values: dict[str, Any] = dict(row, updated_at_ms=now, revision=t.c.revision + 1)
            if old["schedule"] != row["schedule"] or not columns.get("enabled", True):
                values["next_run_at_ms"] = None
            conn.execute(update(t).where(t.c.name == name).values(values))
            entries.event(conn, name, "schedule_changed", {"source": "config"}, now)
            done["changed"].append(name)
    if added:
        # Many rows per statement: a first start with thousands of entries syncs them in
        # one short transaction, well within the leader's lease.
        conn.execute(insert(t), added)
        event = dump({"source": "config"})
        at = entries._at(now)
        entries.store.timeline.insert_many(
            conn, [(timeline_id(row["name"]), "schedule_added", event) for row in added], at
        )
    for name, old in stored.items():
        if old["source"] == "config" and name not in config:
            conn.execute(t.delete().where(t.c.name == name))
            entries.event(conn, name, "schedule_removed", {"source": "config"}, now)
            done["removed"].append(name)
    return done
