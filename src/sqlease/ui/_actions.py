"""Actions: each one a confirmation page (GET) and the POST that does it through ``Admin``.

A POST passes three checks in this order: actions are on (a token was given and the
dashboard is not read-only), the CSRF value matches, the request is authenticated. Then it
runs one ``Admin`` verb; a refused one (not waiting, already finished, an answer that does not
match its schema) shows the form again with the reason.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote, urlencode

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from sqlease.errors import (
    InvalidAnswer,
    InvalidSchedule,
    InvalidTransition,
    UnknownSchedule,
    UnknownTask,
)
from sqlease.ui._auth import CSRF_FIELD, SESSION_COOKIE
from sqlease.ui._context import Ui

TASK_ACTIONS = {
    "pause": "Pause",
    "resume": "Resume",
    "cancel": "Cancel",
    "requeue": "Requeue",
    "approve": "Approve",
    "reject": "Reject",
    "input": "Provide input",
}
SCHEDULE_ACTIONS = {"enable": "Enable", "disable": "Disable", "run": "Run now"}


def _refused(ui: Ui, request: Request, status: int, why: str) -> Response:
    return ui.render(request, "error.html", {"error": why, "login": status == 401}, status=status)


async def _checked_form(ui: Ui, request: Request) -> tuple[Any, Response | None]:
    form = await request.form()
    if not ui.guard.actions_enabled:
        return form, _refused(ui, request, 403, _off_reason(ui))
    submitted = form.get(CSRF_FIELD)
    if not ui.guard.csrf_ok(request, submitted if isinstance(submitted, str) else None):
        return form, _refused(
            ui, request, 403, "the form's CSRF check failed: reload the page and try again"
        )
    if not ui.guard.authenticated(request):
        return form, _refused(ui, request, 401, "log in with the dashboard's token to act")
    return form, None


def _off_reason(ui: Ui) -> str:
    if ui.guard.read_only:
        return "this dashboard is read-only: actions are switched off"
    return "actions are off: the dashboard was started without a token"


def _gate(ui: Ui, request: Request) -> Response | None:
    """The confirmation pages: refused when actions are off, a login first otherwise."""
    if not ui.guard.actions_enabled:
        return _refused(ui, request, 403, _off_reason(ui))
    if not ui.guard.authenticated(request):
        target = ui.url(request.url.path)
        target += "?" + request.url.query if request.url.query else ""
        return RedirectResponse(ui.url("/login?" + urlencode({"next": target})), 303)
    return None


async def confirm_task(ui: Ui, request: Request) -> Response:
    task_id = request.query_params.get("id", "")
    action = request.query_params.get("action", "")
    if action not in TASK_ACTIONS:
        return _refused(ui, request, 404, f"no action {action!r}")
    refused = _gate(ui, request)
    if refused is not None:
        return refused
    # The waiting list's forms bring what was typed there; nothing is done before the POST.
    values = {k: request.query_params.get(k, "") for k in ("note", "reason", "data")}
    return await _task_form(ui, request, task_id, action, values, None, 200)


async def _task_form(
    ui: Ui,
    request: Request,
    task_id: str,
    action: str,
    values: dict[str, str],
    error: str | None,
    status: int,
) -> Response:
    try:
        snapshot = await run_in_threadpool(ui.views.admin.task, task_id)
    except UnknownTask:
        return _refused(ui, request, 404, f"no task {task_id!r} in this database")
    data = {
        "task": snapshot.to_dict(),
        "action": action,
        "label": TASK_ACTIONS[action],
        "values": values,
        "error": error,
    }
    return ui.render(request, "confirm.html", data, status=status)


async def do_task(ui: Ui, request: Request) -> Response:
    form, refused = await _checked_form(ui, request)
    if refused is not None:
        return refused
    task_id = str(form.get("id", ""))
    action = str(form.get("action", ""))
    if action not in TASK_ACTIONS:
        return _refused(ui, request, 404, f"no action {action!r}")
    values = {k: str(form.get(k, "")) for k in ("note", "reason", "data")}
    admin = ui.views.admin

    def act() -> None:
        if action == "pause":
            admin.pause(task_id)
        elif action == "resume":
            admin.resume(task_id)
        elif action == "cancel":
            admin.cancel(task_id)
        elif action == "requeue":
            admin.requeue(task_id)
        elif action == "approve":
            admin.approve(task_id, note=values["note"] or None)
        elif action == "reject":
            admin.reject(task_id, values["reason"].strip())
        else:
            try:
                data = json.loads(values["data"])
            except ValueError as exc:
                raise InvalidAnswer(f"the input is not JSON: {exc}") from None
            admin.provide_input(task_id, data)

    try:
        await run_in_threadpool(act)
    except InvalidAnswer as exc:
        return await _task_form(ui, request, task_id, action, values, str(exc), 400)
    except InvalidTransition as exc:
        return await _task_form(ui, request, task_id, action, values, str(exc), 409)
    except UnknownTask as exc:
        return _refused(ui, request, 404, str(exc))
    return RedirectResponse(ui.url(f"/task?id={quote(task_id)}&done={action}"), 303)


async def confirm_requeue(ui: Ui, request: Request) -> Response:
    refused = _gate(ui, request)
    if refused is not None:
        return refused
    ids = [i for i in request.query_params.getlist("ids") if i]
    if not ids:
        return _refused(ui, request, 400, "choose one or more tasks to requeue")
    return ui.render(request, "confirm_many.html", {"ids": ids, "error": None})


async def do_requeue(ui: Ui, request: Request) -> Response:
    form, refused = await _checked_form(ui, request)
    if refused is not None:
        return refused
    ids = [str(i) for i in form.getlist("ids") if i]
    admin = ui.views.admin

    def act() -> list[str]:
        problems = []
        for task_id in ids:
            try:
                admin.requeue(task_id)
            except (InvalidTransition, UnknownTask) as exc:
                problems.append(str(exc))
        return problems

    problems = await run_in_threadpool(act)
    if problems:
        return ui.render(
            request, "confirm_many.html", {"ids": ids, "error": "; ".join(problems)}, status=409
        )
    return RedirectResponse(ui.url(f"/failed?done=requeued+{len(ids)}"), 303)


async def confirm_schedule(ui: Ui, request: Request) -> Response:
    name = request.query_params.get("name", "")
    action = request.query_params.get("action", "")
    if action not in SCHEDULE_ACTIONS:
        return _refused(ui, request, 404, f"no action {action!r}")
    refused = _gate(ui, request)
    if refused is not None:
        return refused
    data = {"name": name, "action": action, "label": SCHEDULE_ACTIONS[action], "error": None}
    return ui.render(request, "confirm_schedule.html", data)


async def do_schedule(ui: Ui, request: Request) -> Response:
    form, refused = await _checked_form(ui, request)
    if refused is not None:
        return refused
    name = str(form.get("name", ""))
    action = str(form.get("action", ""))
    if action not in SCHEDULE_ACTIONS:
        return _refused(ui, request, 404, f"no action {action!r}")
    admin = ui.views.admin
    verb = {
        "enable": admin.enable_schedule,
        "disable": admin.disable_schedule,
        "run": admin.run_schedule,
    }[action]
    try:
        await run_in_threadpool(verb, name)
    except (InvalidSchedule, UnknownSchedule) as exc:
        data = {"name": name, "action": action, "label": SCHEDULE_ACTIONS[action]}
        return ui.render(request, "confirm_schedule.html", {**data, "error": str(exc)}, 409)
    return RedirectResponse(ui.url(f"/schedules?done={action}+{quote(name)}"), 303)


# ---- login -------------------------------------------------------------------------


def _safe_next(ui: Ui, target: str | None) -> str:
    """Only a path of this dashboard (no other host: no open redirect)."""
    path = target or ""
    local = path.startswith("/") and not path.startswith("//")
    if local and (not ui.root or path == ui.root or path.startswith(ui.root + "/")):
        return path
    return ui.url("/")


def _host_signs_in(ui: Ui, request: Request) -> Response | None:
    """Served by a host framework, signing in and out is the host's."""
    if ui.guard.host_auth:
        return _refused(ui, request, 404, "signing in and out is the host application's")
    return None


