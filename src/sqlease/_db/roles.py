"""A least-privilege PostgreSQL role for workers and producers: data access on sqlease's
tables only, no DDL. Migrate with an owner role (``sqlease migrate``), run workers with
``auto_migrate`` off as a role granted these statements (``sqlease grant ROLE``)."""

from __future__ import annotations

import re

from sqlease._db.tables import Tables
from sqlease.errors import ConfigurationError

_ROLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")


def worker_grants(tables: Tables, role: str, *, schema: str = "public") -> list[str]:
    """The GRANT statements a worker role needs (PostgreSQL)."""
    if not _ROLE.match(role):
        raise ConfigurationError(f"not a plain PostgreSQL role name: {role!r}")
    if not _ROLE.match(schema):
        raise ConfigurationError(f"not a plain PostgreSQL schema name: {schema!r}")
    statements = [f'GRANT USAGE ON SCHEMA {schema} TO "{role}"']
    for table in tables.metadata.sorted_tables:
        name = f'{schema}."{table.name}"'
        if table is tables.schema_version:  # read only: workers never migrate
            statements.append(f'GRANT SELECT ON {name} TO "{role}"')
        else:
            statements.append(f'GRANT SELECT, INSERT, UPDATE, DELETE ON {name} TO "{role}"')
    for table in tables.metadata.sorted_tables:
        for column in table.columns:
            if column.primary_key and column.autoincrement is True:
                statements.append(
                    f'GRANT USAGE, SELECT ON SEQUENCE {schema}."{table.name}_{column.name}_seq" '
                    f'TO "{role}"'
                )
    return statements
