"""Who may act: the token (a bearer header, or the session cookie the login form sets) and
the CSRF check every POST passes (double submit: a random cookie that the form, or an
``X-CSRF-Token`` header, must repeat; a page of another site can send the cookie but cannot
read it).

The session cookie holds an HMAC of the token, never the token itself, so a copied cookie
stops working when the token changes and the token appears in no cookie, page or log.
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


@dataclass(frozen=True)
class Guard:
    token: str | None
    read_only: bool

    @property
    def actions_enabled(self) -> bool:
        """Actions need a token; without one the dashboard only shows."""
        return not self.read_only and bool(self.token)

    def session_value(self) -> str:
        assert self.token
        return hmac.new(self.token.encode(), b"sqlease-ui-session", hashlib.sha256).hexdigest()

    def token_matches(self, given: str) -> bool:
        return bool(self.token) and hmac.compare_digest(given.encode(), (self.token or "").encode())

    def authenticated(self, request: Request) -> bool:
        if not self.actions_enabled:
            return False
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