async def login_page(ui: Ui, request: Request) -> Response:
    if (refused := _host_signs_in(ui, request)) is not None:
        return refused
    if not ui.guard.actions_enabled:
        return _refused(ui, request, 403, _off_reason(ui))
    target = _safe_next(ui, request.query_params.get("next"))
    return ui.render(request, "login.html", {"next": target, "error": None})


async def login(ui: Ui, request: Request) -> Response:
    if (refused := _host_signs_in(ui, request)) is not None:
        return refused
    form = await request.form()
    if not ui.guard.actions_enabled:
        return _refused(ui, request, 403, _off_reason(ui))
    submitted = form.get(CSRF_FIELD)
    if not ui.guard.csrf_ok(request, submitted if isinstance(submitted, str) else None):
        return _refused(ui, request, 403, "the form's CSRF check failed: reload and try again")
    target = _safe_next(ui, str(form.get("next", "")))
    if not ui.guard.token_matches(str(form.get("token", ""))):
        data = {
            "next": target,
            "error": "that token is not the one this dashboard was started with",
        }
        return ui.render(request, "login.html", data, status=401)
    response = RedirectResponse(target, 303)
    response.set_cookie(
        SESSION_COOKIE,
        ui.guard.session_value(),
        path=ui.cookie_path(),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https",
    )
    return response


async def logout(ui: Ui, request: Request) -> Response:
    if (refused := _host_signs_in(ui, request)) is not None:
        return refused
    form = await request.form()
    submitted = form.get(CSRF_FIELD)
    if not ui.guard.csrf_ok(request, submitted if isinstance(submitted, str) else None):
        return _refused(ui, request, 403, "the form's CSRF check failed: reload and try again")
    response = RedirectResponse(ui.url("/"), 303)
    response.delete_cookie(SESSION_COOKIE, path=ui.cookie_path())
    return response
