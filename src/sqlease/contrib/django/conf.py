"""The settings of ``sqlease.contrib.django`` and the ``django://`` URL scheme.

``sqlease+django://ALIAS`` (``sqlease+django://`` alone: ``SQLEASE_DATABASE``) is resolved,
when the transport, the result backend or the command line first needs it, into the URL of
that alias's database as Django configures it now (``connections[ALIAS].settings_dict``: under
Django's test runner, the test database). A query string is kept (``?pooler=transaction``).

Settings:

- ``SQLEASE_DATABASE`` (``"default"``): the alias whose database holds sqlease's tables
  (``manage.py migrate`` creates them there; ``manage.py sqlease`` and the tasks backend use
  it unless told otherwise).
- ``SQLEASE_TABLE_PREFIX`` (``"sqlease_"``): the prefix of those tables; the broker's
  ``table_prefix`` transport option must be the same.
- ``SQLEASE_DASHBOARD_READ_ONLY`` (False), ``SQLEASE_DASHBOARD_REDACT_ARGS`` (False) and
  ``SQLEASE_DASHBOARD_LEASE_SECONDS`` (60.0): the dashboard served under
  ``sqlease.contrib.django.urls`` shows without actions, hides task arguments, and takes
  the workers' lease to be that long (to tell a last heartbeat from an expiry).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import URL

from sqlease.errors import ConfigurationError

DEFAULT_DATABASE = "default"
DEFAULT_TABLE_PREFIX = "sqlease_"

#: OPTIONS keys Django itself reads (the rest are libpq connection parameters).
_DJANGO_OPTIONS = frozenset(
    {"isolation_level", "server_side_binding", "pool", "assume_role", "cursor_factory"}
)


def sqlease_database() -> str:
    """``SQLEASE_DATABASE``: the alias holding sqlease's tables."""
    from django.conf import settings

    alias = getattr(settings, "SQLEASE_DATABASE", DEFAULT_DATABASE)
    if not isinstance(alias, str) or not alias:
        raise ConfigurationError(
            f"SQLEASE_DATABASE must name a database alias of DATABASES, not {alias!r}"
        )
    return alias


def table_prefix() -> str:
    """``SQLEASE_TABLE_PREFIX``: the prefix of sqlease's tables."""
    from django.conf import settings

    prefix = getattr(settings, "SQLEASE_TABLE_PREFIX", DEFAULT_TABLE_PREFIX)
    if not isinstance(prefix, str) or not prefix:
        raise ConfigurationError(f"SQLEASE_TABLE_PREFIX must be a non-empty string, not {prefix!r}")
    return prefix


def dashboard_options() -> dict[str, Any]:
    """The ``SQLEASE_DASHBOARD_*`` settings, checked, as the dashboard's options."""
    from django.conf import settings

    found: dict[str, Any] = {}
    for name, option in (("READ_ONLY", "read_only"), ("REDACT_ARGS", "redact_args")):
        value = getattr(settings, f"SQLEASE_DASHBOARD_{name}", False)
        if not isinstance(value, bool):
            raise ConfigurationError(
                f"SQLEASE_DASHBOARD_{name} must be True or False, not {value!r}"
            )
        found[option] = value
    lease = getattr(settings, "SQLEASE_DASHBOARD_LEASE_SECONDS", 60.0)
    if isinstance(lease, bool) or not isinstance(lease, int | float) or lease <= 0:
        raise ConfigurationError(
            f"SQLEASE_DASHBOARD_LEASE_SECONDS must be a number of seconds above 0, not {lease!r}"
        )
    found["lease_seconds"] = float(lease)
    return found


def url_of_alias(alias: str) -> URL:
    """The SQLAlchemy URL of Django's database ``alias`` (PostgreSQL or SQLite)."""
    from django.db import connections

    if alias not in connections.settings:
        known = ", ".join(sorted(connections.settings)) or "none"
        raise ConfigurationError(
            f"no database alias {alias!r} in Django's DATABASES (aliases: {known})"
        )
    return _url_of(alias, connections[alias].settings_dict)


def _url_of(alias: str, settings: dict[str, Any]) -> URL:
    engine = str(settings.get("ENGINE", ""))
    name = settings.get("NAME")
    if engine.endswith(".sqlite3") or engine.endswith(".spatialite"):
        text = str(name or "")
        if not text or text == ":memory:" or "mode=memory" in text:
            raise ConfigurationError(
                f"Django's database {alias!r} is an in-memory SQLite database, which a worker "
                "cannot share: name a file (under tests, DATABASES[…]['TEST']['NAME'])"
            )
        return URL.create("sqlite", database=text)
    if engine.endswith(".postgresql") or engine.endswith(".postgis"):
        options = {
            key: str(value)
            for key, value in (settings.get("OPTIONS") or {}).items()
            if key not in _DJANGO_OPTIONS and isinstance(value, str | int)
        }
        port = settings.get("PORT")
        return URL.create(
            "postgresql+psycopg",
            username=settings.get("USER") or None,
            password=settings.get("PASSWORD") or None,
            host=settings.get("HOST") or None,
            port=int(port) if port else None,
            database=str(name) if name else None,
            query=options,
        )
    raise ConfigurationError(
        f"Django's database {alias!r} uses {engine!r}: sqlease runs on "
        "'django.db.backends.postgresql' (psycopg 3) and 'django.db.backends.sqlite3'"
    )


def resolve_url(url: URL) -> URL:
    """``django://ALIAS?query`` → the alias's database URL, the query kept."""
    if url.database or url.username or url.password or url.port:
        raise ConfigurationError(
            f"{url.render_as_string()!r}: a django:// URL names only a database alias, "
            "e.g. 'sqlease+django://default'"
        )
    alias = url.host or sqlease_database()
    resolved = url_of_alias(alias)
    if url.query:
        resolved = resolved.update_query_dict(dict(url.query))
    return resolved


def alias_url(alias: str | None = None) -> str:
    """The broker URL naming ``alias`` (``SQLEASE_DATABASE`` by default)."""
    return f"sqlease+django://{alias or sqlease_database()}"
