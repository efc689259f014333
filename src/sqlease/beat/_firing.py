"""Firing one entry's due slots: each slot in one leader transaction (lease, compare-and-set,
event, enqueue), or none of it."""

from __future__ import annotations

import logging
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from sqlease._core.leaders import Term
from sqlease._core.schedules import EntryRow, ScheduleStore
from sqlease.errors import LeadershipLost
from sqlease.schedules._specs import Plan, from_spec, loads, next_slot, plan
from sqlease.transactions import transaction

if TYPE_CHECKING:
    from celery import Celery

    from sqlease.beat._options import BeatOptions

logger = logging.getLogger("sqlease.beat")

#: Task ids of fires are derived from (table prefix, entry, slot) in this namespace, so the
#: id of a slot's task is known before it is sent, and the same wherever it is computed.
#: Fires (or first slots planned) per leader transaction.
CHUNK = 100

TASK_ID_NAMESPACE = uuid.UUID("6c1b9d2e-8f0a-4d39-9a57-5e2f1c3b7a40")


def slot_task_id(prefix: str, name: str, slot_ms: int, *, manual: bool = False) -> str:
    """The task id of an entry's slot (``manual``: a run-now request made at ``slot_ms``)."""
    kind = "manual" if manual else "slot"
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{prefix}\x00{name}\x00{kind}\x00{slot_ms}"))


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


class Stale(Exception):
    """The entry changed (an edit, or another fire) since it was read: nothing was written."""


