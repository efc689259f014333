"""The driver for a store's engine."""

from __future__ import annotations

from functools import partial

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
    lease_ms: int = 60_000,
) -> Driver:
    """PostgreSQL (psycopg) or SQLite (sqlite3), by the engine's dialect; the engines it makes
    for more lanes follow ``lease_ms`` as the store's own does."""
    driver = dialect_for(engine.dialect.name).driver(
        url,
        engine,
        tables,
        lease_sync_commit=lease_sync_commit,
        publish_sync_commit=publish_sync_commit,
        engines=partial(get_engine, lease_ms=lease_ms),
    )
    driver.lease_ms = int(lease_ms)
    return driver
