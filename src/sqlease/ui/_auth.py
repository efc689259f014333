"""Who may act: the token (a bearer header, or the session cookie the login form sets) and
the CSRF check every POST passes (double submit: a random cookie that the form, or an
``X-CSRF-Token`` header, must repeat; a page of another site can send the cookie but cannot
read it).

The session cookie holds an HMAC of the token, never the token itself, so a copied cookie
stops working when the token changes and the token appears in no cookie, page or log.

Served by a host framework (``host_auth``: the Django dashboard, sqlease.contrib.django.
dashboard), the host signs people in and checks every POST's CSRF token before the request
reaches the dashboard; it says so in the ASGI scope (``HOST_KEY``: who, and the CSRF field
and value its forms must carry), which a client cannot set. An app built without
``host_auth`` ignores that key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request

SESSION_COOKIE = "sqlease_ui_session"
CSRF_COOKIE = "sqlease_ui_csrf"
CSRF_FIELD = "csrf"
CSRF_HEADER = "x-csrf-token"
#: The ASGI scope key a host framework sets on a request it signed in and checked.
HOST_KEY = "sqlease.host"


@dataclass(frozen=True)
class HostAuth:
    """What the host framework says of one request: who is signed in (already allowed to
    see and act), and the CSRF field and value the host checks on the forms' POSTs."""

    user: str
    csrf_field: str
    csrf: str


@dataclass(frozen=True)
class Guard:
    token: str | None
    read_only: bool
    #: Sign-in and CSRF are the host framework's (``HOST_KEY``), not the token's.
    host_auth: bool = False

    @property
    def actions_enabled(self) -> bool:
        """Actions need a token (or the host's sign-in); without one the dashboard only
        shows."""
        return not self.read_only and (self.host_auth or bool(self.token))

    def host(self, request: Request) -> HostAuth | None:
        """The host's word on this request (None unless this app was built for a host)."""
        found = request.scope.get(HOST_KEY) if self.host_auth else None
        return found if isinstance(found, HostAuth) else None

    def csrf(self, request: Request) -> tuple[str, str, bool]:
        """The forms' CSRF field and value, and whether the value is new (a cookie to set)."""
        host = self.host(request)
        if host is not None:
            return host.csrf_field, host.csrf, False
        value, new = csrf_token(request)
        return CSRF_FIELD, value, new

    def csrf_ok(self, request: Request, submitted: str | None) -> bool:
        """A host checked the POST before it arrived; else the double-submit check."""
        if self.host_auth:
            return self.host(request) is not None
        return csrf_ok(request, submitted)

    def session_value(self) -> str:
        assert self.token
        return hmac.new(self.token.encode(), b"sqlease-ui-session", hashlib.sha256).hexdigest()

    def token_matches(self, given: str) -> bool:
        return bool(self.token) and hmac.compare_digest(given.encode(), (self.token or "").encode())

    def authenticated(self, request: Request) -> bool:
        if not self.actions_enabled:
            return False
        if self.host_auth:
            return self.host(request) is not None
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and value:
            return self.token_matches(value.strip())
        cookie = request.cookies.get(SESSION_COOKIE, "")
        return bool(cookie) and hmac.compare_digest(cookie, self.session_value())


def csrf_token(request: Request) -> tuple[str, bool]:
    """The request's CSRF value, and whether it is new (to be set as a cookie)."""
    value = request.cookies.get(CSRF_COOKIE)
    if value and len(value) >= 32:
        return value, False
    return secrets.token_urlsafe(32), True


def csrf_ok(request: Request, submitted: str | None) -> bool:
    """The POST repeats the cookie, and comes from this site when the browser says where
    it comes from."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    given = submitted or request.headers.get(CSRF_HEADER, "")
    if not cookie or not given or not hmac.compare_digest(cookie, given):
        return False
    origin = request.headers.get("origin")
    if origin and origin != "null":
        host = request.headers.get("x-forwarded-host") or request.headers.get("host", "")
        if urlsplit(origin).netloc != host:
            return False
    return True
