"""The statements that move a periodic task entry on: each a compare-and-set on the slot (or
run-now request) it was read with and on its revision. Plain text, built once per store: the
leader runs one per fire, and building a Core UPDATE for each cost more than running it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Connection, TextClause, text

from sqlease._db.tables import Tables


@dataclass(frozen=True)
class ScheduleStatements:
    #: A slot fired: the next slot, the fire recorded.
    fire: TextClause
    #: A run-now request fired: the request cleared, the fire recorded, the slots unchanged.
    fire_requested: TextClause
    #: Slots passed over without a fire (catch-up ``skip``): the next slot only.
    move: TextClause
    #: A new or rescheduled entry's first slot.
    plan: TextClause


def schedule_statements(tables: Tables) -> ScheduleStatements:
    name = tables.schedules.name
    same = "name = :name AND revision = :revision"
    fired = (
        "last_run_at_ms = :fired, last_task_id = :task_id, total_run_count = total_run_count + 1"
    )
    return ScheduleStatements(
        fire=text(
            f"UPDATE {name} SET next_run_at_ms = :next, {fired} "
            f"WHERE {same} AND next_run_at_ms = :expected"
        ),
        fire_requested=text(
            f"UPDATE {name} SET run_requested_at_ms = NULL, {fired} "
            f"WHERE {same} AND run_requested_at_ms = :expected"
        ),
        move=text(
            f"UPDATE {name} SET next_run_at_ms = :next WHERE {same} AND next_run_at_ms = :expected"
        ),
        plan=text(
            f"UPDATE {name} SET next_run_at_ms = :next WHERE {same} AND next_run_at_ms IS NULL"
        ),
    )


#: The fields of one fire (``ScheduleFires.prepare``): the entry's compare-and-set (``name``,
#: ``revision``, the ``slot`` it was read with and fires, its ``next`` slot), the message
#: (checked by the store: a plain one, no run, delay, gate or uniqueness) and the
#: ``sent_by_schedule`` event's data as JSON (``sent``). The ``fired`` event's data (JSON) is
#: known at the fire only (how late it is), and given then.
FIRE_FIELDS = (
    "name",
    "revision",
    "slot",
    "next",
    "task_id",
    "queue",
    "payload",
    "priority",
    "max_attempts",
    "task_name",
    "group_id",
    "sent",
)


class PreparedFire(Protocol):
    """One fire as its dialect will send it (encoded when it is prepared, ahead of its slot:
    at the boundary only the ``fired`` event's data is added)."""

    @property
    def name(self) -> str: ...


class ScheduleFires(Protocol):
    """Many slots fired in the leader's transaction with a few multi-row statements: each
    entry's compare-and-set, and for those that won their message, its ``enqueued`` event and
    task row, the ``fired`` and ``sent_by_schedule`` events, and a wake-up per queue."""

    def prepare(self, fire: Mapping[str, Any]) -> PreparedFire:
        """The fire of ``FIRE_FIELDS``, encoded."""
        ...

    def fire(
        self, conn: Connection, fires: Sequence[tuple[PreparedFire, str]], now: int | None
    ) -> list[str]:
        """Fire ``fires`` (each with its ``fired`` event's data as JSON); the names of the
        entries whose slot fired (the others changed since they were read: nothing of theirs
        is written)."""
        ...

    def statements(self) -> dict[str, TextClause]:
        """The statements, by name (the SQL snapshot renders them)."""
        ...
