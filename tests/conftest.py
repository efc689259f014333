"""Shared fixtures: every store test runs on SQLite (a WAL file) and on PostgreSQL.

PostgreSQL: one fresh database per test session (created and dropped here), and a fresh table
prefix per test, so runs never see each other's rows. Outside CI a PostgreSQL test skips with
the reason when no server answers; in CI (``CI`` or ``SQLEASE_REQUIRE_PG`` set) it fails.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from sqlease.store import Store
from sqlease.testing import FakeClock

PG_URL = os.environ.get("SQLEASE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
REQUIRE_PG = bool(os.environ.get("CI") or os.environ.get("SQLEASE_REQUIRE_PG"))
_prefixes = itertools.count()


def _admin_engine() -> Any:
    url = make_url(PG_URL).set(drivername="postgresql+psycopg")
    return create_engine(url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)


#: Tests that run real ``celery`` processes, PgBouncer or Chromium: ``processes``, run after the
#: others (the README's command), three at a time: they mostly wait (for a worker to start, a
#: lease to expire, a browser to answer), their leases are seconds long, and each has its own
#: database, prefix, ports and files. Those that race processes, judge timing from the
#: database (rate limits, beat slots, a lease's end when cut off, blocking calls), count the
#: server's connections, or start and restart PostgreSQL servers of their own (the chaos run,
#: failover): ``alone``, last and by themselves, where their leases and timeouts were
#: measured. The rest (fake clocks, one process) run two at a time (``-n 2``) first.
ALONE = (
    "concurrency",
    "e2e/test_beat_processes.py",
    "e2e/test_chaos.py",
    "e2e/test_connections.py",
    "e2e/test_durable.py",
    "e2e/test_failover.py",
    "e2e/test_flow.py",
    "e2e/test_loop_thread.py",
    "e2e/test_partition.py",
)
PROCESSES = ("e2e", "pooler", "ui/test_browser.py")


def _under(where: str, parts: tuple[str, ...]) -> bool:
    return any(where == part or where.startswith(part + "/") for part in parts)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    for item in items:
        where = Path(str(item.path)).relative_to(root).as_posix()
        if _under(where, ALONE):
            item.add_marker(pytest.mark.alone)
        elif _under(where, PROCESSES):
            item.add_marker(pytest.mark.processes)


@pytest.fixture(scope="session")
def pg_database_url() -> Iterator[str]:
    """URL of a PostgreSQL database made for this test session."""
    try:
        admin = _admin_engine()
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # any failure to reach the server
        message = f"PostgreSQL at {PG_URL} did not answer ({type(exc).__name__}: {exc})"
        if REQUIRE_PG:
            pytest.fail(message + "; PostgreSQL tests are required here", pytrace=False)
        pytest.skip(message + "; set SQLEASE_TEST_PG_URL to run PostgreSQL tests")
    name = f"sqlease_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        from sqlease._db.engine import dispose_all

        dispose_all(close=True)
        admin.dispose()
        _drop_in_background(name)


#: Run by a detached interpreter: drops the session's database. A suite's database holds the
#: tables of about a thousand prefixes, and the drop (unlinking their files) took 8 s, at
#: the end of every run, that no test needs to wait for.
_DROP = """
import sys
from sqlalchemy import create_engine, text
engine = create_engine(sys.argv[1], isolation_level="AUTOCOMMIT")
with engine.connect() as conn:
    conn.execute(text(f'DROP DATABASE IF EXISTS "{sys.argv[2]}" WITH (FORCE)'))
"""


def _drop_in_background(name: str) -> None:
    url = make_url(PG_URL).set(drivername="postgresql+psycopg")
    command = [sys.executable, "-c", _DROP, url.render_as_string(hide_password=False), name]
    setsid = shutil.which("setsid")
    if setsid is None:  # no util-linux: drop it here, and wait
        subprocess.run(command, check=True)
        return
    # setsid -f: the dropper runs in a session of its own and outlives pytest; setsid itself
    # returns at once, so nothing is left for this process to reap.
    subprocess.run(
        [setsid, "-f", *command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
    )


@pytest.fixture(autouse=True)
def _close_sqlite_files(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test, the engines of its SQLite files go with the files: the process-wide
    engine cache would otherwise keep their connections open for the rest of the session
    (a thousand tests later, descriptors past select()'s 1024)."""
    folder = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if folder is not None:
        from sqlease._db.engine import dispose_files

        dispose_files(str(folder))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def record_naps(monkeypatch: pytest.MonkeyPatch, backend: Any) -> list[Any]:
    """What each of the result backend's naps returned (its class's ``_nap`` patched): an
    empty list is a nap that waited out its safety interval without a notification."""
    naps: list[Any] = []
    real_nap = type(backend)._nap

    def nap(self: Any, *args: Any) -> Any:
        naps.append(real_nap(self, *args))
        return naps[-1]

    monkeypatch.setattr(type(backend), "_nap", nap)
    return naps


def unique_prefix() -> str:
    return f"t{os.getpid()}_{next(_prefixes)}_"


def isolated_app(name: str, db_url: str) -> Celery:
    """A Celery app with sqlease as its broker and backend on ``db_url``, in tables of its
    own (a fresh prefix), not made the current app."""
    url = f"sqlease+{db_url}"
    app = Celery(name, broker=url, backend=url, set_as_current=False)
    app.conf.broker_transport_options = {"table_prefix": unique_prefix()}
    return app


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.pg)])
def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """A database URL: a SQLite file in WAL mode, or this session's PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sqlease.db'}"
    url: str = request.getfixturevalue("pg_database_url")
    return url


@pytest.fixture
def make_store(db_url: str, clock: FakeClock) -> Callable[..., Store]:
    """Build stores on the test's database with its own table prefix and the fake clock."""
    prefix = unique_prefix()

    def build(**kwargs: Any) -> Store:
        kwargs.setdefault("table_prefix", prefix)
        kwargs.setdefault("clock", clock)
        return Store(db_url, **kwargs)

    return build


@pytest.fixture
def store(make_store: Callable[..., Store]) -> Store:
    return make_store()
