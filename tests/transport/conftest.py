"""Fixtures for the Kombu-level transport tests: every test runs on SQLite and PostgreSQL.

``connect(**options)`` opens a ``kombu.Connection`` on the test's database with the test's own
table prefix (so tests never see each other's rows) and closes it at teardown; ``db_store`` is
a ``sqlease.Store`` on the same tables, on the real clock, for looking at rows directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import Connection

from conftest import unique_prefix
from sqlease import Store

#: A short safety poll, so a synchronous drain notices new work quickly.
POLL = 0.05


@pytest.fixture
def table_prefix() -> str:
    return unique_prefix()


@pytest.fixture
def broker_url(db_url: str) -> str:
    return "sqlease+" + db_url


@pytest.fixture
def transport_options(table_prefix: str) -> dict[str, Any]:
    return {"table_prefix": table_prefix, "polling_interval": POLL}


@pytest.fixture
def connect(
    broker_url: str, transport_options: dict[str, Any]
) -> Iterator[Callable[..., Connection]]:
    """Open connections on the test's tables; ``connect(lease_seconds=0.3)`` overrides options."""
    made: list[Connection] = []

    def make(**overrides: Any) -> Connection:
        conn = Connection(broker_url, transport_options={**transport_options, **overrides})
        made.append(conn)
        return conn

    yield make
    for conn in reversed(made):
        conn.release()


@pytest.fixture
def conn(connect: Callable[..., Connection]) -> Connection:
    return connect()


@pytest.fixture
def db_store(db_url: str, table_prefix: str) -> Store:
    """The test's tables seen through the store (real clock), for checking rows."""
    return Store(db_url, table_prefix=table_prefix)
