"""sqlease's tables under ``manage.py migrate``: Django's migrations call sqlease's own.

Each of sqlease's Django migrations runs ``migrate_schema``, which brings sqlease's tables on
``SQLEASE_DATABASE`` to the schema version of the installed sqlease (the same migrations
``sqlease migrate`` and the workers' ``auto_migrate`` run, safe from many processes at once):
one schema, whoever creates it first. On every other alias it does nothing, so
``migrate --database other`` leaves that database alone.
"""

from __future__ import annotations

from typing import Any

from sqlease.contrib.django.conf import sqlease_database, table_prefix, url_of_alias


def migrate_schema(apps: Any, schema_editor: Any) -> None:
    """A ``RunPython`` operation: create or upgrade sqlease's tables on the alias migrated."""
    from sqlease.store import Store

    alias = schema_editor.connection.alias
    if alias != sqlease_database():
        return
    # Store() migrates at its first connection (auto_migrate) on its own connection: the
    # migration is not atomic, so no transaction of Django's holds a SQLite write lock then.
    Store(url_of_alias(alias), table_prefix=table_prefix(), auto_migrate=True)


def keep_schema(apps: Any, schema_editor: Any) -> None:
    """Unapplying leaves sqlease's tables (and the tasks in them) in place: drop them by hand
    if you mean to (their names start with ``SQLEASE_TABLE_PREFIX``)."""
