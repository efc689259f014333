"""The Starlette application: routes, the URL prefix, static files, ``/metrics``."""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from sqlalchemy.exc import DBAPIError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from sqlease.admin import Admin
from sqlease.errors import SqleaseError
from sqlease.ui import _actions, _pages
from sqlease.ui._auth import Guard
from sqlease.ui._context import Ui
from sqlease.ui._read.views import AdminViews
from sqlease.ui._render import STATIC

Handler = Callable[..., Awaitable[Response]]


def _normal_root(root_path: str) -> str:
    root = (root_path or "").strip()
    if root in ("", "/"):
        return ""
    if not root.startswith("/") or "//" in root or any(c in root for c in "?#\"'<> "):
        raise ValueError(f"root_path must be a path such as '/sqlease', not {root_path!r}")
    return root.rstrip("/")


class _Prefix:
    """Serves the app at ``root`` whether the proxy strips the prefix or passes it on."""

    def __init__(self, app: ASGIApp, root: str) -> None:
        self.app, self.root = app, root

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.root and scope["type"] in ("http", "websocket"):
            path: str = scope["path"]
            if path == self.root or path.startswith(self.root + "/"):
                scope = dict(scope, path=path[len(self.root) :] or "/")
        await self.app(scope, receive, send)


async def _metrics(ui: Ui, request: Request) -> Response:
    try:
        metrics: Any = importlib.import_module("sqlease.metrics")
    except ImportError:
        return PlainTextResponse(
            "/metrics needs sqlease.metrics (and prometheus_client), which is not installed here\n",
            status_code=404,
        )
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    body = await run_in_threadpool(lambda: generate_latest(metrics.build_registry(ui.views.admin)))
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _routes(ui: Ui) -> list[BaseRoute]:
    def page(handler: Handler, **kwargs: Any) -> Callable[[Request], Awaitable[Response]]:
        return partial(handler, ui, **kwargs)

    get = ["GET"]
    post = ["POST"]
    return [
        Route("/", page(_pages.overview), methods=get),
        Route("/fragments/overview", page(_pages.overview, fragment=True), methods=get),
        Route("/tasks", page(_pages.tasks), methods=get),
        Route("/fragments/tasks", page(_pages.tasks, fragment=True), methods=get),
        Route("/task", page(_pages.task), methods=get),
        Route("/fragments/task", page(_pages.task, fragment=True), methods=get),
        Route("/runs", page(_pages.runs), methods=get),
        Route("/run", page(_pages.run), methods=get),
        Route("/fragments/run", page(_pages.run, fragment=True), methods=get),
        *[
            r
            for kind in ("failed", "waiting", "paused")
            for r in (
                Route(f"/{kind}", page(_pages.listing, kind=kind), methods=get),
                Route(
                    f"/fragments/{kind}",
                    page(_pages.listing, kind=kind, fragment=True),
                    methods=get,
                ),
            )
        ],
        Route("/schedules", page(_pages.schedules), methods=get),
        Route("/fragments/schedules", page(_pages.schedules, fragment=True), methods=get),
        Route("/task/do", page(_actions.confirm_task), methods=get),
        Route("/task/do", page(_actions.do_task), methods=post),
        Route("/requeue", page(_actions.confirm_requeue), methods=get),
        Route("/requeue", page(_actions.do_requeue), methods=post),
        Route("/schedule/do", page(_actions.confirm_schedule), methods=get),
        Route("/schedule/do", page(_actions.do_schedule), methods=post),
        Route("/login", page(_actions.login_page), methods=get),
        Route("/login", page(_actions.login), methods=post),
        Route("/logout", page(_actions.logout), methods=post),
        Route("/metrics", page(_metrics), methods=get),
        Mount("/static", app=StaticFiles(directory=str(STATIC)), name="static"),
    ]


def build(
    admin_or_url: Admin | str,
    *,
    token: str | None,
    read_only: bool,
    root_path: str,
    redact_args: bool,
    lease_seconds: float,
    host_auth: bool = False,
) -> ASGIApp:
    """The app (``create_app``'s). ``host_auth``: served by a host framework that signs
    people in and checks CSRF itself (sqlease.ui._auth; the Django dashboard)."""
    admin = admin_or_url if isinstance(admin_or_url, Admin) else Admin(admin_or_url)
    root = _normal_root(root_path)
    ui = Ui(
        views=AdminViews(admin),
        guard=Guard(token=token or None, read_only=read_only, host_auth=host_auth),
        root=root,
        redact_args=redact_args,
        lease_seconds=lease_seconds,
    )

    async def failed(request: Request, exc: Exception) -> Response:
        # A database that is down or not migrated: say so on a page, not a bare 500.
        if isinstance(exc, DBAPIError):
            first = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
            why = f"the database did not answer: {first}"
        else:
            why = str(exc)
        return ui.render(request, "error.html", {"error": why}, status=503)

    app = Starlette(
        routes=_routes(ui), exception_handlers={SqleaseError: failed, DBAPIError: failed}
    )
    app.state.ui = ui
    if not root:
        return app
    wrapped = _Prefix(app, root)
    wrapped.state = app.state  # type: ignore[attr-defined]
    return wrapped
