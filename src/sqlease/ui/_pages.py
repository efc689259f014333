"""The dashboard's pages and their live fragments (GET only; actions are in ``_actions``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from sqlease.admin import TASK_STATES
from sqlease.errors import UnknownTask
from sqlease.ui._context import Ui
from sqlease.ui._read.history import checkpoint_diffs, host_of, lease_history, parse_payload
from sqlease.ui._read.views import AdminViews

LIST_STATES = (*TASK_STATES, "waiting")
#: Seconds one overview read serves every page that asks (its fragment polls every 5 s).
OVERVIEW_SHARED_S = 2.0


def _time_param(value: str | None, what: str) -> int | None:
    """A time filter: ISO 8601 (local if no offset is given) or epoch milliseconds."""
    if not value:
        return None
    if value.isdigit():
        return int(value)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"{what} {value!r} is not a time: use ISO 8601 (2026-01-31T12:00) or epoch ms"
        ) from None
    return int(moment.timestamp() * 1000)


def _is_cursor(value: str) -> bool:
    created, _, task_id = value.partition(":")
    return created.isdigit() and bool(task_id)


def _filters(request: Request) -> dict[str, Any]:
    q = request.query_params
    return {
        "state": q.get("state") or None,
        "queue": q.get("queue") or None,
        "name": q.get("name") or None,
        "run_id": q.get("run_id") or None,
        "since": q.get("since") or None,
        "until": q.get("until") or None,
        "q": (q.get("q") or "").strip() or None,
    }


async def overview(ui: Ui, request: Request, fragment: bool = False) -> Response:
    views = ui.views

    def read() -> dict[str, Any]:
        return {
            "queues": views.overview(),
            "workers": views.workers(),
            "throughput": views.throughput(),
            "now_ms": views.now(),
            "lease_s": ui.lease_seconds,
        }

    data = await run_in_threadpool(ui.shared, "overview", OVERVIEW_SHARED_S, read)
    name = "_overview.html" if fragment else "overview.html"
    return ui.render(request, name, data)


async def tasks(ui: Ui, request: Request, fragment: bool = False) -> Response:
    filters = _filters(request)
    before = request.query_params.get("before")
    error = None
    page = None
    if filters["state"] not in (None, *LIST_STATES):
        error = f"unknown state {filters['state']!r}; one of {', '.join(LIST_STATES)}"
    elif filters["state"] is not None and before is not None and not before.isdigit():
        error = f"before must be a message id, not {before!r}"
    elif filters["state"] is None and before is not None and not _is_cursor(before):
        error = f"before must be a page cursor (CREATED_MS:TASK_ID), not {before!r}"
    else:
        try:
            since = _time_param(filters["since"], "since")
            until = _time_param(filters["until"], "until")
        except ValueError as exc:
            error = str(exc)
    if error is None:
        views = ui.views
        # A state's list pages by message id, the list of every task by a record cursor.
        cursor = int(before) if before is not None and filters["state"] else before
        page = await run_in_threadpool(
            lambda: views.task_page(
                state=filters["state"],
                queue=filters["queue"],
                name=filters["name"],
                run_id=filters["run_id"],
                since_ms=since,
                until_ms=until,
                search=filters["q"],
                before=cursor,
            )
        )
    found_elsewhere = None
    if page is not None and not page.rows and filters["q"]:
        # A finished task has no message left: the search goes to its record instead.
        found_elsewhere = await run_in_threadpool(_snapshot_or_none, ui.views, filters["q"])
    data = {
        "filters": filters,
        "page": page,
        "error": error,
        "states": LIST_STATES,
        "found_elsewhere": found_elsewhere,
        "before": before,
    }
    name = "_tasks.html" if fragment else "tasks.html"
    return ui.render(request, name, data, status=400 if error else 200)


def _snapshot_or_none(views: AdminViews, task_id: str) -> Any:
    try:
        return views.admin.task(task_id)
    except UnknownTask:
        return None


def task_detail(views: AdminViews, task_id: str, redact: bool) -> dict[str, Any] | None:
    """Everything the task page shows, or None for an unknown task."""
    try:
        snapshot = views.admin.task(task_id)
    except UnknownTask:
        return None
    message = views.message_of(task_id)
    payload = parse_payload(None if message is None else message.payload)
    result = views.result_of(task_id)
    snap = snapshot.to_dict()
    name = snap.get("task_name") or payload.name or (result or {}).get("name")
    if not snap.get("queue") and result is not None:  # acked: result_extended kept it
        snap["queue"] = result.get("queue")
    events = snap["events"]
    owners = {}
    for event in events:
        data = event.get("data")
        if event["kind"] == "claimed" and isinstance(data, dict):
            owners[event["attempt"]] = data.get("owner")
        event["owner"] = owners.get(event.get("attempt"))
        event["host"] = host_of(event["owner"])
    args: Any = payload.args
    kwargs: Any = payload.kwargs
    argsrepr, kwargsrepr = payload.argsrepr, payload.kwargsrepr
    if args is None and result is not None:  # result_extended keeps them after the ack
        args, kwargs = result.get("args"), result.get("kwargs")
    if redact:
        args = kwargs = argsrepr = kwargsrepr = None
    parent_id = payload.parent_id or (result or {}).get("parent_id")
    root_id = payload.root_id or (result or {}).get("root_id")
    group_id = payload.group_id or snap.get("group_id") or (result or {}).get("group_id")
    # A group's members by its id (their task records), and a parent's children by its
    # result (a chain's next task has no group).
    siblings = views.admin.group(group_id) if group_id else []
    if parent_id:
        siblings += _child_ids(views.result_of(parent_id))
    siblings = [s for s in dict.fromkeys(siblings) if s != task_id]
    return {
        "task": snap,
        "name": name,
        "payload": payload,
        "args": args,
        "kwargs": kwargs,
        "argsrepr": argsrepr,
        "kwargsrepr": kwargsrepr,
        "redacted": redact,
        "parent_id": parent_id if parent_id != task_id else None,
        "root_id": root_id if root_id != task_id else None,
        "group_id": group_id,
        "siblings": siblings,
        "children": _child_ids(result),
        "result": result,
        "leases": lease_history(events),
        "checkpoints": checkpoint_diffs(events),
        "message": message,
    }


def _child_ids(meta: dict[str, Any] | None) -> list[str]:
    """Task ids in a Celery result's ``children`` (each ``[[id, parent], …]`` or a group)."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list) and len(node) == 2 and isinstance(node[0], str):
            found.append(node[0])
        elif isinstance(node, list | tuple):
            for part in node:
                walk(part)

    for child in (meta or {}).get("children") or []:
        walk(child)
    return found


