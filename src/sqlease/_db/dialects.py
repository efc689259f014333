"""A dialect by its SQLAlchemy name: its capabilities and its statements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.engine import URL

from sqlease._db import postgresql, sqlite
from sqlease._db.statements import Capabilities, Statements
from sqlease._db.tables import Tables


@dataclass(frozen=True, slots=True)
class Dialect:
    name: str
    caps: Capabilities
    #: The statements for a table prefix (build once and keep: see ``Statements``).
    statements: Callable[[Tables], Statements]


POSTGRESQL = Dialect("postgresql", postgresql.CAPABILITIES, postgresql.statements)
SQLITE = Dialect("sqlite", sqlite.CAPABILITIES, sqlite.statements)


def dialect_for(name: str) -> Dialect:
    """PostgreSQL for ``"postgresql"``, otherwise SQLite (the two dialects sqlease
    supports)."""
    return POSTGRESQL if name == "postgresql" else SQLITE


def capabilities_of(url: URL) -> Capabilities:
    """What the database behind ``url`` can do."""
    return dialect_for(url.get_backend_name()).caps


def statements_for(dialect_name: str, tables: Tables) -> Statements:
    return dialect_for(dialect_name).statements(tables)
