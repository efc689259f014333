"""What a PostgreSQL URL says about a pooler, and what psycopg is then given."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from sqlease._db.postgresql.engine import connect_args as postgresql_connect_args
from sqlease._db.postgresql.pooler import split
from sqlease.errors import ConfigurationError

BASE = "postgresql+psycopg://app@bouncer:6432/shop"


def test_without_a_pooler_the_session_settings_go_out_as_startup_options() -> None:
    args = postgresql_connect_args(make_url(BASE))
    assert "idle_in_transaction_session_timeout=60000" in args["options"]
    assert "prepare_threshold" not in args  # psycopg's own default


def test_behind_a_transaction_pooler_nothing_session_scoped_goes_out() -> None:
    url = make_url(f"{BASE}?pooler=transaction&sslmode=require")
    clean, pooling = split(url)
    assert pooling.transaction and pooling.listen_url is None
    assert dict(clean.query) == {"sslmode": "require"}  # ours removed, libpq's kept
    args = postgresql_connect_args(url, generic_plans=True, wait_for_flush=False)
    assert "options" not in args and args["prepare_threshold"] is None


def test_the_users_own_options_still_go_out_behind_a_pooler() -> None:
    args = postgresql_connect_args(
        make_url(f"{BASE}?pgbouncer=true&options=-c%20search_path%3Dapp")
    )
    assert args["options"] == "-c search_path=app"


def test_a_direct_listen_connection() -> None:
    _, pooling = split(make_url(f"{BASE}?pooler=transaction&listen_port=5432&listen_host=db"))
    assert pooling.listen_url is not None
    assert (pooling.listen_url.host, pooling.listen_url.port) == ("db", 5432)
    assert "listen_port" not in pooling.listen_url.query
    _, only_port = split(make_url(f"{BASE}?pooler=transaction&listen_port=5432"))
    assert only_port.listen_url is not None and only_port.listen_url.host == "bouncer"


@pytest.mark.parametrize(("query", "expected"), [("0", 0), ("7", 7), ("none", None)])
def test_prepare_threshold_is_typed(query: str, expected: int | None) -> None:
    args = postgresql_connect_args(make_url(f"{BASE}?prepare_threshold={query}"))
    assert args["prepare_threshold"] == expected


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("prepare_threshold=often", "prepare_threshold"),
        ("prepare_threshold=-2", "prepare_threshold"),
        ("pooler=statement", "pooler"),
        ("pgbouncer=perhaps", "pgbouncer"),
        ("pgbouncer=true&pooler=session", "disagree"),
        ("pooler=transaction&listen_port=abc", "listen_port"),
        ("pooler=transaction&prepare_threshold=3", "prepare_threshold"),
    ],
)
def test_bad_parameters_are_named(query: str, named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        split(make_url(f"{BASE}?{query}"))
