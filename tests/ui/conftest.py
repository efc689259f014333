"""The dashboard's fixtures: an app over the test's store (both databases) and a client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from sqlease import Admin, Store
from sqlease.ui import create_app

from .helpers import TOKEN


@pytest.fixture
def admin(store: Store) -> Admin:
    return Admin("unused", store=store)


@pytest.fixture
def client(admin: Admin) -> Iterator[TestClient]:
    with TestClient(create_app(admin, token=TOKEN)) as c:
        yield c
