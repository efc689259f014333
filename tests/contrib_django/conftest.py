"""Django configured once per test process, with two database aliases on real databases:
``sqlite`` (a WAL file of this session's) and ``pg`` (this session's PostgreSQL database).
Each test gets its own table prefix (``SQLEASE_TABLE_PREFIX`` and the broker's), so runs never
see each other's tasks. (pytest-django is not loaded in this suite, ``-p no:django``: these
tests set Django up themselves; ``test_pytest_plugin.py`` runs it in a suite of its own.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy.engine import make_url

from conftest import unique_prefix

ALIASES = ["sqlite", pytest.param("pg", marks=pytest.mark.pg)]


def _configure(sqlite_file: Path, pg_url: str | None) -> None:
    import django
    from django.conf import settings

    if settings.configured:
        return
    databases: dict[str, Any] = {
        "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(sqlite_file)},
        "sqlite": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(sqlite_file),
            "OPTIONS": {"timeout": 30, "transaction_mode": "IMMEDIATE"},
        },
    }
    if pg_url is not None:
        url = make_url(pg_url)
        databases["pg"] = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": url.database,
            "USER": url.username or "",
            "PASSWORD": url.password or "",
            "HOST": url.host or "",
            "PORT": str(url.port or ""),
        }
    apps = ["django.contrib.contenttypes", "django.contrib.auth", "sqlease.contrib.django"]
    try:
        import django.tasks  # Django 6: built in
    except ImportError:
        apps.insert(2, "django_tasks")  # Django 5.2: the django-tasks package
    settings.configure(
        INSTALLED_APPS=apps,
        DATABASES=databases,
        USE_TZ=True,
        SQLEASE_DATABASE="sqlite",
        # The dashboard's tests (test_dashboard.py): sign-in, sessions in signed cookies (no
        # table), CSRF, and a URLconf that includes sqlease.contrib.django.urls.
        SECRET_KEY="tests-only",
        SESSION_ENGINE="django.contrib.sessions.backends.signed_cookies",
        MIDDLEWARE=[
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.middleware.csrf.CsrfViewMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
        ],
        ROOT_URLCONF="contrib_django.dashboard_urls",
        ALLOWED_HOSTS=["testserver", "127.0.0.1"],
    )
    django.setup()


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Django database alias, configured (once) with the session's databases."""
    pg_url = request.getfixturevalue("pg_database_url") if request.param == "pg" else None
    folder = tmp_path_factory.getbasetemp() / "django"
    folder.mkdir(exist_ok=True)
    from django.conf import settings

    if settings.configured and request.param == "pg" and "pg" not in settings.DATABASES:
        pytest.fail("Django was configured without the pg alias: run the pg tests first")
    if not settings.configured:
        # PostgreSQL's alias exists whenever the server answers, so that the SQLite tests
        # can run first and the PostgreSQL ones after them in one process.
        if pg_url is None:
            try:
                pg_url = request.getfixturevalue("pg_database_url")
            except pytest.skip.Exception:
                pg_url = None
        _configure(folder / "django.db", pg_url)
    return str(request.param)


@pytest.fixture
def prefix() -> Iterator[str]:
    from django.test import override_settings

    name = unique_prefix()
    with override_settings(SQLEASE_TABLE_PREFIX=name):
        yield name


def make_celery(broker: str, prefix: str, **conf: Any) -> Celery:
    app = Celery("django_tests", broker=broker, set_as_current=False)
    app.conf.broker_transport_options = {"table_prefix": prefix, **conf}

    @app.task(name="orders.ship", shared=False)
    def ship(order_id: int) -> int:
        return order_id

    app.finalize()
    return app


@pytest.fixture
def celery_app(alias: str, prefix: str) -> Iterator[Celery]:
    """A Celery app whose broker is the alias's database (``sqlease+django://ALIAS``)."""
    from django.db import connections

    app = make_celery(f"sqlease+django://{alias}", prefix)
    with app.connection_for_write() as conn:
        conn.ensure_connection()  # creates sqlease's tables (auto_migrate)
    yield app
    app.close()
    connections.close_all()
