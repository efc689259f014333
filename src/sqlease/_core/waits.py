"""Tasks that wait for a person: ``ctx.wait_for_input()`` and ``ctx.wait_for_approval()``.

Waiting parks the delivery: in one fenced transaction the wait is recorded, the lease is
released and the message leaves circulation (state ``waiting_input`` / ``waiting_approval``),
so a waiting task holds no worker and no lease. The task stops with ``WaitingForPerson`` (a
Celery ``Ignore``: nothing is recorded as failed). ``Admin.provide_input`` / ``approve`` /
``reject`` store the answer and make the message claimable again; the next delivery runs the
task from its checkpoint and the same ``wait_for_…`` call returns the answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, select

from sqlease._core.names import check_id
from sqlease.errors import ConfigurationError, InvalidAnswer, LeaseLost, WaitingForPerson

if TYPE_CHECKING:
    from sqlease._core.store import Store
    from sqlease.types import Fence

KINDS = {"input": "waiting_input", "approval": "waiting_approval"}


def validate(data: Any, schema: Mapping[str, Any] | None, path: str = "$") -> None:
    """Check ``data`` against a small JSON-Schema subset: type, enum, required, properties,
    items. Raises ``InvalidAnswer`` naming the first mismatch."""
    if not schema:
        return
    types: dict[str, type | tuple[type, ...]] = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "null": type(None),
        "integer": int,
        "number": (int, float),
    }
    expected = schema.get("type")
    if expected is not None:
        names = expected if isinstance(expected, list) else [expected]
        ok = False
        for name in names:
            kind = types.get(name)
            if kind is None:
                raise InvalidAnswer(f"unknown type {name!r} in the task's schema at {path}")
            if isinstance(data, kind) and not (
                name in ("integer", "number") and isinstance(data, bool)
            ):
                ok = True
        if not ok:
            raise InvalidAnswer(f"{path} must be {' or '.join(names)}, not {type(data).__name__}")
    if "enum" in schema and data not in schema["enum"]:
        raise InvalidAnswer(f"{path} must be one of {schema['enum']!r}, not {data!r}")
    if isinstance(data, dict):
        for name in schema.get("required", []):
            if name not in data:
                raise InvalidAnswer(f"{path}.{name} is required")
        for name, sub in (schema.get("properties") or {}).items():
            if name in data:
                validate(data[name], sub, f"{path}.{name}")
    if isinstance(data, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(data):
            validate(item, schema["items"], f"{path}[{i}]")


def _answer(store: Store, task_id: str, key: str) -> tuple[str, Any] | None:
    waits = store.tables.waits
    with store.driver.reading() as conn:
        row = conn.execute(
            select(waits.c.status, waits.c.answer).where(
                waits.c.task_id == task_id, waits.c.key == key
            )
        ).first()
    if row is None:
        return None
    return row.status, None if row.answer is None else json.loads(row.answer)


def _wait(
    store: Store, fence: Fence, task_id: str, kind: str, key: str, request: dict[str, Any]
) -> Any:
    try:
        check_id("wait key", key)  # the key of its row: PostgreSQL's index entries are bounded
    except ConfigurationError as error:
        raise ConfigurationError(f"{error} (the prompt or summary, unless key= is given)") from None
    found = _answer(store, task_id, key)
    if found is not None and found[0] == "answered":
        return found[1]
    waits = store.tables.waits
    insert = store.driver.insert
    now = store.now_ms()
    stmt = (
        insert(waits)
        .values(
            task_id=task_id,
            key=key,
            kind=kind,
            request=json.dumps(request),
            status="waiting",
            created_at_ms=now,
        )
        .on_conflict_do_nothing(index_elements=[waits.c.task_id, waits.c.key])
    )

    def record(conn: Connection) -> None:
        conn.execute(stmt)

    parked = store.park(fence, KINDS[kind], data={"key": key, **request}, also=record)
    if not parked:
        raise LeaseLost(fence.message_id, fence.attempt, "could not park the task")
    raise WaitingForPerson(task_id, kind, key)


def wait_for_input(
    store: Store,
    fence: Fence,
    task_id: str,
    prompt: str,
    *,
    schema: Mapping[str, Any] | None = None,
    key: str | None = None,
) -> Any:
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("wait_for_input needs a prompt")
    request = {"prompt": prompt, "schema": dict(schema) if schema else None}
    return _wait(store, fence, task_id, "input", key or prompt, request)


def wait_for_approval(
    store: Store,
    fence: Fence,
    task_id: str,
    summary: str,
    *,
    key: str | None = None,
    **details: Any,
) -> dict[str, Any]:
    if not isinstance(summary, str) or not summary:
        raise ValueError("wait_for_approval needs a summary")
    try:
        json.dumps(details)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"approval details must be JSON-serializable: {exc}") from exc
    request = {"summary": summary, "details": details}
    answer: dict[str, Any] = _wait(store, fence, task_id, "approval", key or summary, request)
    return answer
