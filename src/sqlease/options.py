"""Transport options (``broker_transport_options``): parsed once, validated with clear errors.

Seconds are floats, as in Kombu's own options. Options that other brokers use (a Redis or SQS
``visibility_timeout``, ``fanout_prefix`` …) are ignored with a warning, so that an app moving
from those brokers works by changing only its URL.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from sqlease._core.flow import check_limits, check_rates
from sqlease._core.lease_clock import margin_seconds
from sqlease._core.names import MAX_INT
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


#: A parser takes the option's name and its raw value, and returns the value to keep or raises
#: ConfigurationError naming the option and the value.
Parser = Callable[[str, Any], Any]


#: The largest number an option takes (31 years of seconds: times are counted in milliseconds
#: in 64 bits); the largest integer is PostgreSQL's (``MAX_INT``).
MAX_NUMBER = 1e9


def _number(minimum: float, unit: str = "seconds") -> Parser:
    """A float of at least ``minimum`` (a string of one is fine, a bool is not)."""

    def parse(name: str, value: Any) -> float:
        if isinstance(value, bool):
            raise ConfigurationError(
                f"transport option {name!r} must be a number of {unit}, not {value!r}"
            )
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"transport option {name!r} must be a number of {unit}, not {value!r}"
            ) from None
        if math.isnan(number) or math.isinf(number) or number < minimum:
            raise ConfigurationError(
                f"transport option {name!r} must be at least {minimum} {unit}, not {value!r}"
            )
        if number > MAX_NUMBER:
            raise ConfigurationError(
                f"transport option {name!r} must be at most {MAX_NUMBER:.0f} {unit}, not {value!r}"
            )
        return number

    return parse


def _integer(minimum: int) -> Parser:
    """An int of at least ``minimum`` (a string of one is fine, a float or a bool is not)."""

    def parse(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigurationError(f"transport option {name!r} must be an integer, not {value!r}")
        try:
            number = int(value)
        except ValueError:
            raise ConfigurationError(
                f"transport option {name!r} must be an integer, not {value!r}"
            ) from None
        if number < minimum:
            raise ConfigurationError(
                f"transport option {name!r} must be >= {minimum}, not {value!r}"
            )
        if number > MAX_INT:
            raise ConfigurationError(
                f"transport option {name!r} must be at most {MAX_INT}, not {value!r}"
            )
        return number

    return parse


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_boolean(name: str, value: Any) -> bool:
    """A boolean option's value: a bool, or one of the strings true/false/yes/no/on/off/1/0
    (ConfigurationError naming ``name`` otherwise)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    raise ConfigurationError(f"transport option {name!r} must be true or false, not {value!r}")


_boolean = parse_boolean


def _prefix(name: str, value: Any) -> str:
    return validate_prefix(value)  # its error names table_prefix and the value


def _synchronous(name: str, value: Any) -> str:
    sync = str(value).upper()
    if sync not in _SYNCHRONOUS:
        raise ConfigurationError(
            f"transport option {name!r} must be one of {_SYNCHRONOUS}, not {sync!r}"
        )
    return sync


def _limits(name: str, value: Any) -> dict[str, int]:
    return check_limits(value)  # its errors name concurrency_limits, the key and the value


def _rates(name: str, value: Any) -> dict[str, str]:
    # Checked, then kept as written ("100/m"): the worker parses them again as it stores them.
    return {n: text for n, (text, _) in check_rates(value).items()}


def _row(parse: Parser, doc: str, *, none_keeps_default: bool = False) -> dict[str, Any]:
    """The rest of an option's row, beside its field's name, type and default: the parser that
    checks a raw value and what the option means. ``none_keeps_default``: an explicit None is
    taken as not given (otherwise the parser sees it, and refuses it)."""
    return {"parse": parse, "doc": doc, "none_keeps_default": none_keeps_default}