async def task(ui: Ui, request: Request, fragment: bool = False) -> Response:
    task_id = request.query_params.get("id", "")
    data = await run_in_threadpool(task_detail, ui.views, task_id, ui.redact_args)
    if data is None:
        original = await run_in_threadpool(ui.views.admin.original_of, task_id)
        error = (
            f"no task {task_id!r} in this database"
            if original is None
            else f"task {task_id!r} was a duplicate publish of the unique task {original!r} "
            "and was not enqueued; its result is that task's"
        )
        return ui.render(request, "error.html", {"error": error, "original": original}, status=404)
    data["done"] = request.query_params.get("done")
    name = "_task.html" if fragment else "task.html"
    return ui.render(request, name, data)


async def runs(ui: Ui, request: Request) -> Response:
    found = await run_in_threadpool(ui.views.runs)
    return ui.render(request, "runs.html", {"runs": found})


async def run(ui: Ui, request: Request, fragment: bool = False) -> Response:
    run_id = request.query_params.get("id", "")
    data = await run_in_threadpool(ui.views.run, run_id)
    return ui.render(request, "_run.html" if fragment else "run.html", data)


async def listing(ui: Ui, request: Request, kind: str, fragment: bool = False) -> Response:
    """Failed, waiting and paused tasks, each with its actions."""
    before = request.query_params.get("before")
    state = {"failed": "failed", "waiting": "waiting", "paused": "paused"}[kind]
    views = ui.views

    def read() -> Any:
        page = views.task_page(
            state=state, before=int(before) if before and before.isdigit() else None
        )
        waits = {}
        if kind == "waiting":
            for row in page.rows:
                try:
                    waits[row.task_id] = views.admin.task(row.task_id).waiting
                except UnknownTask:
                    continue
        return page, waits

    page, waits = await run_in_threadpool(read)
    data = {"page": page, "kind": kind, "waits": waits, "done": request.query_params.get("done")}
    return ui.render(request, f"_{kind}.html" if fragment else f"{kind}.html", data)


async def schedules(ui: Ui, request: Request, fragment: bool = False) -> Response:
    found = await run_in_threadpool(ui.views.admin.list_schedules)
    leader = await run_in_threadpool(ui.views.admin.beat_leader)
    data = {"schedules": found, "leader": leader, "done": request.query_params.get("done")}
    return ui.render(request, "_schedules.html" if fragment else "schedules.html", data)
