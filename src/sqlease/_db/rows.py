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


class Claimed(list[Message]):
    """A claim's messages. ``held_ahead``: the claim stopped in front of a message whose run,
    gate or rate it does not judge (PostgreSQL's claim of plain messages,
    sqlease._db.postgresql.plain_claims): there may be more to claim at once."""

    held_ahead: bool

    def __init__(self, messages: Iterable[Message] = (), *, held_ahead: bool = False) -> None:
        super().__init__(messages)
        self.held_ahead = held_ahead


def held_ahead(found: list[Message]) -> bool:
    """Whether a claim's answer stopped in front of a held message (``Claimed``)."""
    return bool(getattr(found, "held_ahead", False))


def plain_claimed(rows: list[dict[str, Any]]) -> Claimed:
    """A claim of plain messages: its rows (one of NULLs when none) and ``held_ahead``."""
    return Claimed(
        messages_of([r for r in rows if r["id"] is not None]),
        held_ahead=bool(rows and rows[0]["held_ahead"]),
    )


def ids_of(rows: list[dict[str, Any]]) -> set[int]:
    return {int(row["id"]) for row in rows}


class Acked(set[int]):
    """The ids an ack (or a transition) changed, and ``owed_runs``: runs whose next message
    its statement could not make ready, because an enqueue into them committed after the
    statement's snapshot was taken (sqlease._db.postgresql.held); the caller promotes them
    (``Store.promote_runs``)."""

    owed_runs: tuple[str, ...]
    #: The gates whose places the statement freed (PostgreSQL), whose parked messages the
    #: caller makes ready (``Store.promote_gates``, sqlease._db.postgresql.gates).
    owed_gates: tuple[str, ...]

    def __init__(self, ids: Any = (), owed_runs: Any = (), owed_gates: Any = ()) -> None:
        super().__init__(ids)
        self.owed_runs = tuple(owed_runs or ())
        self.owed_gates = tuple(owed_gates or ())


def owed_of(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The ``owed_runs`` array of a statement's first row (none: no column, or NULL)."""
    return tuple(rows[0].get("owed_runs") or ()) if rows else ()


def gates_of(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The ``owed_gates`` array of a statement's first row (none: no column, or NULL)."""
    return tuple(rows[0].get("owed_gates") or ()) if rows else ()


def acked_of(rows: list[dict[str, Any]]) -> Acked:
    """One row per id changed (a NULL id when none was), each with the ``owed_runs``."""
    return Acked((int(r["id"]) for r in rows if r["id"] is not None), owed_of(rows), gates_of(rows))


def due_of(rows: list[dict[str, Any]]) -> int | None:
    """The ``due`` column of an offer statement: milliseconds until the next delayed message."""
    due = rows[0]["due"] if rows else None
    return None if due is None else max(0, int(due))


def db_now_of(rows: list[dict[str, Any]]) -> int | None:
    """The ``now_ms`` column of an offer statement: the database's time it ran at."""
    now = rows[0].get("now_ms") if rows else None
    return None if now is None else int(now)


def acked_ids_of(rows: list[dict[str, Any]]) -> Acked:
    """The ``acked_ids`` array of a combined statement's first row (and its owed runs)."""
    if not rows:
        return Acked()
    return Acked((int(i) for i in (rows[0]["acked_ids"] or [])), owed_of(rows), gates_of(rows))


def expiries_of(rows: list[dict[str, Any]]) -> dict[int, int]:
    return {int(r["id"]): int(r["lease_expires_at_ms"]) for r in rows}
