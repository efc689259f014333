"""Firing one entry's due slots: each slot in one leader transaction (lease, compare-and-set,
event, enqueue), or none of it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from time import monotonic
from typing import TYPE_CHECKING, Any

from celery import signals
from sqlalchemy import Connection

from sqlease._core.leaders import Term
from sqlease._core.schedules import EntryRow, ScheduleStore
from sqlease.beat._calls import iso, slot_task_id, task_call
from sqlease.errors import DatabaseUnavailable, LeadershipLost
from sqlease.schedules._specs import Plan, from_spec, next_slot, plan
from sqlease.transactions import transaction

if TYPE_CHECKING:
    from celery import Celery

    from sqlease.beat._options import BeatOptions
    from sqlease.beat._prebuild import Prebuilder, Prebuilt

logger = logging.getLogger("sqlease.beat")

#: Fires (or first slots planned) per leader transaction, one by one.
CHUNK = 100
#: Prebuilt fires per leader transaction (a few multi-row statements).
BATCH_FIRES = 1000
#: The longest share of the lease a leader builds fires for before it writes them.
BUILD_SHARE = 0.25


class Stale(Exception):
    """The entry changed (an edit, or another fire) since it was read: nothing was written."""


class Firing:
    """What the leader does with entries: plan the next slot, fire due slots, run-now."""

    def __init__(
        self,
        app: Celery,
        entries: ScheduleStore,
        options: BeatOptions,
        producer: Any,
        prebuilt: Prebuilder | None = None,
    ) -> None:
        self.app = app
        self.entries = entries
        self.options = options
        self.producer = producer
        self.prefix = entries.store.tables.prefix
        #: The leader's prebuilt fires (None: every fire is sent one by one).
        self.prebuilt = prebuilt

    def _schedule(self, entry: EntryRow) -> Any:
        return from_spec(entry.name, entry.schedule, self.app)

    def next_after(self, entry: EntryRow, slot: int) -> int:
        """The entry's first slot after ``slot``."""
        return next_slot(self._schedule(entry), slot, self.app)

    def first_slot(self, entry: EntryRow, now: int, since: int | None = None) -> int:
        """An entry's first slot after ``since`` (the planning's start, no later than
        now), or after now when that one has already come."""
        sched = self._schedule(entry)
        if since is not None and since < now:
            first = next_slot(sched, since, self.app)
            if first > now:
                return first
        return next_slot(sched, now, self.app)

    def plan_next(self, term: Term, entry: EntryRow, now: int, since: int | None = None) -> None:
        """An entry added, re-scheduled or enabled: its first slot after now (after
        ``since``, see ``first_slot``)."""
        first = self.first_slot(entry, now, since)
        with self.entries.firing(term, self.options.lease_ms) as conn:
            if self.entries.advance(conn, entry, next_ms=first, fired_ms=None, task_id=None):
                self.entries.event(conn, entry.name, "planned", {"next_run_at": iso(first)})

    def plan_together(
        self, term: Term, entries: list[EntryRow], now: int, since: int | None = None
    ) -> None:
        """``plan_next`` for many entries, CHUNK per leader transaction."""
        firsts = [(e, self.first_slot(e, now, since)) for e in entries]
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

    def policy(self, entry: EntryRow) -> tuple[str, float]:
        """The entry's catch-up policy and grace seconds (Celery's beat_cron_starting_deadline
        for a crontab entry that catches up once)."""
        is_cron = entry.schedule.get("kind") == "crontab"
        deadline = self.options.cron_deadline_seconds
        if is_cron and deadline is not None and entry.catch_up == "once":
            return "skip", deadline
        return entry.catch_up, self.options.grace_seconds

    def _plan(self, entry: EntryRow, now: int) -> Plan:
        assert entry.next_run_at_ms is not None
        catch_up, grace = self.policy(entry)
        following = None if self.prebuilt is None else self.prebuilt.next_of(entry)
        if following is not None and following > now:
            # One slot came (the next one is still ahead): what ``plan`` answers, without
            # the schedule's arithmetic (done when the fire was prebuilt).
            slot = entry.next_run_at_ms
            fires = now - slot <= grace * 1000 or catch_up != "skip"
            return Plan([slot] if fires else [], 0 if fires else 1, following, due=[slot])
        return plan(
            self._schedule(entry),
            entry.next_run_at_ms,
            now,
            self.app,
            catch_up=catch_up,
            limit=entry.catch_up_limit,
            grace_ms=int(grace * 1000),
        )

    def fire_prebuilt(self, term: Term, now: int, ready: Callable[[str], bool]) -> int:
        """Fire the prebuilt fires whose slot came, without reading their entries first: the
        batch's compare-and-set on the revision and slot each was built for is the check,
        and an entry that changed keeps its due slot for ``fire_together``. Only fires on
        time (or that their catch-up policy fires: one slot came, the next is ahead). The
        number of fires written."""
        if self.prebuilt is None or not self.prebuilt.usable():
            return 0
        fires: list[Prebuilt] = []
        for built in self.prebuilt.came(now):
            catch_up, grace = built.policy
            on_time = now - built.slot <= grace * 1000 or catch_up != "skip"
            if built.next_ms > now and on_time and ready(built.name):
                fires.append(built)
        sent = 0
        for start in range(0, len(fires), BATCH_FIRES):
            sent += len(self._fire_batch(term, fires[start : start + BATCH_FIRES], now) or ())
        return sent

    def fire_together(self, term: Term, entries: list[EntryRow], now: int) -> list[EntryRow]:
        """Fire the entries whose slots fire from their due one on: those whose messages can
        be prebuilt in batches of BATCH_FIRES (``_fire_batch``; several slots of an entry in
        waves), the others with one slot up to CHUNK in one leader transaction. The entries
        left to ``fire_due`` one by one: those whose catch-up leaves slots out, and all of a
        chunk whose transaction failed (so that a bad entry waits alone)."""
        alone: list[EntryRow] = []
        simple: list[tuple[EntryRow, Plan]] = []
        batch: list[Prebuilt] = []
        several: list[list[Prebuilt]] = []
        of: dict[str, EntryRow] = {}
        prebuilt = self.prebuilt if self.prebuilt is not None and self.prebuilt.usable() else None
        # What is built here is written at least every BUILD_SHARE of the lease: each write
        # renews the lease, and building thousands of fires before writing any (a new leader
        # has nothing built ahead) would let it lapse; a standby would take over, and build
        # them all again.
        budget = self.options.lease_seconds * BUILD_SHARE
        since = monotonic()

        def write() -> None:
            nonlocal since
            for start in range(0, len(batch), BATCH_FIRES):
                chunk = batch[start : start + BATCH_FIRES]
                if self._fire_batch(term, chunk, now) is None:
                    alone.extend(of[built.name] for built in chunk)
            alone.extend(of[name] for name in self._fire_waves(term, several, now))
            batch.clear()
            several.clear()
            since = monotonic()

        for entry in entries:
            p = self._plan(entry, now)
            if not p.fire or p.skipped or p.fire[0] != entry.next_run_at_ms:
                alone.append(entry)
                continue
            if len(p.fire) > 1:
                # Consecutive slots from the due one (catch-up "all" after a takeover or an
                # outage): built now, fired in waves, so a catch-up is not one transaction
                # and one apply_async per slot.
                fires = None if prebuilt is None else self._build_all(prebuilt, entry, p, now)
                if fires is None:
                    alone.append(entry)
                else:
                    several.append(fires)
                    of[entry.name] = entry
            else:
                built = None if prebuilt is None else prebuilt.take(entry, p.fire[0], now)
                if built is None or built.next_ms != p.next_ms:
                    simple.append((entry, p))
                    continue
                batch.append(built)
                of[entry.name] = entry
            if len(batch) + len(several) >= BATCH_FIRES or monotonic() - since > budget:
                write()
        write()
        for start in range(0, len(simple), CHUNK):
            chunk_simple = simple[start : start + CHUNK]
            try:
                with self.entries.firing(term, self.options.lease_ms) as conn:
                    for entry, p in chunk_simple:
                        self._fire_on(conn, entry, p.fire[0], p.next_ms, {}, now)
            except LeadershipLost:
                raise
            except Exception:
                logger.debug(
                    "sqlease beat: a batch of fires failed; firing one by one", exc_info=True
                )
                alone.extend(entry for entry, _ in chunk_simple)
        return alone

    @staticmethod
    def _build_all(
        prebuilt: Prebuilder, entry: EntryRow, p: Plan, now: int
    ) -> list[Prebuilt] | None:
        """The fires of every slot of ``p`` (consecutive, from the entry's due one), each
        leading to the next; None if one cannot be prebuilt."""
        fires = []
        for i, slot in enumerate(p.fire):
            following = p.fire[i + 1] if i + 1 < len(p.fire) else p.next_ms
            built = prebuilt.take(entry, slot, now) if i == 0 else prebuilt.build(entry, slot, now)
            if built is None or built.next_ms != following:
                return None
            fires.append(built)
        return fires

    def _fire_waves(self, term: Term, several: list[list[Prebuilt]], now: int) -> set[str]:
        """Fire entries' consecutive slots in waves: every entry's first, then every
        entry's second, and so on (each wave's compare-and-set on the slot the one before
        moved to). The names of the entries to fire one by one: those in a batch that
        failed. An entry whose fire lost its compare-and-set (changed since it was read)
        writes nothing more: its later fires' compare-and-set fails too."""
        failed: set[str] = set()
        depth = max((len(fires) for fires in several), default=0)
        for i in range(depth):
            wave = [fires[i] for fires in several if len(fires) > i and fires[0].name not in failed]
            for start in range(0, len(wave), BATCH_FIRES):
                chunk = wave[start : start + BATCH_FIRES]
                if self._fire_batch(term, chunk, now) is None:
                    failed.update(built.name for built in chunk)
        return failed

    def _fire_batch(self, term: Term, batch: list[Prebuilt], now: int) -> set[str] | None:
        """One leader transaction of prebuilt fires (multi-row statements); then, committed,
        ``after_task_publish`` for each. The names of the entries fired; None if the
        transaction failed (nothing was written)."""
        assert self.prebuilt is not None
        try:
            with self.entries.firing(term, self.options.lease_ms) as conn:
                won = self.prebuilt.batch.fire(conn, [built.fire for built in batch], now)
        except (LeadershipLost, DatabaseUnavailable):
            raise
        except Exception:
            # Unexpected (every fire in it was checked when it was built): said loudly, and
            # its entries stay due, to be fired one by one.
            logger.warning(
                "sqlease beat: a batch of prebuilt fires failed; firing one by one", exc_info=True
            )
            return None
        receivers = signals.after_task_publish.receivers
        for built in batch:
            if built.name not in won:
                continue  # changed since it was read: nothing was written
            logger.debug(
                "sqlease beat: sent %s for %s as %s", built.name, iso(built.slot), built.task_id
            )
            if receivers:
                sender, body, headers, exchange, routing_key = built.after
                signals.after_task_publish.send(
                    sender=sender,
                    body=body,
                    headers=headers,
                    exchange=exchange,
                    routing_key=routing_key,
                )
        if won:
            logger.info("sqlease beat: sent %d entries' slots in one transaction", len(won))
        return won

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
        task, args, kwargs, options = task_call(self.app, entry, task_id, slot)
        with transaction(conn):
            if task is not None:
                task.apply_async(args, kwargs, producer=self.producer, **options)
            else:
                self.app.send_task(entry.task, args, kwargs, producer=self.producer, **options)
