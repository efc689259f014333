"""What a fire sends: its task id, derived from the slot, and the ``apply_async`` call the
entry's definition makes (the one-by-one send makes it; ``sqlease.beat._prebuild`` makes it
ahead of the slot)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlease._core.schedules import EntryRow
from sqlease.schedules._specs import loads

if TYPE_CHECKING:
    from celery import Celery

#: Task ids of fires are derived from (table prefix, entry, slot) in this namespace, so the
#: id of a slot's task is known before it is sent, and the same wherever it is computed.
TASK_ID_NAMESPACE = uuid.UUID("6c1b9d2e-8f0a-4d39-9a57-5e2f1c3b7a40")


def slot_task_id(prefix: str, name: str, slot_ms: int, *, manual: bool = False) -> str:
    """The task id of an entry's slot (``manual``: a run-now request made at ``slot_ms``)."""
    kind = "manual" if manual else "slot"
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{prefix}\x00{name}\x00{kind}\x00{slot_ms}"))


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def task_call(
    app: Celery, entry: EntryRow, task_id: str, slot: int
) -> tuple[Any, tuple[Any, ...] | list[Any], dict[str, Any], dict[str, Any]]:
    """What sending the entry's slot calls: its task (None: sent by name), args, kwargs, and
    the options of ``apply_async`` (the entry's, with the slot's task id and headers)."""
    args, kwargs, options = loads(entry.args), loads(entry.kwargs), loads(entry.options)
    headers = dict(options.pop("headers", None) or {})
    headers.setdefault("celery_beat_task", True)  # as Celery's own scheduler marks them
    headers["sqlease_schedule"] = entry.name
    headers["sqlease_slot"] = iso(slot)
    options.pop("task_id", None)
    options.update(task_id=task_id, headers=headers)
    return app.tasks.get(entry.task), args, kwargs, options
