"""``TransportOptions.parse``: every option's accepted forms, its default, and the error a bad
value gets (naming the option and the value). No database."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

from sqlease.errors import ConfigurationError
from sqlease.options import TransportOptions

SYNC = "('OFF', 'NORMAL', 'FULL', 'EXTRA')"
PREFIX = "use letters, digits and underscores, starting with a letter or underscore, at most 41 "


def _message(option: str, text: str) -> str:
    return f"transport option {option!r} must be {text}"


BAD: list[tuple[str, Any, str]] = [
    ("lease_seconds", "soon", _message("lease_seconds", "a number of seconds, not 'soon'")),
    ("lease_seconds", -1, _message("lease_seconds", "at least 0.05 seconds, not -1")),
    ("lease_seconds", 0.01, _message("lease_seconds", "at least 0.05 seconds, not 0.01")),
    ("lease_seconds", float("nan"), _message("lease_seconds", "at least 0.05 seconds, not nan")),
    ("lease_seconds", float("inf"), _message("lease_seconds", "at least 0.05 seconds, not inf")),
    ("lease_seconds", True, _message("lease_seconds", "a number of seconds, not True")),
    ("lease_seconds", None, _message("lease_seconds", "a number of seconds, not None")),
    ("heartbeat_interval", "x", _message("heartbeat_interval", "a number of seconds, not 'x'")),
    (
        "heartbeat_interval",
        0.001,
        _message("heartbeat_interval", "at least 0.01 seconds, not 0.001"),
    ),
    ("max_attempts", 0, _message("max_attempts", ">= 1, not 0")),
    ("max_attempts", 1.5, _message("max_attempts", "an integer, not 1.5")),
    ("max_attempts", "three", _message("max_attempts", "an integer, not 'three'")),
    ("max_attempts", True, _message("max_attempts", "an integer, not True")),
    ("max_attempts", None, _message("max_attempts", "an integer, not None")),
    ("polling_interval", "x", _message("polling_interval", "a number of seconds, not 'x'")),
    ("polling_interval", 0, _message("polling_interval", "at least 0.001 seconds, not 0")),
    # Times are counted in milliseconds in 64 bits, counts in PostgreSQL's integer.
    (
        "polling_interval",
        1e300,
        _message("polling_interval", "at most 1000000000 seconds, not 1e+300"),
    ),
    ("max_attempts", 2**31, _message("max_attempts", "at most 2147483647, not 2147483648")),
    (
        "table_prefix",
        "bad prefix;",
        f"table_prefix 'bad prefix;' is not usable: {PREFIX}characters",
    ),
    ("table_prefix", None, f"table_prefix None is not usable: {PREFIX}characters"),
    ("auto_migrate", "maybe", _message("auto_migrate", "true or false, not 'maybe'")),
    ("auto_migrate", 1, _message("auto_migrate", "true or false, not 1")),
    ("auto_migrate", None, _message("auto_migrate", "true or false, not None")),
    ("max_payload_bytes", 0, _message("max_payload_bytes", ">= 1, not 0")),
    ("max_payload_bytes", "big", _message("max_payload_bytes", "an integer, not 'big'")),
    ("sqlite_synchronous", "fast", _message("sqlite_synchronous", f"one of {SYNC}, not 'FAST'")),
    ("sqlite_synchronous", None, _message("sqlite_synchronous", f"one of {SYNC}, not 'NONE'")),
    ("maintenance_interval", -1, _message("maintenance_interval", "at least 0.0 seconds, not -1")),
    (
        "maintenance_interval",
        "often",
        _message("maintenance_interval", "a number of seconds, not 'often'"),
    ),
    (
        "maintenance_interval",
        None,
        _message("maintenance_interval", "a number of seconds, not None"),
    ),
    ("event_retention_days", -1, _message("event_retention_days", "at least 0.0 days, not -1")),
    (
        "event_retention_days",
        "week",
        _message("event_retention_days", "a number of days, not 'week'"),
    ),
    ("dead_retention_days", -0.5, _message("dead_retention_days", "at least 0.0 days, not -0.5")),
    ("dead_retention_days", "x", _message("dead_retention_days", "a number of days, not 'x'")),
    ("idle_queue_expiry", 0.5, _message("idle_queue_expiry", "at least 1.0 seconds, not 0.5")),
    ("idle_queue_expiry", None, _message("idle_queue_expiry", "a number of seconds, not None")),
    ("handoff", "perhaps", _message("handoff", "true or false, not 'perhaps'")),
    ("loop_statements", "perhaps", _message("loop_statements", "true or false, not 'perhaps'")),
    ("lease_sync_commit", 2, _message("lease_sync_commit", "true or false, not 2")),
    ("publish_sync_commit", "later", _message("publish_sync_commit", "true or false, not 'later'")),
    ("cluster_rate_limits", "both", _message("cluster_rate_limits", "true or false, not 'both'")),
    (
        "interrupt_on_lease_lost",
        "maybe",
        _message("interrupt_on_lease_lost", "true or false, not 'maybe'"),
    ),
    (
        "concurrency_limits",
        ["queue:a"],
        "concurrency_limits must be a mapping such as {'queue:images': 4, "
        "'task:app.resize': 2}, not ['queue:a']",
    ),
    (
        "concurrency_limits",
        {"image": 2},
        "concurrency_limits key 'image' must be 'task:<task name>' or 'queue:<queue name>'",
    ),
    (
        "concurrency_limits",
        {"queue:a": 0},
        "concurrency_limits['queue:a'] must be an integer >= 1, not 0",
    ),
    (
        "rate_limits",
        "100/m",
        "rate_limits must be a mapping such as {'task:app.call_api': '100/m'}, not '100/m'",
    ),
    (
        "rate_limits",
        {"task": "1/s"},
        "rate_limits key 'task' must be 'task:<task name>', 'queue:<queue name>' or "
        "'key:<concurrency key>'",
    ),
    (
        "rate_limits",
        {"task:a": "fast"},
        "rate_limits['task:a'] must be a rate such as '100/m', '10/s' or '5/h', not 'fast'",
    ),
]


@pytest.mark.parametrize(("option", "value", "message"), BAD)
def test_a_bad_value_names_the_option_and_the_value(option: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigurationError) as excinfo:
        TransportOptions.parse({option: value})
    assert str(excinfo.value) == message


def test_every_option_has_a_bad_value_case() -> None:
    tested = {option for option, _, _ in BAD}
    assert tested == {f.name for f in dataclasses.fields(TransportOptions)}


def test_defaults() -> None:
    options = TransportOptions.parse(None)
    assert options == TransportOptions()
    assert (options.lease_seconds, options.heartbeat_seconds, options.max_attempts) == (60, 20, 3)
    assert (options.polling_interval, options.table_prefix, options.sqlite_synchronous) == (
        1.0,
        "sqlease_",
        "NORMAL",
    )
    assert options.dead_retention_ms == options.event_retention_ms == 30 * 86_400_000


def test_none_keeps_the_default_where_the_option_allows_it() -> None:
    options = TransportOptions.parse(
        {
            "heartbeat_interval": None,
            "polling_interval": None,
            "dead_retention_days": None,
            "concurrency_limits": None,
            "rate_limits": None,
        }
    )
    assert options == TransportOptions()


def test_values_are_converted() -> None:
    options = TransportOptions.parse(
        {
            "lease_seconds": "30",
            "heartbeat_interval": 5,
            "max_attempts": "5",
            "polling_interval": "0.5",
            "table_prefix": "app_",
            "auto_migrate": "off",
            "max_payload_bytes": 1024,
            "sqlite_synchronous": "full",
            "maintenance_interval": 0,
            "event_retention_days": "7",
            "dead_retention_days": 1,
            "idle_queue_expiry": 60,
            "handoff": "no",
            "lease_sync_commit": "yes",
            "publish_sync_commit": "0",
            "concurrency_limits": {"queue:q": 3},
            "rate_limits": {"task:a": "10/m"},
            "cluster_rate_limits": True,
        }
    )
    assert options == TransportOptions(
        lease_seconds=30.0,
        heartbeat_interval=5.0,
        max_attempts=5,
        polling_interval=0.5,
        table_prefix="app_",
        auto_migrate=False,
        max_payload_bytes=1024,
        sqlite_synchronous="FULL",
        maintenance_interval=0.0,
        event_retention_days=7.0,
        dead_retention_days=1.0,
        idle_queue_expiry=60.0,
        handoff=False,
        lease_sync_commit=True,
        publish_sync_commit=False,
        concurrency_limits={"queue:q": 3},
        rate_limits={"task:a": "10/m"},
        cluster_rate_limits=True,
    )
    assert isinstance(options.lease_seconds, float) and isinstance(options.max_attempts, int)


def test_the_heartbeat_must_be_shorter_than_the_lease() -> None:
    with pytest.raises(ConfigurationError) as excinfo:
        TransportOptions.parse({"lease_seconds": 1, "heartbeat_interval": 5})
    assert str(excinfo.value) == (
        "heartbeat_interval (5.0s) must be shorter than lease_seconds (1.0s) less its "
        "lease-clock margin (0.890s), or leases run out between heartbeats"
    )
    # Shorter than the lease is not enough: the lease clock runs out 0.85 s before it.
    with pytest.raises(ConfigurationError, match=r"less its lease-clock margin \(59.150s\)"):
        TransportOptions.parse({"heartbeat_interval": 59.5})
    assert TransportOptions.parse({"lease_seconds": 3}).heartbeat_seconds == 1.0


def test_other_brokers_options_are_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="sqlease.options"):
        options = TransportOptions.parse(
            {"visibility_timeout": 3600, "fanout_prefix": True, "max_retries": 3, "zzz": 1}
        )
    assert options == TransportOptions()
    messages = [r.getMessage() for r in caplog.records]
    assert any("'visibility_timeout' is a Redis/SQS setting" in m for m in messages)
    assert "sqlease ignores unknown transport options: fanout_prefix, zzz" in messages
    assert not any("max_retries" in m for m in messages)  # Kombu's own: accepted silently


def test_the_callers_mapping_is_left_alone() -> None:
    raw = {"lease_seconds": 30, "visibility_timeout": 10}
    TransportOptions.parse(raw)
    assert raw == {"lease_seconds": 30, "visibility_timeout": 10}
