"""The dialects sqlease supports, by name: the only place that chooses between them."""

from __future__ import annotations

from sqlalchemy.engine import URL

from sqlease._db.driver import Dialect
from sqlease._db.postgresql.beat_fires import PgScheduleFires
from sqlease._db.postgresql.entry import POSTGRESQL
from sqlease._db.schedules import ScheduleFires
from sqlease._db.sqlite.beat_fires import SqliteScheduleFires
from sqlease._db.sqlite.entry import SQLITE
from sqlease._db.statements import Capabilities, Statements
from sqlease._db.tables import Tables


def dialect_for(name: str) -> Dialect:
    """PostgreSQL for ``"postgresql"``, otherwise SQLite (the two dialects sqlease
    supports; sqlease.urls refuses any other scheme first)."""
    return POSTGRESQL if name == "postgresql" else SQLITE


def schedule_fires_for(
    name: str, tables: Tables, timeline_prefix: str, channel: str
) -> ScheduleFires:
    """The beat's batch of fires (``sqlease._db.schedules``) on the dialect ``name``."""
    if name == "postgresql":
        return PgScheduleFires(tables, timeline_prefix, channel)
    return SqliteScheduleFires(tables, timeline_prefix)


def capabilities_of(url: URL) -> Capabilities:
    """What the database behind ``url`` can do."""
    return dialect_for(url.get_backend_name()).capabilities(url)


def statements_for(name: str, tables: Tables) -> Statements:
    return dialect_for(name).statements(tables)


def same_database(mine: URL, theirs: URL) -> bool:
    """Do two URLs name one database (SQLite: one file, whatever the relative path)?"""
    first, second = dialect_for(mine.get_backend_name()), dialect_for(theirs.get_backend_name())
    return first.database_key(mine) == second.database_key(theirs)


#: Errors of the dialects' own drivers that mean the connection was lost or refused (Kombu's
#: ``connection_errors`` lists them: a worker reconnects on one).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    *POSTGRESQL.connection_errors,
    *SQLITE.connection_errors,
)
