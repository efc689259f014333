"""``sqlease ui``: a web dashboard over ``sqlease.Admin`` (``pip install 'sqlease[ui]'``).

Overview (per queue counts, workers, throughput), tasks (filters, keyset pages), a task's
timeline, leases, checkpoints and steps, runs, failed, waiting and paused tasks, periodic
task entries, and the actions (pause, resume, cancel, requeue, approve, reject, provide
input, enable, disable, run now), each confirmed and done through ``Admin``.

Safety: it binds 127.0.0.1 unless told otherwise; actions need the ``token`` (a bearer
header or the login form's cookie) and are off without one or with ``read_only``; every POST
passes a CSRF check; the database URL is shown without its password.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from sqlease.admin import Admin

__all__ = ["create_app", "serve"]

#: The environment variable read when no token is given.
TOKEN_ENV = "SQLEASE_UI_TOKEN"


def create_app(
    admin_or_url: Admin | str,
    *,
    token: str | None = None,
    read_only: bool = False,
    root_path: str = "",
    redact_args: bool = False,
    lease_seconds: float = 60.0,
) -> ASGIApp:
    """The dashboard as an ASGI (Starlette) app over an ``Admin`` or a broker URL.

    ``token``: what actions need (else ``$SQLEASE_UI_TOKEN``; with neither, the dashboard
    only shows). ``root_path``: the URL prefix a reverse proxy serves it under
    (``"/sqlease"``). ``redact_args``: hide task arguments. ``lease_seconds``: the workers'
    lease, to show when each was last heard of."""
    try:
        from sqlease.ui._app import build
    except ImportError as exc:  # starlette, jinja2 or python-multipart missing
        raise ImportError(
            f"the dashboard needs the 'ui' extra: pip install 'sqlease[ui]' ({exc})"
        ) from exc
    return build(
        admin_or_url,
        token=token if token is not None else os.environ.get(TOKEN_ENV),
        read_only=read_only,
        root_path=root_path,
        redact_args=redact_args,
        lease_seconds=lease_seconds,
    )


def serve(
    url: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    read_only: bool = False,
    root_path: str = "",
    redact_args: bool = False,
    lease_seconds: float = 60.0,
) -> None:
    """Run the dashboard with uvicorn until interrupted (127.0.0.1 by default)."""
    import uvicorn

    app = create_app(
        url,
        token=token,
        read_only=read_only,
        root_path=root_path,
        redact_args=redact_args,
        lease_seconds=lease_seconds,
    )
    uvicorn.run(app, host=host, port=port, proxy_headers=True, server_header=False)
