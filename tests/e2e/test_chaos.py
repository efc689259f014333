"""The short chaos runs (benchmarks/chaos.py --short): real prefork workers SIGKILLed,
stalled past their lease, disconnected, and PostgreSQL restarted once; nothing lost, nothing
done twice, no run overlap, checkpoints never backwards."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PG_URL

CHAOS = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


def run_chaos(*args: str, pg_url: str = PG_URL) -> str:
    done = subprocess.run(
        [sys.executable, str(CHAOS), "--short", *args],
        capture_output=True,
        text=True,
        timeout=400,
        env={**__import__("os").environ, "CHAOS_PG_URL": pg_url},
    )
    output = done.stdout + done.stderr[-5000:]
    assert done.returncode == 0 and "CHAOS OK" in done.stdout, output
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_chaos_sqlite_with_worker_kills() -> None:
    out = run_chaos("--db", "sqlite")
    assert '"lost": 0' in out and '"run_overlaps": 0' in out


@pytest.mark.pg
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_chaos_postgresql_with_kills_stalls_disconnects_and_a_restart(
    pg_database_url: str,
) -> None:
    try:
        # In this session's own database: its tables go with it (they were left in `test`).
        out = run_chaos("--db", "pg", pg_url=pg_database_url)
    finally:
        # The run restarted PostgreSQL: drop this process's pooled connections.
        from sqlease._db.engine import dispose_all

        dispose_all()
    assert '"restarts": 1' in out and '"lost": 0' in out and '"run_overlaps": 0' in out
