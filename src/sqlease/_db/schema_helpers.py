"""What the migrations share (sqlease._db.migrations and each dialect's own steps): the
catalog reads a schema made from nothing skips."""

from __future__ import annotations

from contextvars import ContextVar

from sqlalchemy import Connection, Index, Table, inspect
from sqlalchemy.schema import CreateIndex

#: Set while ``migrate`` builds a schema from nothing: migration 1 then creates every table,
#: column and index of this code's metadata, so the later migrations need not look for what
#: it made (their catalog reads were a third of the time a new schema took, about 50 ms on
#: PostgreSQL) and do only what the metadata does not say: sequences, table settings and
#: the indexes kept outside it.
FRESH: ContextVar[bool] = ContextVar("sqlease_fresh_schema", default=False)


def columns(conn: Connection, table: Table) -> set[str]:
    """The names of ``table``'s columns in the database."""
    if FRESH.get():
        return {column.name for column in table.columns}
    return {c["name"] for c in inspect(conn).get_columns(table.name)}


def create_table(conn: Connection, table: Table) -> None:
    """Create ``table`` and its indexes unless they exist."""
    if FRESH.get():
        return  # migration 1 made them
    table.create(conn, checkfirst=True)
    for index in table.indexes:
        ensure_index(conn, index)


def ensure_index(conn: Connection, index: Index) -> None:
    """Create ``index`` unless it exists, in one statement: SQLAlchemy's ``checkfirst``
    reflects the table's indexes first, which on a PostgreSQL catalog holding many prefixes'
    tables took seconds per index. An index made only on some dialect keeps that check."""
    if FRESH.get():
        return  # every index is in the metadata: migration 1 made it
    if getattr(index, "_ddl_if", None) is not None:
        index.create(conn, checkfirst=True)
    else:
        conn.execute(CreateIndex(index, if_not_exists=True))
