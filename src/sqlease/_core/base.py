"""What every aggregate of the lease store is given: the driver, the clock and the limits.

The store's aggregates (messages, leases, transitions, offers, tasks, timeline, topology,
flow limits, uniques) are objects of their own, each built on one :class:`StoreParts`;
``sqlease._core.store.Store`` composes them and delegates its public methods to them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from sqlease._db.driver import Driver
from sqlease._db.retry import transient

Clock = Callable[[], int]
P = ParamSpec("P")
R = TypeVar("R")


def dump(data: Any) -> str | None:
    return None if data is None else json.dumps(data, sort_keys=True, default=str)


class StoreParts:
    """One store's driver, clock and limits, shared by its aggregates."""

    def __init__(
        self, driver: Driver, *, clock: Clock | None, max_attempts: int, max_payload_bytes: int
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.max_attempts = max_attempts
        self.max_payload_bytes = max_payload_bytes

    def now(self, now: int | None) -> int | None:
        """``now`` if given, else the clock's time, else None (the database's clock)."""
        if now is not None:
            return int(now)
        return None if self.clock is None else int(self.clock())

    @transient
    def now_ms(self) -> int:
        """The time the store compares leases against (the clock, else the database's)."""
        if self.clock is not None:
            return int(self.clock())
        with self.driver.reading() as conn:
            value = conn.execute(self.driver.sql.now, {"now": None}).scalar_one()
        return int(value)


class Aggregate:
    """One aggregate of the store, on the store's parts."""

    def __init__(self, parts: StoreParts) -> None:
        self.parts = parts
        self.driver = parts.driver
        self.sql = parts.driver.sql
        self.tables = parts.driver.tables

    def _now(self, now: int | None) -> int | None:
        return self.parts.now(now)


def delegate(
    part: str, method: Callable[Concatenate[Any, P], R]
) -> Callable[Concatenate[Any, P], R]:
    """A facade's method that calls ``method`` on its aggregate ``part`` (an attribute of the
    facade): same signature and docs, so the facade's public API is written once, where the
    aggregate implements it."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        found: R = getattr(getattr(self, part), name)(*args, **kwargs)
        return found

    return call
