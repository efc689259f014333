"""The rows of the dashboard's task list: with no state filter every recent task, finished
ones included, from the task records (keyset pages on their creation time, as ``sqlease
tasks`` lists them); and the page of succeeded tasks (which have no message left, so they come
from their results and task rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlease.admin import Admin, TaskSnapshot


@dataclass
class TaskRow:
    """One line of the tasks list."""

    task_id: str
    message_id: int
    state: str
    reason: str | None
    queue: str
    name: str | None
    run_id: str | None
    attempt: int
    max_attempts: int
    priority: int
    created_at_ms: int
    available_at_ms: int
    lease_owner: str | None
    lease_expires_at_ms: int | None
    last_error: str | None


@dataclass
class TaskPage:
    rows: list[TaskRow]
    #: The ``before`` of the next (older) page, None on the last one: a message id on a
    #: page filtered by state, a ``CREATED_MS:TASK_ID`` cursor on the list of task records.
    next_before: int | str | None


def recent_page(
    admin: Admin,
    *,
    queue: str | None,
    name: str | None,
    run_id: str | None,
    since_ms: int | None,
    until_ms: int | None,
    search: str | None,
    before: str | None,
    limit: int,
) -> TaskPage:
    """Every recent task newest first, whatever its state, from the task records: a keyset
    page after the cursor ``before`` (``Admin.tasks`` with no filter, plus the filters the
    task record can answer)."""
    if not 1 <= limit <= 500:
        raise ValueError(f"limit must be 1 to 500, not {limit}")
    found = admin.reads.recent(
        limit + 1,
        before,
        queue=queue,
        name=name,
        run_id=run_id,
        task_id=search,
        since_ms=since_ms,
        until_ms=until_ms,
    )
    more = len(found) > limit
    rows = [_row_of(snap) for snap in found[:limit]]
    last = rows[-1] if rows else None
    return TaskPage(rows, f"{last.created_at_ms}:{last.task_id}" if more and last else None)


def _row_of(snap: TaskSnapshot) -> TaskRow:
    created = snap.created_at_ms or 0
    return TaskRow(
        task_id=snap.task_id,
        message_id=snap.message_id or 0,
        state=snap.state,
        reason=snap.reason,
        queue=snap.queue or "",
        name=snap.task_name,
        run_id=snap.run_id,
        attempt=snap.attempt,
        max_attempts=snap.max_attempts or snap.attempt,
        priority=snap.priority or 0,
        created_at_ms=created,
        available_at_ms=snap.available_at_ms or created,
        lease_owner=snap.lease_owner,
        lease_expires_at_ms=snap.lease_expires_at_ms,
        last_error=snap.last_error,
    )


def succeeded_page(
    admin: Admin,
    *,
    queue: str | None,
    name: str | None,
    run_id: str | None,
    search: str | None,
    limit: int,
) -> TaskPage:
    """Succeeded tasks leave no message (the ack deletes it): the newest ``limit`` from
    their results and task rows, as ``Admin.tasks(state="succeeded")`` lists them (one
    page)."""
    if not 1 <= limit <= 500:
        raise ValueError(f"limit must be 1 to 500, not {limit}")
    rows = []
    for snap in admin.tasks(state="succeeded", queue=queue or None, limit=limit):
        if (name and snap.task_name != name) or (run_id and snap.run_id != run_id):
            continue
        if search and snap.task_id != search:
            continue
        rows.append(_row_of(snap))
    return TaskPage(rows, None)