class Firing:
    """What the leader does with entries: plan the next slot, fire due slots, run-now."""

    def __init__(
        self, app: Celery, entries: ScheduleStore, options: BeatOptions, producer: Any
    ) -> None:
        self.app = app
        self.entries = entries
        self.options = options
        self.producer = producer
        self.prefix = entries.store.tables.prefix

    def _schedule(self, entry: EntryRow) -> Any:
        return from_spec(entry.name, entry.schedule, self.app)

    def plan_next(self, term: Term, entry: EntryRow, now: int) -> None:
        """An entry added, re-scheduled or enabled: its first slot after now."""
        first = next_slot(self._schedule(entry), now, self.app)
        with self.entries.firing(term, self.options.lease_ms) as conn:
            if self.entries.advance(conn, entry, next_ms=first, fired_ms=None, task_id=None):
                self.entries.event(conn, entry.name, "planned", {"next_run_at": iso(first)})

    def plan_together(self, term: Term, entries: list[EntryRow], now: int) -> None:
        """``plan_next`` for many entries, CHUNK per leader transaction."""
        firsts = [(e, next_slot(self._schedule(e), now, self.app)) for e in entries]
        for start in range(0, len(firsts), CHUNK):
            with self.entries.firing(term, self.options.lease_ms) as conn:
                for entry, first in firsts[start : start + CHUNK]:
                    if self.entries.advance(
                        conn, entry, next_ms=first, fired_ms=None, task_id=None
                    ):
                        self.entries.event(conn, entry.name, "planned", {"next_run_at": iso(first)})

    def run_now(self, term: Term, entry: EntryRow) -> str | None:
        requested = entry.run_requested_at_ms
        assert requested is not None
        task_id = slot_task_id(self.prefix, entry.name, requested, manual=True)
        with self.entries.firing(term, self.options.lease_ms) as conn:
            if not self.entries.advance(
                conn, entry, next_ms=0, fired_ms=requested, task_id=task_id, manual=True
            ):
                return None
            data = {"task_id": task_id, "requested_at": iso(requested), "manual": True}
            self.entries.event(conn, entry.name, "fired", data)
            self._send(conn, entry, task_id, requested)
            self.entries.on_task(conn, task_id, entry.name, None)
        return task_id

    def _plan(self, entry: EntryRow, now: int) -> Plan:
        assert entry.next_run_at_ms is not None
        is_cron = entry.schedule.get("kind") == "crontab"
        deadline = self.options.cron_deadline_seconds
        catch_up, grace = entry.catch_up, self.options.grace_seconds
        if is_cron and deadline is not None and catch_up == "once":
            catch_up, grace = "skip", deadline  # Celery's beat_cron_starting_deadline
        return plan(
            self._schedule(entry),
            entry.next_run_at_ms,
            now,
            self.app,
            catch_up=catch_up,
            limit=entry.catch_up_limit,
            grace_ms=int(grace * 1000),
        )

    def fire_together(self, term: Term, entries: list[EntryRow], now: int) -> list[EntryRow]:
        """Fire the entries that have exactly one slot to fire, up to CHUNK in one leader
        transaction (one commit for many fires: a minute boundary of 10,000 crontab entries
        is sent in seconds). The entries left to ``fire_due`` one by one: those with missed
        slots, and all of a chunk whose transaction failed (so that a bad entry waits alone)."""
        alone: list[EntryRow] = []
        simple: list[tuple[EntryRow, Plan]] = []
        for entry in entries:
            p = self._plan(entry, now)
            if len(p.fire) == 1 and not p.skipped:
                simple.append((entry, p))
            else:
                alone.append(entry)
        for start in range(0, len(simple), CHUNK):
            chunk = simple[start : start + CHUNK]
            try:
                with self.entries.firing(term, self.options.lease_ms) as conn:
                    for entry, p in chunk:
                        self._fire_on(conn, entry, p.fire[0], p.next_ms, {}, now)
            except LeadershipLost:
                raise
            except Exception:
                logger.debug(
                    "sqlease beat: a batch of fires failed; firing one by one", exc_info=True
                )
                alone.extend(entry for entry, _ in chunk)
        return alone

    def fire_due(self, term: Term, entry: EntryRow, now: int) -> list[str]:
        """Fire what the catch-up policy says of the slots that came; the task ids sent."""
        p = self._plan(entry, now)
        skipped = {"skipped": p.skipped, "more": p.more} if p.skipped else {}
        if not p.fire:
            with self.entries.firing(term, self.options.lease_ms) as conn:
                if self.entries.advance(
                    conn, entry, next_ms=p.next_ms, fired_ms=None, task_id=None
                ):
                    data = dict(skipped, first=iso(p.due[0]), last=iso(p.due[-1]))
                    data["next_run_at"] = iso(p.next_ms)
                    self.entries.event(conn, entry.name, "slots_skipped", data)
            return []
        sent: list[str] = []
        for i, slot in enumerate(p.fire):
            following = p.fire[i + 1] if i + 1 < len(p.fire) else p.next_ms
            try:
                sent.append(self._fire_slot(term, entry, slot, following, skipped, now))
            except Stale:
                break
            entry = replace(entry, next_run_at_ms=following)
            skipped = {}
        return sent

    def _fire_slot(
        self,
        term: Term,
        entry: EntryRow,
        slot: int,
        following: int,
        skipped: dict[str, Any],
        now: int,
    ) -> str:
        with self.entries.firing(term, self.options.lease_ms) as conn:
            task_id = self._fire_on(conn, entry, slot, following, skipped, now)
        if task_id is None:
            raise Stale(entry.name)
        return task_id

    def _fire_on(
        self,
        conn: Connection,
        entry: EntryRow,
        slot: int,
        following: int,
        skipped: dict[str, Any],
        now: int,
    ) -> str | None:
        """One slot inside the leader's transaction ``conn``: the compare-and-set, the event
        and the send; None (nothing written) if the entry changed since it was read."""
        task_id = slot_task_id(self.prefix, entry.name, slot)
        if not self.entries.advance(conn, entry, next_ms=following, fired_ms=slot, task_id=task_id):
            return None
        data: dict[str, Any] = dict(skipped, slot=iso(slot), task_id=task_id)
        data["late_ms"] = max(0, now - slot)
        data["next_run_at"] = iso(following)
        self.entries.event(conn, entry.name, "fired", data)
        self._send(conn, entry, task_id, slot)
        self.entries.on_task(conn, task_id, entry.name, slot)
        logger.info(
            "sqlease beat: sending %s (%s) for %s as %s", entry.name, entry.task, iso(slot), task_id
        )
        return task_id

    def _send(self, conn: Connection, entry: EntryRow, task_id: str, slot: int) -> None:
        """Enqueue the entry's task inside ``conn``'s transaction, through Celery (routing,
        serializer, expires and the rest as ``apply_async`` does them)."""
        args, kwargs, options = loads(entry.args), loads(entry.kwargs), loads(entry.options)
        headers = dict(options.pop("headers", None) or {})
        headers.setdefault("celery_beat_task", True)  # as Celery's own scheduler marks them
        headers["sqlease_schedule"] = entry.name
        headers["sqlease_slot"] = iso(slot)
        options.pop("task_id", None)
        with transaction(conn):
            task = self.app.tasks.get(entry.task)
            if task is not None:
                task.apply_async(
                    args,
                    kwargs,
                    task_id=task_id,
                    producer=self.producer,
                    headers=headers,
                    **options,
                )
            else:
                self.app.send_task(
                    entry.task,
                    args,
                    kwargs,
                    task_id=task_id,
                    producer=self.producer,
                    headers=headers,
                    **options,
                )
