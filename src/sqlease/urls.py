"""Turn the URLs users write (``sqlease+postgresql://…``, ``sqlease+sqlite:///app.db``,
``sqlease://``) into SQLAlchemy URLs, and mask passwords wherever a URL is shown."""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from sqlease._aliases import FULL_SCHEMES
from sqlease.errors import ConfigurationError

PREFIX = "sqlease"
DEFAULT_SQLITE_URL = "sqlite:///sqlease.db"

#: Schemes that name a database another framework already configures (``django://alias``),
#: each resolved by the adapter that registered it into the database's own URL.
_resolvers: dict[str, Callable[[URL], str | URL]] = {}

#: What to do for a scheme no adapter registered yet (said in the error).
_HOW_TO_REGISTER = {
    "django": "add 'sqlease.contrib.django' to INSTALLED_APPS (and set Django up before "
    "the first publish)",
}


def register_scheme(scheme: str, resolve: Callable[[URL], str | URL]) -> None:
    """Let ``sqlease+<scheme>://…`` URLs name a database that ``resolve`` turns into a
    SQLite or PostgreSQL URL (``sqlease.contrib.django``: a Django database alias)."""
    _resolvers[scheme] = resolve


_SCHEME_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][\w+.-]*://[^:/@\s]*:)(?P<pw>[^@\s]*)(?P<at>@)")


def strip_prefix(url: str) -> str:
    """``sqlease+X`` → ``X``; ``sqlease://`` → the default SQLite file; anything else as is."""
    text = url.strip()
    if text in ("sqlease://", "sqlease:", "sqlease"):
        return DEFAULT_SQLITE_URL
    if text.startswith(PREFIX + "+"):
        return text[len(PREFIX) + 1 :]
    if text.startswith(PREFIX + "://"):
        raise ConfigurationError(
            f"{mask_password(text)!r}: 'sqlease://' takes no host or path; write "
            "'sqlease+sqlite:///path.db' or 'sqlease+postgresql://user@host/db'"
        )
    return text


def to_sqlalchemy_url(url: str | URL) -> URL:
    """Parse and normalise a database URL: PostgreSQL always goes through psycopg 3."""
    if isinstance(url, URL):
        parsed = url
    else:
        text = strip_prefix(url)
        try:
            parsed = make_url(text)
        except ArgumentError as exc:
            raise ConfigurationError(
                f"not a database URL: {mask_password(text)!r}; expected e.g. "
                "'sqlease+sqlite:///app.db' or 'sqlease+postgresql://user@host/db'"
            ) from exc
    if parsed.drivername in _resolvers:
        return to_sqlalchemy_url(_resolvers[parsed.drivername](parsed))
    if parsed.drivername in _HOW_TO_REGISTER:
        raise ConfigurationError(
            f"{mask_password(str(parsed))!r} names a {parsed.drivername} database: "
            f"{_HOW_TO_REGISTER[parsed.drivername]}"
        )
    backend = parsed.get_backend_name()
    driver = parsed.drivername.partition("+")[2]  # (get_driver_name() loads the dialect)
    if backend in ("postgresql", "postgres"):
        if parsed.drivername not in ("postgresql", "postgres", "postgresql+psycopg"):
            raise ConfigurationError(
                f"unsupported PostgreSQL driver {driver!r} in {mask_password(str(parsed))!r}: "
                "sqlease uses psycopg 3; write 'postgresql://' or 'postgresql+psycopg://'"
            )
        return parsed.set(drivername="postgresql+psycopg")
    if backend == "sqlite":
        if parsed.drivername != "sqlite":
            raise ConfigurationError(
                f"unsupported SQLite driver {driver!r}; write 'sqlite:///path/to/file.db'"
            )
        database = parsed.database or ""
        if database in ("", ":memory:") or database.startswith("file::memory:"):
            raise ConfigurationError(
                "an in-memory SQLite database cannot be shared by a worker and its producers; "
                "name a file, e.g. 'sqlease+sqlite:///app.db'"
            )
        if not database.startswith("file:") and not os.path.isabs(database):
            # Resolved now: a worker that later changes directory (--workdir, detach) must
            # keep using the same file.
            parsed = parsed.set(database=os.path.abspath(database))
        return parsed
    raise ConfigurationError(
        f"unsupported database {backend!r} in {mask_password(str(parsed))!r}: "
        "sqlease supports 'sqlite' and 'postgresql'"
    )


def client_url(
    hostname: str | None,
    *,
    transport: object = None,
    userid: str | None = None,
    password: object = None,
    port: int | None = None,
    virtual_host: str | None = None,
) -> str | URL | None:
    """The database URL a Kombu ``Connection`` stands for.

    Normally the whole URL is ``hostname`` (Kombu keeps everything after ``sqlease+`` there).
    After ``Connection.switch()`` (failover) it is in parts, with the full scheme as the
    transport name: this rebuilds it. ``None`` when there is no URL at all.
    """
    if hostname and "://" in hostname:
        return hostname
    if isinstance(transport, str) and transport in FULL_SCHEMES:
        database = virtual_host if virtual_host not in (None, "", "/") else None
        return URL.create(
            transport[len(PREFIX) + 1 :],
            username=userid or None,
            password=password if isinstance(password, str) and password else None,
            host=hostname or None,
            port=port or None,
            database=database,
        )
    return hostname


def mask_password(url: str) -> str:
    """Replace any password in a URL-looking string with ``**``."""
    return _SCHEME_PASSWORD.sub(lambda m: f"{m['head']}**{m['at']}", url)


def display_url(url: str | URL) -> str:
    """A URL safe to log: the password masked, the query kept."""
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    return mask_password(url)
