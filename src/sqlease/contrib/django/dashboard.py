"""The dashboard (``sqlease ui``) served by the Django project, behind Django's sign-in.

``path("sqlease/", include("sqlease.contrib.django.urls"))`` serves every page of the
dashboard (overview, tasks, a task's timeline, runs, failed, waiting, paused, schedules) and
its actions under that prefix, over ``SQLEASE_DATABASE`` and ``SQLEASE_TABLE_PREFIX``:

- a visitor who is not signed in is sent to ``settings.LOGIN_URL`` (``login_required``); a
  signed-in user who is not staff (``is_staff``) gets 403;
- every POST passes Django's CSRF check (``csrf_protect``, whether or not the project uses
  ``CsrfViewMiddleware``), and its forms carry Django's token;
- each action is the dashboard's own: one ``sqlease.Admin`` verb, which writes the same
  timeline event as ``sqlease pause``/``cancel``/… and the standalone dashboard.

One view forwards the request to the dashboard's ASGI app (``sqlease.ui``), built once per
database, prefix and mount point, told by the request's ASGI scope that Django signed the
user in and checked the CSRF token (``sqlease.ui._auth.HOST_KEY``, which no client can set).
The pages are therefore the standalone dashboard's, not a second copy to keep in step.
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import urlencode

from asgiref.sync import async_to_sync
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, RawPostDataException
from django.middleware.csrf import get_token
from django.views.decorators.csrf import csrf_protect

from sqlease.contrib.django.conf import (
    dashboard_options,
    sqlease_database,
    table_prefix,
    url_of_alias,
)

#: Dashboards built so far, by (database URL, table prefix, mount point, options).
_apps: dict[tuple[Any, ...], Any] = {}
_apps_lock = threading.Lock()
#: What Django's forms call their CSRF field (``django.middleware.csrf``).
DJANGO_CSRF_FIELD = "csrfmiddlewaretoken"


def _app_for(root: str) -> Any:
    from sqlease.admin import Admin
    from sqlease.ui._app import build

    url = url_of_alias(sqlease_database())
    prefix = table_prefix()
    options = dashboard_options()
    key = (url.render_as_string(hide_password=False), prefix, root, tuple(sorted(options.items())))
    with _apps_lock:
        app = _apps.get(key)
        if app is None:
            app = build(
                Admin(url, table_prefix=prefix),
                token=None,
                root_path=root,
                host_auth=True,
                **options,
            )
            _apps[key] = app
    return app


FORM = "application/x-www-form-urlencoded"


def _body(request: HttpRequest) -> tuple[bytes, str | None]:
    """The request's body, and the content type to say it has if it was re-encoded."""
    try:
        return request.body, None
    except RawPostDataException:  # a multipart form Django's CSRF check already streamed in
        return urlencode(list(request.POST.lists()), doseq=True).encode(), FORM


def _scope(request: HttpRequest, path: str, host: Any, content_type: str | None) -> dict[str, Any]:
    headers = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in request.headers.items()
        if not (content_type and name.lower() in ("content-type", "content-length"))
    ]
    if content_type:
        headers.append((b"content-type", content_type.encode("latin-1")))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": request.scheme,
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": request.META.get("QUERY_STRING", "").encode("latin-1"),
        "headers": headers,
        "client": (request.META.get("REMOTE_ADDR") or "127.0.0.1", 0),
        "server": (request.get_host().rpartition(":")[0] or request.get_host(), 0),
        "state": {},
        "sqlease.host": host,
    }


def _forward(app: Any, scope: dict[str, Any], body: bytes) -> HttpResponse:
    """Run one request through the ASGI app and make its answer Django's."""
    sent: dict[str, Any] = {"status": 500, "headers": [], "body": []}
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if delivered:
            return {"type": "http.disconnect"}
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            sent["status"] = message["status"]
            sent["headers"] = message.get("headers", [])
        elif message["type"] == "http.response.body":
            sent["body"].append(message.get("body", b""))

    async_to_sync(app)(scope, receive, send)
    response = HttpResponse(b"".join(sent["body"]), status=sent["status"])
    for name, value in sent["headers"]:
        header = name.decode("latin-1")
        if header.lower() not in ("content-length", "set-cookie"):
            response[header] = value.decode("latin-1")
    return response


@csrf_protect
def dashboard(request: HttpRequest, path: str = "") -> HttpResponse:
    """Every page and action of the dashboard, for staff who are signed in."""
    # Imported here: Django's auth models load only once the project's apps are ready.
    from django.contrib.auth.views import redirect_to_login

    user = request.user
    if not user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    if not (user.is_active and user.is_staff):
        raise PermissionDenied("the sqlease dashboard is for staff users")
    from sqlease.ui._auth import HostAuth

    # The mount point: the request's path without the part this view was given.
    full = request.path
    root = full[: len(full) - len(path)].rstrip("/") if path else full.rstrip("/")
    host = HostAuth(user=user.get_username(), csrf_field=DJANGO_CSRF_FIELD, csrf=get_token(request))
    body, content_type = _body(request)
    scope = _scope(request, f"{root}/{path}", host, content_type)
    return _forward(_app_for(root), scope, body)
