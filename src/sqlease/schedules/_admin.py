"""``Admin``'s periodic task verbs: list, show, add, change, enable, disable, remove, run now.

Every edit is one transaction that bumps the entry's revision, so a fire the leader prepared
from the old entry is refused, and the leader reads the new one at its next tick. A new or
re-scheduled entry's next slot is left for the leader to compute in its app's timezone.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlease._core.schedules import EntryRow, ScheduleStore
from sqlease.errors import InvalidSchedule, UnknownTask
from sqlease.schedules._specs import describe, entry_spec, from_spec, loads, parse_crontab

if TYPE_CHECKING:
    from sqlease.store import Store

#: Not given (``None`` is a value some fields take).
_UNSET: Any = object()


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="seconds")


def _schedule_value(name: str, every: Any, cron: Any, schedule: Any) -> Any:
    given = [v for v in (every, cron, schedule) if v is not None]
    if len(given) != 1:
        raise InvalidSchedule(name, "schedule", "give exactly one of every, crontab, schedule")
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int | float | timedelta):
            raise InvalidSchedule(name, "schedule", f"every takes seconds, not {every!r}")
        return every
    if cron is not None:
        if not isinstance(cron, str):
            raise InvalidSchedule(name, "schedule", f"crontab takes a string, not {cron!r}")
        return from_spec(name, parse_crontab(name, cron))
    return schedule


class ScheduleAdmin:
    """Periodic tasks as ``Admin`` shows and edits them (``Admin.list_schedules``, …)."""

    def __init__(self, store: Store, task: Callable[[str], Any]) -> None:
        self.store = store
        #: One task's snapshot (``Admin.task``): an entry's last run's state.
        self.task = task
        self._schedule_store: ScheduleStore | None = None

    @property
    def _entries(self) -> ScheduleStore:
        if self._schedule_store is None:
            self._schedule_store = ScheduleStore(self.store)
        return self._schedule_store

    # ---- reading -----------------------------------------------------------------------

    def _last_state(self, task_id: str | None) -> str | None:
        if task_id is None:
            return None
        try:
            return str(self.task(task_id).state)
        except UnknownTask:
            return "unknown"  # removed by retention

    def _entry_dict(self, row: EntryRow) -> dict[str, Any]:
        return {
            "name": row.name,
            "task": row.task,
            "schedule": describe(row.schedule),
            "spec": row.schedule,
            "args": loads(row.args),
            "kwargs": loads(row.kwargs),
            "options": loads(row.options),
            "enabled": row.enabled,
            "catch_up": row.catch_up,
            "catch_up_limit": row.catch_up_limit,
            "source": row.source,
            "next_run_at": _iso(row.next_run_at_ms),
            "next_run_at_ms": row.next_run_at_ms,
            "run_requested": row.run_requested_at_ms is not None,
            "last_run_at": _iso(row.last_run_at_ms),
            "last_task_id": row.last_task_id,
            "last_state": self._last_state(row.last_task_id),
            "total_run_count": row.total_run_count,
            "revision": row.revision,
        }

    def list_schedules(self) -> list[dict[str, Any]]:
        """Every periodic task entry, by name: schedule, next and last run, the last run's
        task id and state."""
        return [self._entry_dict(r) for r in self._entries.all()]

    def get_schedule(self, name: str) -> dict[str, Any]:
        """One entry (as ``list_schedules``) and its timeline under ``events``."""
        found = self._entry_dict(self._entries.require(name))
        events = self.store.events(task_id=f"schedule:{name}")
        found["events"] = [{"kind": e.kind, "at": _iso(e.at_ms), "data": e.data} for e in events]
        return found

    def beat_leader(self) -> dict[str, Any] | None:
        """The beat's leader lease: owner, term, expiry, and what the leader published."""
        return self._entries.leader_row()

    # ---- edits -------------------------------------------------------------------------

    def _check_task(self, name: str, task: str) -> None:
        """Known task names are those the current beat leader's app registers."""
        leader = self._entries.leader_row()
        known = (leader or {}).get("info", {}).get("tasks")
        if known and task not in known:
            close = difflib.get_close_matches(task, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise InvalidSchedule(
                name, "task", f"unknown task {task!r}: the beat's app registers none{hint}"
            )

    def add_schedule(
        self,
        name: str,
        task: str,
        *,
        every: float | timedelta | None = None,
        crontab: str | None = None,
        schedule: Any = None,
        args: list[Any] | tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        enabled: bool = True,
        catch_up: str = "once",
        catch_up_limit: int = 100,
        check_task: bool = True,
    ) -> dict[str, Any]:
        """Add an entry at runtime (a config sync keeps it). The schedule: ``every`` seconds,
        a ``crontab`` string (``"*/5 * * * *"``) or a Celery ``schedule``."""
        value = _schedule_value(name, every, crontab, schedule)
        spec = entry_spec(
            name,
            {
                "task": task,
                "schedule": value,
                "args": args,
                "kwargs": kwargs or {},
                "options": options or {},
                "enabled": enabled,
                "catch_up": catch_up,
                "catch_up_limit": catch_up_limit,
            },
        )
        if check_task:
            self._check_task(name, task)
        row = self._entries.add(dict(spec.columns(), source="runtime"))
        return self._entry_dict(row)

    def update_schedule(
        self,
        name: str,
        *,
        task: str | None = None,
        every: float | timedelta | None = None,
        crontab: str | None = None,
        schedule: Any = None,
        args: Any = _UNSET,
        kwargs: Any = _UNSET,
        options: Any = _UNSET,
        catch_up: str | None = None,
        catch_up_limit: int | None = None,
        check_task: bool = True,
    ) -> dict[str, Any]:
        """Change an entry's fields; a new schedule is planned again from now."""
        row = self._entries.require(name)
        merged: dict[str, Any] = {
            "task": task or row.task,
            "schedule": from_spec(name, row.schedule),
            "args": loads(row.args) if args is _UNSET else args,
            "kwargs": loads(row.kwargs) if kwargs is _UNSET else kwargs,
            "options": loads(row.options) if options is _UNSET else options,
            "enabled": row.enabled,
            "catch_up": catch_up or row.catch_up,
            "catch_up_limit": row.catch_up_limit if catch_up_limit is None else catch_up_limit,
        }
        rescheduled = any(v is not None for v in (every, crontab, schedule))
        if rescheduled:
            merged["schedule"] = _schedule_value(name, every, crontab, schedule)
        spec = entry_spec(name, merged)
        if check_task and task is not None:
            self._check_task(name, task)
        columns = spec.columns()
        columns.pop("name")
        changed = {k: v for k, v in columns.items() if v != getattr(row, k)}
        if not changed:
            return self._entry_dict(row)
        return self._entry_dict(self._entries.revise(name, changed, replan="schedule" in changed))

    def enable_schedule(self, name: str) -> dict[str, Any]:
        """Enable an entry; its next slot is the first after now (none is caught up)."""
        row = self._entries.revise(name, {"enabled": True}, replan=True, kind="enabled")
        return self._entry_dict(row)

    def disable_schedule(self, name: str) -> dict[str, Any]:
        row = self._entries.revise(name, {"enabled": False}, kind="disabled")
        return self._entry_dict(row)

    def remove_schedule(self, name: str) -> None:
        self._entries.remove(name)

    def run_schedule(self, name: str) -> None:
        """Ask the leader to send the entry's task at its next tick (its slots unchanged)."""
        self._entries.request_run(name)
