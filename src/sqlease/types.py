"""The values the lease store takes and returns: deliveries, messages, tasks, events.

Plain frozen data with no behaviour beyond a derived field, so every layer (the store, the
Kombu adapter, the result backend, Admin) can share them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


@dataclass(frozen=True, order=True)
class Fence:
    """The identity of one delivery: only its holder may write to the message."""

    message_id: int
    owner: str
    attempt: int


@dataclass(frozen=True)
class Message:
    """A snapshot of one message row."""

    id: int
    queue: str
    payload: str
    priority: int
    available_at_ms: int
    created_at_ms: int
    run_id: str | None
    task_id: str | None
    state: str
    reason: str | None
    lease_owner: str | None
    lease_expires_at_ms: int | None
    attempt: int
    max_attempts: int
    last_error: str | None = None

    @property
    def fence(self) -> Fence:
        if self.lease_owner is None:
            raise ValueError(f"message {self.id} is not leased")
        return Fence(self.id, self.lease_owner, self.attempt)


@dataclass(frozen=True)
class NewMessage:
    """What ``enqueue_many`` takes: one message to add."""

    queue: str
    payload: str
    priority: int = 0
    delay_ms: int = 0
    run_id: str | None = None
    task_id: str | None = None
    max_attempts: int | None = None
    record: bool = True
    #: The Celery task name: kept in the task row (``Admin.tasks`` shows it); per-task
    #: limits are looked up by it.
    task_name: str | None = None
    #: At most ``concurrency_limit`` messages of one ``concurrency_key`` hold a lease at once,
    #: across every worker; both or neither.
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    #: A unique task: while ``unique_key`` holds (``unique_scope``: ``"queued"``,
    #: ``"active"`` or ``"period"``, the last for ``unique_for_ms``), another publish of the
    #: key enqueues nothing.
    unique_key: str | None = None
    unique_scope: str | None = None
    unique_for_ms: int | None = None
    #: The Celery group the task belongs to (its ``group`` header), kept in its task row.
    group_id: str | None = None


class Outcome(StrEnum):
    """The database's answer to a fenced write (a checkpoint's compare-and-set, a result)."""

    #: written
    UPDATED = "updated"
    #: not written: the task is no longer at the expected revision
    REVISION_CONFLICT = "revision_conflict"
    #: not written: this delivery no longer holds its lease
    LEASE_LOST = "lease_lost"
    #: not written: a SUCCESS result stands, and a late duplicate must not overwrite it
    KEPT_SUCCESS = "kept_success"


@dataclass(frozen=True)
class CasResult:
    outcome: Outcome
    revision: int | None = None
    lease_expires_at_ms: int | None = None


@dataclass(frozen=True)
class TaskRecord:
    """The durable state of a task (keyed by Celery task id, stable across redeliveries)."""

    task_id: str
    state: str | None
    reason: str | None
    checkpoint: dict[str, Any]
    revision: int
    run_id: str | None
    created_at_ms: int
    updated_at_ms: int


@dataclass(frozen=True)
class Event:
    id: int
    task_id: str | None
    message_id: int | None
    attempt: int | None
    kind: str
    data: Any
    at_ms: int
