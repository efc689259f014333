"""Migrations are safe when several processes start on an empty database at once."""

from __future__ import annotations

import multiprocessing

import pytest

from conftest import unique_prefix
from sqlease import Store
from sqlease.schema import CURRENT_VERSION, read_version


def _open(url: str, prefix: str) -> int:
    store = Store(url, table_prefix=prefix)
    store.enqueue("q", "{}")
    with store._reading() as conn:
        return int(read_version(conn, store.tables) or 0)


@pytest.mark.timeout(120)
def test_concurrent_first_connects_migrate_once(db_url: str) -> None:
    prefix = unique_prefix()
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        versions = pool.starmap(_open, [(db_url, prefix)] * 4)
    assert versions == [CURRENT_VERSION] * 4
    assert Store(db_url, table_prefix=prefix, auto_migrate=False).size("q") == 4
