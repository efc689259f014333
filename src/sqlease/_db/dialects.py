"""A dialect by its SQLAlchemy name: its capabilities and its statements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Connection
from sqlalchemy.engine import URL

from sqlease._db import postgresql, sqlite
from sqlease._db.postgresql import storage
from sqlease._db.statements import Capabilities, Statements
from sqlease._db.tables import Tables


@dataclass(frozen=True, slots=True)
class Dialect:
    name: str
    caps: Capabilities
    #: The statements for a table prefix (build once and keep: see ``Statements``).
    statements: Callable[[Tables], Statements]
    #: Sets the dialect's storage parameters on the tables (migration 7).
    tune_tables: Callable[[Connection, Tables], None]


def _nothing_to_tune(conn: Connection, tables: Tables) -> None:
    """SQLite has no per-table storage or vacuum parameters."""


POSTGRESQL = Dialect("postgresql", postgresql.CAPABILITIES, postgresql.statements, storage.apply)
SQLITE = Dialect("sqlite", sqlite.CAPABILITIES, sqlite.statements, _nothing_to_tune)


def dialect_for(name: str) -> Dialect:
    """PostgreSQL for ``"postgresql"``, otherwise SQLite (the two dialects sqlease
    supports)."""
    return POSTGRESQL if name == "postgresql" else SQLITE


def capabilities_of(url: URL) -> Capabilities:
    """What the database behind ``url`` can do."""
    return dialect_for(url.get_backend_name()).caps


def statements_for(dialect_name: str, tables: Tables) -> Statements:
    return dialect_for(dialect_name).statements(tables)