@dataclass(frozen=True)
class TransportOptions:
    """The transport options (docs/reference/transport-options.md), with their defaults.

    The fields are the table of options: ``parse`` reads each one the user gave with the
    field's parser, in this order."""

    lease_seconds: float = field(
        default=60.0,
        metadata=_row(
            _number(0.05),
            "How long a delivery is held without a heartbeat before another worker may take "
            "it over.",
        ),
    )
    heartbeat_interval: float | None = field(
        default=None,
        metadata=_row(
            _number(0.01),
            "How often this process renews every lease it holds (default: a third of the lease).",
            none_keeps_default=True,
        ),
    )
    max_attempts: int = field(
        default=3,
        metadata=_row(_integer(1), "Deliveries before a message is failed ``attempts_exhausted``."),
    )
    polling_interval: float = field(
        default=1.0,
        metadata=_row(
            _number(0.001),
            "The safety poll: the longest an idle worker goes without looking for work.",
            none_keeps_default=True,
        ),
    )
    table_prefix: str = field(
        default="sqlease_",
        metadata=_row(
            _prefix, "Prefix of every table (and of the PostgreSQL notification channel)."
        ),
    )
    auto_migrate: bool = field(
        default=True,
        metadata=_row(_boolean, "Create or upgrade the schema at first connect."),
    )
    max_payload_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata=_row(
            _integer(1), "Largest message accepted at publish (bytes of the stored message)."
        ),
    )
    sqlite_synchronous: str = field(
        default="NORMAL",
        metadata=_row(
            _synchronous,
            "SQLite ``PRAGMA synchronous`` (WAL mode): NORMAL survives any process crash.",
        ),
    )
    maintenance_interval: float = field(
        default=60.0,
        metadata=_row(
            _number(0.0), "Seconds between maintenance passes in each worker (0 turns them off)."
        ),
    )
    event_retention_days: float = field(
        default=30.0,
        metadata=_row(
            _number(0.0, "days"),
            "Days to keep events, checkpoints and answers of finished tasks (0 keeps them "
            "forever).",
        ),
    )
    dead_retention_days: float | None = field(
        default=None,
        metadata=_row(
            _number(0.0, "days"),
            "Days to keep dead messages and the FAILURE/REVOKED results sqlease writes without an "
            "expiry (None: event_retention_days; 0 keeps them forever).",
            none_keeps_default=True,
        ),
    )
    idle_queue_expiry: float = field(
        default=600.0,
        metadata=_row(
            _number(1.0),
            "Seconds an auto-delete queue (auto_delete, exclusive or x-expires: Celery's reply, "
            "event and remote-control queues) lives on after its last declaration or consumer "
            "(the longer of this and its own x-expires); its live consumers keep it.",
        ),
    )
    handoff: bool = field(
        default=True,
        metadata=_row(
            _boolean,
            "PostgreSQL: an idle worker offers to take its queues' next message, and a publish "
            "that finds the offer leases the message to it in the same statement (no claim round "
            "trip).",
        ),
    )
    loop_statements: bool = field(
        default=True,
        metadata=_row(
            _boolean,
            "PostgreSQL: a worker's event loop sends its claims and acks itself and reads their "
            "rows when they arrive; False hands them to a thread instead.",
        ),
    )
    lease_sync_commit: bool = field(
        default=False,
        metadata=_row(
            _boolean,
            "PostgreSQL: claims and acks wait for their commit to reach the disk, as publishes, "
            "results and checkpoints always do. Off by default: a claim or ack lost with the "
            "database server (never with a worker) only redelivers its message.",
        ),
    )
    publish_sync_commit: bool = field(
        default=True,
        metadata=_row(
            _boolean,
            "PostgreSQL: a publish (``delay()``, ``apply_async``) returns once its commit is on "
            "disk. Off, it returns once committed in the server's memory, before the WAL flush: a "
            "crash of the database server (never of a worker or a producer) can then lose the last "
            "few hundred milliseconds of publishes, as Redis's and RabbitMQ's defaults can.",
        ),
    )
    concurrency_limits: dict[str, int] | None = field(
        default=None,
        metadata=_row(
            _limits,
            "Concurrency limits per task name and per queue, cluster-wide: "
            '``{"queue:images": 4, "task:app.resize": 2}``. A consuming worker writes them to the '
            "database at start (replacing the ones there); None leaves the database's as they are.",
            none_keeps_default=True,
        ),
    )
    rate_limits: dict[str, str] | None = field(
        default=None,
        metadata=_row(
            _rates,
            "Rate limits per task name, queue or concurrency key, cluster-wide, in Celery's rate "
            'syntax: ``{"task:app.call_api": "100/m", "queue:mail": "10/s"}``. Written at a '
            "consuming worker's start as concurrency_limits are.",
            none_keeps_default=True,
        ),
    )
    interrupt_on_lease_lost: bool = field(
        default=False,
        metadata=_row(
            _boolean,
            "Raise ``LeaseLost`` inside a running task as soon as its lease is known lost (its "
            "lease clock ran out, or its renewal was refused), as Celery's soft time limit "
            "does, so that a task that never checkpoints stops too. A task's own "
            "``interrupt_on_lease_lost`` option wins.",
        ),
    )
    cluster_rate_limits: bool = field(
        default=False,
        metadata=_row(
            _boolean,
            'Each task\'s own ``rate_limit`` (``@app.task(rate_limit="10/m")``) holds across the '
            "cluster, enforced at claim time, instead of per worker.",
        ),
    )

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
        """The options ``raw`` gives, each checked by its field's parser (ConfigurationError
        naming the option and the value); the rest keep their defaults. Kombu's own options
        pass silently, other brokers' and unknown ones with a warning."""
        raw = dict(raw or {})
        values: dict[str, Any] = {}
        for option in fields(cls):
            if option.name not in raw:
                continue
            value = raw.pop(option.name)
            if value is None and option.metadata["none_keeps_default"]:
                continue
            values[option.name] = option.metadata["parse"](option.name, value)
        options = cls(**values)
        usable = options.lease_seconds - margin_seconds(options.lease_seconds)
        if options.heartbeat_seconds >= usable:
            # The lease clock runs out at the lease less its margin, counted from the last
            # confirmed renewal: a heartbeat any slower loses every lease it holds.
            raise ConfigurationError(
                f"heartbeat_interval ({options.heartbeat_seconds}s) must be shorter than "
                f"lease_seconds ({options.lease_seconds}s) less its lease-clock margin "
                f"({usable:.3f}s), or leases run out between heartbeats"
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
