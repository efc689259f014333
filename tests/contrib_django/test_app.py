"""The app: ``django://`` URLs name an alias, ``manage.py migrate`` creates sqlease's tables on
``SQLEASE_DATABASE`` only, ``manage.py sqlease`` runs the command line there."""

from __future__ import annotations

import json

import pytest
from celery import Celery
from sqlalchemy import create_engine, inspect

from sqlease import ConfigurationError, Store
from sqlease.contrib.django.conf import _url_of, url_of_alias
from sqlease.urls import to_sqlalchemy_url


def test_a_django_url_is_the_alias_database(alias: str) -> None:
    from django.db import connections

    url = to_sqlalchemy_url("sqlease+django://" + alias + "?pooler=transaction")
    assert url.query == {"pooler": "transaction"}
    settings = connections[alias].settings_dict
    if alias == "sqlite":
        assert url.database == settings["NAME"]
    else:
        assert (url.drivername, url.database, url.host) == (
            "postgresql+psycopg",
            settings["NAME"],
            settings["HOST"],
        )
    # no alias: SQLEASE_DATABASE
    assert to_sqlalchemy_url("sqlease+django://").database == url_of_alias("sqlite").database


def test_bad_django_urls_say_what_is_wrong(alias: str) -> None:
    with pytest.raises(ConfigurationError, match=r"no database alias 'nope'.*aliases: default"):
        to_sqlalchemy_url("sqlease+django://nope")
    with pytest.raises(ConfigurationError, match="names only a database alias"):
        to_sqlalchemy_url("sqlease+django://default/extra")
    with pytest.raises(ConfigurationError, match="in-memory SQLite database"):
        _url_of("t", {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"})
    with pytest.raises(ConfigurationError, match=r"uses 'django.db.backends.mysql'"):
        _url_of("t", {"ENGINE": "django.db.backends.mysql", "NAME": "x"})


def _tables(alias: str, prefix: str) -> set[str]:
    engine = create_engine(url_of_alias(alias))
    try:
        return {t for t in inspect(engine).get_table_names() if t.startswith(prefix)}
    finally:
        engine.dispose()


def _forget_migrations(alias: str) -> None:
    """Unrecord sqlease's migrations on ``alias`` (each test migrates its own prefix)."""
    from django.db import connections
    from django.db.migrations.recorder import MigrationRecorder

    MigrationRecorder(connections[alias]).migration_qs.filter(app="sqlease").delete()


def test_migrate_creates_the_tables_on_sqlease_database_only(alias: str, prefix: str) -> None:
    from django.core.management import call_command
    from django.db import connections
    from django.test import override_settings

    others = [name for name in ("sqlite", "pg") if name != alias and name in connections.settings]
    with override_settings(SQLEASE_DATABASE=alias):
        for other in others:
            call_command("migrate", "sqlease", database=other, verbosity=0)
            _forget_migrations(other)
            assert _tables(other, prefix) == set()
        assert _tables(alias, prefix) == set()
        call_command("migrate", "sqlease", database=alias, verbosity=0)
        _forget_migrations(alias)
    assert {f"{prefix}messages", f"{prefix}schema_version"} <= _tables(alias, prefix)
    # the broker finds its schema in place (no auto_migrate needed)
    Store(url_of_alias(alias), table_prefix=prefix, auto_migrate=False)


def test_manage_py_sqlease_runs_the_command_line(
    alias: str, prefix: str, celery_app: Celery, capsys: pytest.CaptureFixture[str]
) -> None:
    from django.core.management import call_command
    from django.test import override_settings

    task = celery_app.tasks["orders.ship"].delay(5)
    with override_settings(SQLEASE_DATABASE=alias):
        call_command("sqlease", "show", task.id, "--json")
    shown = json.loads(capsys.readouterr().out)
    assert shown["task_id"] == task.id
    assert shown["state"] == "queued"
    with override_settings(SQLEASE_DATABASE=alias), pytest.raises(Exception, match="status 1"):
        call_command("sqlease", "show", "no-such-task")
