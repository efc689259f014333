"""The beat's settings, read from the Celery app's configuration and checked."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from celery import Celery

from sqlease.errors import ConfigurationError
from sqlease.schedules._specs import CATCH_UP

#: Celery settings sqlease's beat reads (besides ``beat_schedule``, ``beat_max_loop_interval``,
#: ``beat_cron_starting_deadline``, ``timezone`` and ``enable_utc``), with their defaults.
SETTINGS: dict[str, Any] = {
    # How long a leader's lease lasts; a standby takes over at most this long after the
    # leader's last renewal (renewed every third of it).
    "sqlease_beat_lease_seconds": 30.0,
    # What an entry does with slots missed while no beat ran: skip, once or all.
    "sqlease_beat_catch_up": "once",
    # The most missed slots "all" fires for one entry at a time.
    "sqlease_beat_catch_up_limit": 100,
    # How late a slot may be and still count as on time, fired whatever the catch-up policy
    # (default: twice the lease, so a takeover loses none of the slots it delayed).
    "sqlease_beat_grace_seconds": None,
    # The database of the entries; default: the broker's (beat sends through the broker).
    "sqlease_beat_url": None,
}


def _seconds(name: str, value: Any, *, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < minimum:
        raise ConfigurationError(f"{name} must be a number of seconds >= {minimum}, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class BeatOptions:
    lease_seconds: float
    catch_up: str
    catch_up_limit: int
    grace_seconds: float
    #: Celery's ``beat_cron_starting_deadline``: a crontab's missed slot older than this is
    #: not caught up (as Celery's own scheduler does).
    cron_deadline_seconds: float | None

    @property
    def lease_ms(self) -> int:
        return int(self.lease_seconds * 1000)

    @property
    def renew_every(self) -> float:
        return self.lease_seconds / 3

    @property
    def standby_poll(self) -> float:
        """How often a standby tries to take the lease over: a tenth of the lease, so it
        takes over within a tenth of the lease after the lease expires."""
        return min(max(self.lease_seconds / 10, 0.05), 5.0)


def beat_options(app: Celery) -> BeatOptions:
    conf = app.conf

    def get(key: str) -> Any:
        return conf.get(key, SETTINGS[key])

    lease = _seconds("sqlease_beat_lease_seconds", get("sqlease_beat_lease_seconds"), minimum=0.5)
    catch_up = get("sqlease_beat_catch_up")
    if catch_up not in CATCH_UP:
        raise ConfigurationError(
            f"sqlease_beat_catch_up must be one of {', '.join(CATCH_UP)}, not {catch_up!r}"
        )
    limit = get("sqlease_beat_catch_up_limit")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigurationError(
            f"sqlease_beat_catch_up_limit must be a positive integer, not {limit!r}"
        )
    grace = get("sqlease_beat_grace_seconds")
    grace = 2 * lease if grace is None else _seconds("sqlease_beat_grace_seconds", grace, minimum=0)
    deadline = conf.get("beat_cron_starting_deadline")
    if deadline is not None:
        deadline = _seconds("beat_cron_starting_deadline", deadline, minimum=0)
    return BeatOptions(lease, catch_up, limit, grace, deadline)
