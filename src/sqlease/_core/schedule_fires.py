"""Many slots fired together: the beat's batch, in the leader's transaction.

A minute boundary of thousands of entries is written with a few multi-row statements
(``sqlease._db.schedules.ScheduleFires``) instead of five statements per fire. Only plain
messages go this way: one whose task is unique, in a run, delayed or under a concurrency
key needs the publish's own checks, so the beat fires it one by one (``batchable`` says
which). The guarantees are the one-by-one fire's: every entry's compare-and-set on the slot
and revision it was read with, inside the transaction that renewed the leader's lease, and
for an entry that lost it (an edit, another leader's fire) nothing written at all."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from sqlease._core.base import dump
from sqlease._db.dialects import schedule_fires_for
from sqlease._db.schedules import PreparedFire
from sqlease.types import NewMessage

if TYPE_CHECKING:
    from sqlease._core.schedules import ScheduleStore


@dataclass(frozen=True, slots=True)
class BatchFire:
    """One slot of one entry, ready to be fired in a batch (``ScheduleFiring.prepare``)."""

    name: str
    #: The entry's revision and ``slot`` (its next slot) as they were read: the
    #: compare-and-set's condition.
    revision: int
    slot: int
    #: The entry's next slot after this one.
    next_ms: int
    task_id: str
    #: The fire as the dialect sends it.
    prepared: PreparedFire
    #: The ``fired`` event's data as JSON, after its first key (``late_ms``, known at the fire
    #: only): ``dump`` of the whole, written ahead.
    fired_tail: str


class ScheduleFiring:
    """The batch writes of one ``ScheduleStore``."""

    def __init__(self, entries: ScheduleStore, timeline_prefix: str) -> None:
        store = entries.store
        self._entries = entries
        self._messages = store.messages
        self._fires = schedule_fires_for(
            store.driver.name, store.tables, timeline_prefix, store.driver.wakeup_channel
        )

    def batchable(self, message: NewMessage) -> dict[str, Any] | None:
        """The checked row of a message that can be fired in a batch; None if it needs the
        one-by-one publish (unique, in a run, delayed, under a concurrency key, or without a
        task id). A bad message raises the publish's error."""
        row = self._messages._check_new(message)
        plain = (
            row["unique_key"] is None
            and row["run_id"] is None
            and row["gate_key"] is None
            and row["delay_ms"] <= 0
            and row["task_id"] is not None
            and row["record"]
        )
        return row if plain else None

    def prepare(
        self,
        name: str,
        revision: int,
        slot: int,
        next_ms: int,
        task_id: str,
        row: Mapping[str, Any],
        fired: Mapping[str, Any],
    ) -> BatchFire:
        """The fire of ``name``'s ``slot``, encoded ahead: ``row`` is its message's
        (``batchable``), ``fired`` the ``fired`` event's data but its lateness."""
        fields = {
            "name": name,
            "revision": revision,
            "slot": slot,
            "next": next_ms,
            "task_id": task_id,
            "queue": row["queue"],
            "payload": row["payload"],
            "priority": row["priority"],
            "max_attempts": row["max_attempts"],
            "task_name": row["task_name"],
            "group_id": row["group_id"],
            "sent": dump({"schedule": name, "slot_ms": slot}),
        }
        whole = dump({**fired, "late_ms": 0})
        assert whole is not None and whole.startswith('{"late_ms": 0, ')
        tail = whole[len('{"late_ms": 0, ') :]
        prepared = self._fires.prepare(fields)
        return BatchFire(name, revision, slot, next_ms, task_id, prepared, tail)

    def fire(self, conn: Connection, fires: Sequence[BatchFire], now_ms: int) -> set[str]:
        """Fire ``fires`` inside the leader's transaction ``conn`` at ``now_ms`` (the tick's
        time: each fire's lateness is counted from it); the names of the entries whose slot
        fired (the others changed since they were read: nothing of theirs is written, as
        with a one-by-one fire)."""
        sent = [
            (f.prepared, f'{{"late_ms": {max(0, now_ms - f.slot)}, {f.fired_tail}') for f in fires
        ]
        return set(self._fires.fire(conn, sent, self._entries._at(None)))
