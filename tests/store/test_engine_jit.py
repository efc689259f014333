"""An engine passed in to a PostgreSQL store: sqlease's own engines start their sessions with
``jit=off``; one passed in may run with JIT on, and a claim over a large backlog is then
compiled (90 ms against 0.6 ms to run it, for a claim of 32 over 20,000 queued). The store
warns, once per engine."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from conftest import unique_prefix
from sqlease import Store

pytestmark = pytest.mark.pg


def test_an_engine_passed_in_with_jit_on_is_warned_about(
    pg_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """sqlease's own engines start their sessions with jit=off; an engine passed in may not,
    and then a claim over a large backlog is compiled (its estimated cost crosses
    jit_above_cost): tens of milliseconds per claim. The store says so, once per engine."""
    with create_engine(pg_database_url, poolclass=NullPool).connect() as conn:
        if conn.exec_driver_sql("SHOW jit").scalar() != "on":
            pytest.skip("this server runs without JIT")
    engine = create_engine(pg_database_url)
    with caplog.at_level("WARNING", logger="sqlease"):
        Store(engine, table_prefix=unique_prefix())
        Store(engine, table_prefix=unique_prefix())
    said = [r.getMessage() for r in caplog.records if "jit = on" in r.getMessage()]
    assert len(said) == 1 and "-c jit=off" in said[0]
    caplog.clear()
    off = create_engine(pg_database_url, connect_args={"options": "-c jit=off"})
    with caplog.at_level("WARNING", logger="sqlease"):
        Store(off, table_prefix=unique_prefix())
    assert not [r for r in caplog.records if "jit" in r.getMessage()]
    engine.dispose()
    off.dispose()
