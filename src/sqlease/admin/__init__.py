"""``sqlease.Admin``: see and steer the durable state (the ``sqlease`` command uses it).

Task states are derived from the store, and agree with Celery's result states where both
exist: ``queued`` (PENDING), ``scheduled`` (an eta/countdown not yet due), ``running`` (leased),
``waiting_input`` / ``waiting_approval`` / ``paused`` (parked: no lease, no worker held),
``succeeded`` (SUCCESS), ``failed`` (FAILURE, or dead: ``attempts_exhausted``, ``rejected``,
``undecodable``), ``cancelled`` (REVOKED).

Admin writes are single short transactions. Pausing or cancelling a running task takes its
lease away: the worker finds out at its next heartbeat or fenced write, gets ``LeaseLost`` and
stops without a failure being recorded; its late result and ack are refused.
"""

from __future__ import annotations

from typing import Any, NoReturn

from sqlalchemy.engine import URL

from sqlease._core.base import delegate
from sqlease._core.control import Control
from sqlease._core.results import ResultStore
from sqlease._core.steps import StepStore
from sqlease.admin._flow import FlowAdmin
from sqlease.admin._reads import TASK_STATES, TaskReads, TaskSnapshot, state_of
from sqlease.admin._stats import StatsAdmin
from sqlease.errors import InvalidAnswer, InvalidTransition, UnknownTask
from sqlease.schedules._admin import ScheduleAdmin
from sqlease.store import Store
from sqlease.urls import strip_prefix

__all__ = ["TASK_STATES", "Admin", "TaskSnapshot"]


