"""What every page needs: the views, who may act, the URL prefix, rendering with the CSRF
cookie set when the browser has none yet."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jinja2 import Environment
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from sqlease.ui._auth import CSRF_COOKIE, Guard
from sqlease.ui._read.views import AdminViews
from sqlease.ui._render import environment


@dataclass
class Ui:
    views: AdminViews
    guard: Guard
    root: str
    redact_args: bool
    #: The lease length the workers use (seconds), to tell a last heartbeat from an expiry.
    lease_seconds: float
    env: Environment = field(default_factory=environment)
    _cache: dict[str, tuple[float, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def shared(self, key: str, seconds: float, read: Callable[[], Any]) -> Any:
        """``read()``, shared by every page asking within ``seconds`` (by the store's clock):
        the overview counts every message (about a second at 1,000,000), and each open tab
        polls it, so tabs share one count instead of each paying for its own."""
        with self._lock:
            now = self.views.now()
            found = self._cache.get(key)
            if found is not None and 0 <= now - found[0] < seconds * 1000:
                return found[1]
            value = read()
            self._cache[key] = (now, value)
            return value

    def url(self, path: str) -> str:
        """A link under the prefix the dashboard is served at."""
        return f"{self.root}{path}"

    @property
    def database(self) -> str:
        """The database URL without its password."""
        return self.views.store.engine.url.render_as_string(hide_password=True)

    def cookie_path(self) -> str:
        return self.root or "/"

    def render(
        self, request: Request, name: str, data: dict[str, Any], status: int = 200
    ) -> Response:
        csrf_field, csrf, new = self.guard.csrf(request)
        host = self.guard.host(request)
        context = {
            "root": self.root,
            "url": self.url,
            "request": request,
            "csrf": csrf,
            "csrf_field": csrf_field,
            "actions": self.guard.actions_enabled,
            "logged_in": self.guard.authenticated(request),
            # signed in by the host framework: its name, and no log-out form of ours
            "host_user": None if host is None else host.user,
            "read_only": self.guard.read_only,
            "database": self.database,
            "path": request.url.path,
            **data,
        }
        body = self.env.get_template(name).render(context)
        response = HTMLResponse(body, status_code=status)
        response.headers["cache-control"] = "no-store"
        response.headers["x-frame-options"] = "DENY"
        response.headers["referrer-policy"] = "same-origin"
        response.headers["content-security-policy"] = (
            "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
            "frame-ancestors 'none'; form-action 'self'"
        )
        if new:
            response.set_cookie(
                CSRF_COOKIE, csrf, path=self.cookie_path(), samesite="strict", httponly=True
            )
        return response
