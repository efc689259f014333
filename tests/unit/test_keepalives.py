"""Every PostgreSQL connection sqlease opens notices a dead network within about a lease: TCP
keepalives and ``tcp_user_timeout`` from the lease, each overridable in the URL (checked: a bad
value names its parameter). No server needed: the arguments psycopg is given."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from sqlease._db.postgresql.engine import connect_args, keepalive_args
from sqlease._db.postgresql.listener import PostgresListener
from sqlease.errors import ConfigurationError

BASE = "postgresql+psycopg://app@db/shop"


def test_from_the_lease() -> None:
    assert keepalive_args(make_url(BASE), 60_000) == {
        "keepalives": 1,
        "keepalives_idle": 20,
        "keepalives_interval": 6,
        "keepalives_count": 3,
        "tcp_user_timeout": 60_000,
    }
    # A short lease: whole seconds of at least 1 (libpq's unit), the timeout in milliseconds.
    short = keepalive_args(make_url(BASE), 3_000)
    assert short["keepalives_idle"] == 1 and short["keepalives_interval"] == 1
    assert short["tcp_user_timeout"] == 3_000


def test_the_engines_and_the_listener_get_them() -> None:
    args = connect_args(make_url(BASE), lease_ms=9_000)
    assert args["tcp_user_timeout"] == 9_000 and args["keepalives_idle"] == 3
    assert connect_args(make_url(BASE))["tcp_user_timeout"] == 60_000  # the default lease
    listener = PostgresListener(make_url(BASE), "ch", lease_ms=9_000)
    assert listener._connect_args["tcp_user_timeout"] == 9_000


def test_the_url_overrides_each_one() -> None:
    url = make_url(f"{BASE}?keepalives_idle=120&tcp_user_timeout=0")
    args = connect_args(url, lease_ms=3_000)
    # Left to the URL (psycopg reads them from it), the others still from the lease.
    assert "keepalives_idle" not in args and "tcp_user_timeout" not in args
    assert args["keepalives_interval"] == 1 and args["keepalives"] == 1


@pytest.mark.parametrize("name", ["keepalives_idle", "tcp_user_timeout", "keepalives_count"])
def test_a_bad_value_names_its_parameter(name: str) -> None:
    with pytest.raises(ConfigurationError, match=f"URL parameter '{name}'.*'soon'"):
        connect_args(make_url(f"{BASE}?{name}=soon"))


def test_a_transaction_left_idle_ends_with_about_a_lease() -> None:
    """A worker stopped or cut off mid-transaction holds the rows it locked (a message it was
    checkpointing: every other worker's claim skips it) until the server ends the
    transaction: with the lease, at most 60 s."""
    from sqlease._db.postgresql.engine import DEFAULT_LEASE_MS, SESSION_OPTIONS, session_options

    def idle(lease_ms: int) -> str:
        options = connect_args(make_url(BASE), lease_ms=lease_ms)["options"]
        [value] = [o for o in options.split() if o.startswith("idle_in_transaction")]
        return value.split("=")[1]

    assert idle(20_000) == "20000"
    assert idle(3_000) == "3000"
    assert idle(200) == "1000"  # PostgreSQL's own unit is the millisecond; a floor of 1 s
    assert idle(600_000) == "60000"
    assert session_options(DEFAULT_LEASE_MS) == SESSION_OPTIONS
    assert "-c jit=off" in session_options(3_000)


def test_a_lease_past_the_kernels_largest_keepalive_gets_the_largest() -> None:
    """Linux refuses TCP_KEEPIDLE past 32,767 s (a third of a lease over 27 hours), and every
    connection failed: the kernel's largest is given instead; a URL's own value past it is
    named."""
    args = keepalive_args(make_url(BASE), 30 * 86_400_000)  # a 30-day lease
    assert args["keepalives_idle"] == 32_767 and args["keepalives_interval"] == 32_767
    assert args["tcp_user_timeout"] == 2**31 - 1
    with pytest.raises(ConfigurationError, match="'keepalives_idle' must be at most 32767"):
        connect_args(make_url(f"{BASE}?keepalives_idle=40000"))
