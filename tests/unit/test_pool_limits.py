"""The URL parameters of the connection budget: pool_size, max_overflow, shared_pool and
application_name reach the engines (and never psycopg), bad values are refused."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from sqlease import ConfigurationError
from sqlease._db.postgresql import pooler
from sqlease._db.postgresql.engine import connect_args as postgresql_connect_args

BASE = "postgresql+psycopg://u@h/db"


def test_defaults_and_values() -> None:
    assert pooler.pool_limits(make_url(BASE)) == (pooler.POOL_SIZE, pooler.MAX_OVERFLOW)
    assert pooler.pool_limits(make_url(f"{BASE}?pool_size=2&max_overflow=2")) == (2, 2)
    clean, pooling = pooler.split(make_url(f"{BASE}?pool_size=2&max_overflow=3&shared_pool=on"))
    assert pooling.shared and dict(clean.query) == {}


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("pool_size=0", "pool_size"),
        ("pool_size=many", "pool_size"),
        ("max_overflow=-1", "max_overflow"),
        ("pool_size=1&max_overflow=2", "pool_size + max_overflow"),
        ("shared_pool=maybe", "shared_pool"),
    ],
)
def test_bad_values_are_refused_by_name(query: str, named: str) -> None:
    url = make_url(f"{BASE}?{query}")
    with pytest.raises(ConfigurationError, match=named.replace("+", r"\+")):
        pooler.pool_limits(url)
        pooler.split(url)


def test_the_urls_application_name_wins() -> None:
    assert postgresql_connect_args(make_url(BASE))["application_name"] == "sqlease"
    named = make_url(f"{BASE}?application_name=shop-worker")
    assert postgresql_connect_args(named)["application_name"] == "shop-worker"
