"""Rows to values: the message and event shapes the statements return (the drivers decode
their rows with these)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Row

from sqlease.types import Message


def expand_event_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Raw ``events`` rows, each PostgreSQL batch row (the ``claimed`` or ``acked`` events
    of one statement, see ``docs/explanation/leases.md``) expanded into one row per listed message,
    as ``Store.events`` returns them. For tools and tests that read the table directly."""
    out: list[dict[str, Any]] = []
    for row in rows:
        if row.get("task_ids") is None:
            out.append(dict(row))
            continue
        for task_id, message_id, attempt in zip(
            row["task_ids"], row["message_ids"], row["attempts"], strict=True
        ):
            out.append({**row, "task_id": task_id, "message_id": message_id, "attempt": attempt})
    return out


def row_to_message(row: Row[Any]) -> Message:
    # By name only when selected (RowMapping.get on a missing key raises inside).
    return message_from(row._mapping, has_last_error="last_error" in row._fields)


def message_from(mapping: Mapping[Any, Any], *, has_last_error: bool) -> Message:
    return Message(
        id=int(mapping["id"]),
        queue=mapping["queue"],
        payload=mapping["payload"],
        priority=int(mapping["priority"]),
        available_at_ms=int(mapping["available_at_ms"]),
        created_at_ms=int(mapping["created_at_ms"]),
        run_id=mapping["run_id"],
        task_id=mapping["task_id"],
        state=mapping["state"],
        reason=mapping["reason"],
        lease_owner=mapping["lease_owner"],
        lease_expires_at_ms=(
            None if mapping["lease_expires_at_ms"] is None else int(mapping["lease_expires_at_ms"])
        ),
        attempt=int(mapping["attempt"]),
        max_attempts=int(mapping["max_attempts"]),
        last_error=mapping["last_error"] if has_last_error else None,
    )


# ---- the rows of the drivers' statements, as dicts --------------------------------------


def messages_of(rows: list[dict[str, Any]]) -> list[Message]:
    return [message_from(r, has_last_error="last_error" in r) for r in rows]


def ids_of(rows: list[dict[str, Any]]) -> set[int]:
    return {int(row["id"]) for row in rows}


def due_of(rows: list[dict[str, Any]]) -> int | None:
    """The ``due`` column of an offer statement: milliseconds until the next delayed message."""
    due = rows[0]["due"] if rows else None
    return None if due is None else max(0, int(due))


def db_now_of(rows: list[dict[str, Any]]) -> int | None:
    """The ``now_ms`` column of an offer statement: the database's time it ran at."""
    now = rows[0].get("now_ms") if rows else None
    return None if now is None else int(now)


def acked_ids_of(rows: list[dict[str, Any]]) -> set[int]:
    """The ``acked_ids`` array of a combined statement's first row."""
    return {int(i) for i in (rows[0]["acked_ids"] or [])} if rows else set()


def expiries_of(rows: list[dict[str, Any]]) -> dict[int, int]:
    return {int(r["id"]): int(r["lease_expires_at_ms"]) for r in rows}
