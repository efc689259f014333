"""Transport options (``broker_transport_options``): parsed once, validated with clear errors.

Seconds are floats, as in Kombu's own options. Options that other brokers use (a Redis or SQS
``visibility_timeout``, ``fanout_prefix`` …) are ignored with a warning, so that an app moving
from those brokers works by changing only its URL.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlease._core.flow import check_limits, check_rates
from sqlease._db.tables import validate_prefix
from sqlease.errors import ConfigurationError

logger = logging.getLogger(__name__)

# Options Kombu or Celery themselves read from transport_options: accepted silently.
_GENERIC = frozenset(
    {
        "body_encoding",
        "max_retries",
        "interval_start",
        "interval_step",
        "interval_max",
        "confirm_publish",
        "client_properties",
        "connect_timeout",
    }
)
_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")


def _seconds(name: str, value: Any, *, minimum: float) -> float:
    if isinstance(value, bool):
        raise ConfigurationError(f"transport option {name!r} must be a number of seconds")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"transport option {name!r} must be a number of seconds, not {value!r}"
        ) from None
    if math.isnan(number) or math.isinf(number) or number < minimum:
        raise ConfigurationError(
            f"transport option {name!r} must be at least {minimum} seconds, not {value!r}"
        )
    return number


def _integer(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigurationError(f"transport option {name!r} must be an integer, not {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ConfigurationError(
            f"transport option {name!r} must be an integer, not {value!r}"
        ) from None
    if number < minimum:
        raise ConfigurationError(f"transport option {name!r} must be >= {minimum}, not {value!r}")
    return number


def _boolean(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in (
        "1",
        "true",
        "yes",
        "on",
        "0",
        "false",
        "no",
        "off",
    ):
        return value.lower() in ("1", "true", "yes", "on")
    raise ConfigurationError(f"transport option {name!r} must be true or false, not {value!r}")


@dataclass(frozen=True)
class TransportOptions:
    """The transport options (docs/reference/transport-options.md), with their defaults."""

    #: How long a delivery is held without a heartbeat before another worker may take it over.
    lease_seconds: float = 60.0
    #: How often this process renews every lease it holds (default: a third of the lease).
    heartbeat_interval: float | None = None
    #: Deliveries before a message is failed ``attempts_exhausted``.
    max_attempts: int = 3
    #: The safety poll: the longest an idle worker goes without looking for work.
    polling_interval: float = 1.0
    #: Prefix of every table (and of the PostgreSQL notification channel).
    table_prefix: str = "sqlease_"
    #: Create or upgrade the schema at first connect.
    auto_migrate: bool = True
    #: Largest message accepted at publish (bytes of the stored message).
    max_payload_bytes: int = 16 * 1024 * 1024
    #: SQLite ``PRAGMA synchronous`` (WAL mode): NORMAL survives any process crash.
    sqlite_synchronous: str = "NORMAL"
    #: Seconds between maintenance passes in each worker (0 turns them off).
    maintenance_interval: float = 60.0
    #: Days to keep events, checkpoints and answers of finished tasks (0 keeps them forever).
    event_retention_days: float = 30.0
    #: Days to keep dead messages and the FAILURE/REVOKED results sqlease writes without an
    #: expiry (None: event_retention_days; 0 keeps them forever).
    dead_retention_days: float | None = None
    #: Seconds an auto-delete queue (auto_delete, exclusive or x-expires: Celery's reply,
    #: event and remote-control queues) lives on after its last declaration or consumer
    #: (the longer of this and its own x-expires); its live consumers keep it.
    idle_queue_expiry: float = 600.0
    #: PostgreSQL: an idle worker offers to take its queues' next message, and a publish that
    #: finds the offer leases the message to it in the same statement (no claim round trip).
    handoff: bool = True
    #: PostgreSQL: claims and acks wait for their commit to reach the disk, as publishes,
    #: results and checkpoints always do. Off by default: a claim or ack lost with the
    #: database server (never with a worker) only redelivers its message.
    lease_sync_commit: bool = False
    #: PostgreSQL: a publish (``delay()``, ``apply_async``) returns once its commit is on
    #: disk. Off, it returns once committed in the server's memory, before the WAL flush: a
    #: crash of the database server (never of a worker or a producer) can then lose the last
    #: few hundred milliseconds of publishes, as Redis's and RabbitMQ's defaults can.
    publish_sync_commit: bool = True
    #: Concurrency limits per task name and per queue, cluster-wide:
    #: ``{"queue:images": 4, "task:app.resize": 2}``. A consuming worker writes them to the
    #: database at start (replacing the ones there); ``None`` leaves the database's as they are.
    concurrency_limits: dict[str, int] | None = None
    #: Rate limits per task name, queue or concurrency key, cluster-wide, in Celery's rate
    #: syntax: ``{"task:app.call_api": "100/m", "queue:mail": "10/s"}``. Written at a
    #: consuming worker's start as ``concurrency_limits`` are.
    rate_limits: dict[str, str] | None = None
    #: Each task's own ``rate_limit`` (``@app.task(rate_limit="10/m")``) holds across the
    #: cluster, enforced at claim time, instead of per worker.
    cluster_rate_limits: bool = False

    @property
    def lease_ms(self) -> int:
        return int(self.lease_seconds * 1000)

    @property
    def event_retention_ms(self) -> int:
        return int(self.event_retention_days * 86_400_000)

    @property
    def dead_retention_ms(self) -> int:
        days = (
            self.event_retention_days
            if self.dead_retention_days is None
            else (self.dead_retention_days)
        )
        return int(days * 86_400_000)

    def queue_expiry_ms(self, auto_delete: bool, arguments: Mapping[str, Any] | None) -> int | None:
        """The idle expiry of a queue declared so (None: it stays until deleted)."""
        expires = (arguments or {}).get("x-expires")
        if not auto_delete and expires is None:
            return None
        floor = int(self.idle_queue_expiry * 1000)
        try:
            return max(floor, int(expires or 0))
        except (TypeError, ValueError):
            return floor

    @property
    def queue_touch_seconds(self) -> float:
        """How often a consumer pushes its auto-delete queues' expiry forward: five times
        per expiry, at least once a minute."""
        return min(60.0, self.idle_queue_expiry / 5.0)

    @property
    def heartbeat_seconds(self) -> float:
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        return self.lease_seconds / 3.0

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> TransportOptions:
        raw = dict(raw or {})
        values: dict[str, Any] = {}
        if "lease_seconds" in raw:
            values["lease_seconds"] = _seconds(
                "lease_seconds", raw.pop("lease_seconds"), minimum=0.05
            )
        if "heartbeat_interval" in raw:
            value = raw.pop("heartbeat_interval")
            if value is not None:
                values["heartbeat_interval"] = _seconds("heartbeat_interval", value, minimum=0.01)
        if "max_attempts" in raw:
            values["max_attempts"] = _integer("max_attempts", raw.pop("max_attempts"), minimum=1)
        if "polling_interval" in raw:
            value = raw.pop("polling_interval")
            if value is not None:
                values["polling_interval"] = _seconds("polling_interval", value, minimum=0.001)
        if "table_prefix" in raw:
            values["table_prefix"] = validate_prefix(raw.pop("table_prefix"))
        if "auto_migrate" in raw:
            values["auto_migrate"] = _boolean("auto_migrate", raw.pop("auto_migrate"))
        if "max_payload_bytes" in raw:
            values["max_payload_bytes"] = _integer(
                "max_payload_bytes", raw.pop("max_payload_bytes"), minimum=1
            )
        if "sqlite_synchronous" in raw:
            sync = str(raw.pop("sqlite_synchronous")).upper()
            if sync not in _SYNCHRONOUS:
                raise ConfigurationError(
                    f"transport option 'sqlite_synchronous' must be one of {_SYNCHRONOUS}, "
                    f"not {sync!r}"
                )
            values["sqlite_synchronous"] = sync
        if "maintenance_interval" in raw:
            values["maintenance_interval"] = _seconds(
                "maintenance_interval", raw.pop("maintenance_interval"), minimum=0.0
            )
        if "event_retention_days" in raw:
            values["event_retention_days"] = _seconds(
                "event_retention_days", raw.pop("event_retention_days"), minimum=0.0
            )
        if "dead_retention_days" in raw:
            value = raw.pop("dead_retention_days")
            if value is not None:
                values["dead_retention_days"] = _seconds("dead_retention_days", value, minimum=0.0)
        if "idle_queue_expiry" in raw:
            values["idle_queue_expiry"] = _seconds(
                "idle_queue_expiry", raw.pop("idle_queue_expiry"), minimum=1.0
            )
        if "handoff" in raw:
            values["handoff"] = _boolean("handoff", raw.pop("handoff"))
        if "lease_sync_commit" in raw:
            values["lease_sync_commit"] = _boolean(
                "lease_sync_commit", raw.pop("lease_sync_commit")
            )
        if "publish_sync_commit" in raw:
            values["publish_sync_commit"] = _boolean(
                "publish_sync_commit", raw.pop("publish_sync_commit")
            )
        if "concurrency_limits" in raw:
            value = raw.pop("concurrency_limits")
            if value is not None:
                values["concurrency_limits"] = check_limits(value)
        if "rate_limits" in raw:
            value = raw.pop("rate_limits")
            if value is not None:
                values["rate_limits"] = {n: text for n, (text, _) in check_rates(value).items()}
        if "cluster_rate_limits" in raw:
            values["cluster_rate_limits"] = _boolean(
                "cluster_rate_limits", raw.pop("cluster_rate_limits")
            )
        options = cls(**values)
        if options.heartbeat_seconds >= options.lease_seconds:
            raise ConfigurationError(
                f"heartbeat_interval ({options.heartbeat_seconds}s) must be shorter than "
                f"lease_seconds ({options.lease_seconds}s), or leases expire between heartbeats"
            )
        unknown = sorted(set(raw) - _GENERIC)
        if "visibility_timeout" in unknown:
            logger.warning(
                "transport option 'visibility_timeout' is a Redis/SQS setting and is ignored: "
                "sqlease holds deliveries by a renewed lease (lease_seconds=%s)",
                options.lease_seconds,
            )
            unknown.remove("visibility_timeout")
        if unknown:
            logger.warning("sqlease ignores unknown transport options: %s", ", ".join(unknown))
        return options
