"""The driver for a store's engine."""

from __future__ import annotations

from sqlalchemy.engine import URL, Engine

from sqlease._db.dialects import dialect_for
from sqlease._db.driver import Driver
from sqlease._db.engine import get_engine
from sqlease._db.tables import Tables


def driver_for(
    url: str | URL | Engine,
    engine: Engine,
    tables: Tables,
    *,
    lease_sync_commit: bool = False,
    publish_sync_commit: bool = True,
) -> Driver:
    """PostgreSQL (psycopg) or SQLite (sqlite3), by the engine's dialect."""
    return dialect_for(engine.dialect.name).driver(
        url,
        engine,
        tables,
        lease_sync_commit=lease_sync_commit,
        publish_sync_commit=publish_sync_commit,
        engines=get_engine,
    )