class Admin:
    """Inspect and steer sqlease tasks in one database (the broker URL, with or without the
    ``sqlease+`` prefix).

    Built from parts (task reads, statistics, flow control, periodic tasks), each given the
    store; the steering here delegates to ``sqlease._core.control``."""

    def __init__(
        self, url: str | URL, *, table_prefix: str = "sqlease_", store: Store | None = None
    ) -> None:
        if store is None:
            raw = strip_prefix(url) if isinstance(url, str) else url
            store = Store(raw, table_prefix=table_prefix, auto_migrate=False)
        self.store = store
        self.results = ResultStore(store)
        self.steps = StepStore(store)
        self.control = Control(store, self.results)
        self.t = store.tables
        self.reads = TaskReads(store, self.steps)
        self.statistics = StatsAdmin(store)
        self.flow = FlowAdmin(store)
        self.schedules = ScheduleAdmin(store, self.reads.task)

    def _now(self) -> int:
        return self.store.now_ms()

    # ---- reading -----------------------------------------------------------------------
    task = delegate("reads", TaskReads.task)
    tasks = delegate("reads", TaskReads.tasks)
    overview = delegate("statistics", StatsAdmin.overview)
    stats = delegate("statistics", StatsAdmin.stats)
    leases = delegate("statistics", StatsAdmin.leases)
    event_totals = delegate("statistics", StatsAdmin.event_totals)
    # ---- flow control --------------------------------------------------------------------
    limits = delegate("flow", FlowAdmin.limits)
    set_limits = delegate("flow", FlowAdmin.set_limits)
    remove_limit = delegate("flow", FlowAdmin.remove_limit)
    rate_limits = delegate("flow", FlowAdmin.rate_limits)
    set_rate_limits = delegate("flow", FlowAdmin.set_rate_limits)
    unique = delegate("flow", FlowAdmin.unique)
    original_of = delegate("flow", FlowAdmin.original_of)
    group = delegate("flow", FlowAdmin.group)
    gates = delegate("flow", FlowAdmin.gates)
    # ---- periodic tasks --------------------------------------------------------------------
    list_schedules = delegate("schedules", ScheduleAdmin.list_schedules)
    get_schedule = delegate("schedules", ScheduleAdmin.get_schedule)
    beat_leader = delegate("schedules", ScheduleAdmin.beat_leader)
    add_schedule = delegate("schedules", ScheduleAdmin.add_schedule)
    update_schedule = delegate("schedules", ScheduleAdmin.update_schedule)
    enable_schedule = delegate("schedules", ScheduleAdmin.enable_schedule)
    disable_schedule = delegate("schedules", ScheduleAdmin.disable_schedule)
    remove_schedule = delegate("schedules", ScheduleAdmin.remove_schedule)
    run_schedule = delegate("schedules", ScheduleAdmin.run_schedule)

    # ---- steering --------------------------------------------------------------------

    def pause(self, task_id: str | None = None, *, run_id: str | None = None) -> int:
        """Hold queued tasks and take the lease from running ones; they keep their checkpoint
        and continue from it after ``resume``."""
        changed = self.control.pause(task_id, run_id=run_id)
        if task_id is not None and not changed:
            self._explain(task_id, "pause", "it is not queued, scheduled or running")
        return len(changed)

    def resume(self, task_id: str | None = None, *, run_id: str | None = None) -> int:
        """Make paused tasks claimable again (with a fresh attempt budget)."""
        changed = self.control.resume(task_id, run_id=run_id)
        if task_id is not None and not changed:
            self._explain(task_id, "resume", "it is not paused")
        return len(changed)

    def cancel(
        self,
        task_id: str | None = None,
        *,
        run_id: str | None = None,
        reason: str = "cancelled",
        leave_held: bool = False,
    ) -> int:
        """Cancel for good: the task will not run (again); a running one loses its lease.
        Its Celery result becomes REVOKED.

        ``leave_held``: a message under a live lease (running or prefetched) is left to its
        worker, and a task that has only such a message is not an error (0 is returned), as
        Celery's revoke does (``sqlease.revokes``)."""
        changed = self.control.cancel(task_id, run_id=run_id, reason=reason, leave_held=leave_held)
        if task_id is not None and not changed and not leave_held:
            self._explain(task_id, "cancel", "it has already finished or was cancelled")
        return len(changed)

    def requeue(self, task_id: str, *, max_attempts: int | None = None) -> bool:
        """Make a failed, exhausted, cancelled or parked task claimable again with a fresh
        attempt budget; its history is kept."""
        with self.store.driver.reading() as conn:
            message = self.reads.current_message(conn, task_id)
        if message is None:
            raise UnknownTask(
                f"no message for task {task_id!r} (finished tasks leave no message to requeue)"
            )
        if not self.store.requeue(message.id, max_attempts=max_attempts):
            raise InvalidTransition(
                f"task {task_id} is {state_of(message, self._now())}; only failed, cancelled, "
                "paused or waiting tasks can be requeued"
            )
        return True

    def purge(self, queue: str) -> int:
        """Delete the queue's undelivered tasks (running ones are left alone)."""
        return self.store.purge(queue)

    # ---- answers -----------------------------------------------------------------------

    def provide_input(self, task_id: str, data: Any) -> None:
        """Answer a task waiting in ``wait_for_input``: validated against its schema."""
        self._answer(task_id, "input", data)

    def approve(self, task_id: str, note: str | None = None) -> None:
        self._answer(task_id, "approval", {"approved": True, "note": note})

    def reject(self, task_id: str, reason: str) -> None:
        if not reason:
            raise InvalidAnswer("a rejection needs a reason")
        self._answer(task_id, "approval", {"approved": False, "reason": reason})

    def _answer(self, task_id: str, kind: str, data: Any) -> None:
        if not self.control.answer(task_id, kind, data):
            self._explain(task_id, "answer", "it is not waiting for a person")

    def _explain(self, task_id: str, verb: str, why: str) -> NoReturn:
        try:
            snapshot = self.task(task_id)
        except UnknownTask:
            raise UnknownTask(f"no task {task_id!r} in this database") from None
        raise InvalidTransition(f"cannot {verb} task {task_id}: {why} (it is {snapshot.state})")
