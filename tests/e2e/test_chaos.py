"""The short chaos runs (benchmarks/chaos.py --short): real prefork workers SIGKILLed,
stalled past their lease and, on PostgreSQL, disconnected, one of them cut off from the
database (a partition), and the server restarted once; nothing lost, no duplicate result, no
two live holders of a task or a run, checkpoints never backwards, every cut-off task told
``LeaseLost`` within its lease. PostgreSQL is the run's own throwaway server (never the
shared one: the run restarts it), alone or behind its own PgBouncer in transaction mode."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REQUIRE_PG

from .pg_clusters import bindir

CHAOS = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


def run_chaos(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(CHAOS), "--short", *args],
        capture_output=True,
        text=True,
        timeout=400,
    )
    output = done.stdout + done.stderr[-5000:]
    assert done.returncode == 0 and "CHAOS OK" in done.stdout, output
    return done.stdout


def needs(program: str | None, what: str) -> None:
    if program is None:
        if REQUIRE_PG:
            pytest.fail(f"{what} is not installed", pytrace=False)
        pytest.skip(f"{what} is not installed")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_chaos_sqlite_with_worker_kills_and_stalls() -> None:
    out = run_chaos("--db", "sqlite")
    assert '"lost": 0' in out and '"run_overlaps": 0' in out


@pytest.mark.pg
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_chaos_postgresql_with_kills_stalls_disconnects_a_partition_and_a_restart() -> None:
    needs(bindir() and str(bindir()), "PostgreSQL's server programs")
    out = run_chaos("--db", "pg")
    assert '"postgresql_restarts": 1' in out and '"partitions_of_one_worker": 1' in out
    assert '"lost": 0' in out and '"run_overlaps": 0' in out
    # Tasks published while the connections were terminated and the server restarted.
    assert '"tasks_published_during_the_faults": 150' in out and '"published_twice": 0' in out


@pytest.mark.pg
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_chaos_through_pgbouncer_in_transaction_mode() -> None:
    needs(bindir() and shutil.which("pgbouncer", path="/usr/sbin:/usr/bin"), "pgbouncer")
    out = run_chaos("--db", "pgbouncer")
    assert '"postgresql_restarts": 1' in out and '"lost": 0' in out
