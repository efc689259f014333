"""The rows of the dashboard's task list, and its page of succeeded tasks (which have no
message left, so they come from their results and task rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlease.admin import Admin


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
    #: The ``before`` of the next (older) page, None on the last one.
    next_before: int | None


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
        created = snap.created_at_ms or 0
        rows.append(
            TaskRow(
                task_id=snap.task_id,
                message_id=snap.message_id or 0,
                state="succeeded",
                reason=None,
                queue=snap.queue or "",
                name=snap.task_name,
                run_id=snap.run_id,
                attempt=snap.attempt,
                max_attempts=snap.max_attempts or snap.attempt,
                priority=snap.priority or 0,
                created_at_ms=created,
                available_at_ms=created,
                lease_owner=None,
                lease_expires_at_ms=None,
                last_error=None,
            )
        )
    return TaskPage(rows, None)
