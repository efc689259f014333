"""Flow control: the validation of concurrency keys and limits, and the configured limits per
task name and per queue (the ``flow_limits`` table) that claims enforce."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import delete, select

from sqlease._core.base import Aggregate
from sqlease._core.leases import promote_gates
from sqlease._core.names import MAX_INT, utf8_size
from sqlease._db.retry import transient
from sqlease.errors import ConfigurationError

#: The kinds of configured limit, the prefix of their gate's name.
LIMIT_KINDS = ("task", "queue")
#: Rate limits may also name a concurrency key.
RATE_KINDS = ("task", "queue", "key")
#: Seconds per unit of Celery's rate syntax ("100/m").
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
#: The fastest rate a limit may have: one delivery per millisecond (the statements' clock).
MAX_RATE_PER_S = 1000.0
#: Longest key accepted (it is stored in every gated message and slot row).
MAX_KEY_LENGTH = 200


def check_limit(limit: Any, what: str) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigurationError(f"{what} must be an integer >= 1, not {limit!r}")
    if limit > MAX_INT:
        raise ConfigurationError(f"{what} must be at most {MAX_INT}, not {limit!r}")
    return limit


def check_concurrency(key: Any, limit: Any) -> tuple[str | None, int | None]:
    """A message's concurrency key and limit: both or neither, the key a non-empty string."""
    if key is None and limit is None:
        return None, None
    if key is None:
        raise ConfigurationError(
            f"concurrency_limit {limit!r} was given without a concurrency_key: give both"
        )
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise ConfigurationError(
            f"concurrency_key must be a non-empty string of at most {MAX_KEY_LENGTH} "
            f"characters, not {key!r}"
        )
    utf8_size("concurrency_key", key)
    if limit is None:
        raise ConfigurationError(
            f"concurrency_key {key!r} was given without a concurrency_limit: give both"
        )
    return key, check_limit(limit, f"concurrency_limit of key {key!r}")


def parse_rate(value: Any, what: str) -> tuple[str, int]:
    """Celery's rate syntax, ``"100/m"``, ``"10/s"``, ``"5/h"`` or a number per second, as
    the text and the interval between deliveries in milliseconds."""
    text = str(value).strip() if isinstance(value, str | int | float) else None
    number, unit = ([*text.split("/", 1), "s"])[:2] if text else ("", "")
    try:
        per_s = float(number) / _UNITS[unit.strip() or "s"]
    except (KeyError, ValueError):
        per_s = -1.0
    if isinstance(value, bool) or not per_s > 0 or per_s != per_s:
        raise ConfigurationError(
            f"{what} must be a rate such as '100/m', '10/s' or '5/h', not {value!r}"
        )
    if per_s > MAX_RATE_PER_S:
        raise ConfigurationError(
            f"{what} {value!r} is over {MAX_RATE_PER_S:.0f}/s, the fastest rate a limit can "
            "have; use a concurrency limit instead"
        )
    return text or "", max(1, round(1000.0 / per_s))


def check_rates(rates: Any) -> dict[str, tuple[str, int]]:
    """``{"task:<name>": "100/m", "queue:<name>": "10/s", "key:<key>": "5/s"}``, as the
    ``rate_limits`` transport option gives it: each as its text and interval."""
    if rates is None:
        return {}
    if not isinstance(rates, Mapping):
        raise ConfigurationError(
            f"rate_limits must be a mapping such as {{'task:app.call_api': '100/m'}}, not {rates!r}"
        )
    checked: dict[str, tuple[str, int]] = {}
    for name, value in rates.items():
        kind, _, target = name.partition(":") if isinstance(name, str) else ("", "", "")
        if kind not in RATE_KINDS or not target:
            raise ConfigurationError(
                f"rate_limits key {name!r} must be 'task:<task name>', 'queue:<queue name>' "
                "or 'key:<concurrency key>'"
            )
        checked[name] = parse_rate(value, f"rate_limits[{name!r}]")
    return checked


def check_limits(limits: Any) -> dict[str, int]:
    """``{"task:<name>": n, "queue:<name>": n}``, as the ``concurrency_limits`` transport
    option gives it."""
    if limits is None:
        return {}
    if not isinstance(limits, Mapping):
        raise ConfigurationError(
            "concurrency_limits must be a mapping such as {'queue:images': 4, "
            f"'task:app.resize': 2}}, not {limits!r}"
        )
    checked: dict[str, int] = {}
    for name, limit in limits.items():
        kind, _, target = name.partition(":") if isinstance(name, str) else ("", "", "")
        if kind not in LIMIT_KINDS or not target:
            raise ConfigurationError(
                f"concurrency_limits key {name!r} must be 'task:<task name>' or "
                "'queue:<queue name>'"
            )
        checked[name] = check_limit(limit, f"concurrency_limits[{name!r}]")
    return checked


class FlowLimits(Aggregate):
    """The configured limits per task name and per queue."""

    def _upsert(self, conn: Any, name: str, values: dict[str, Any]) -> None:
        fl = self.tables.flow_limits
        if not conn.execute(fl.update().where(fl.c.name == name).values(**values)).rowcount:
            conn.execute(fl.insert().values(name=name, **values))

    def _stamp(self, now: int | None) -> int:
        at = self._now(now)
        return self.parts.now_ms() if at is None else at

    @transient
    def set_limits(
        self, limits: Mapping[str, int], *, replace: bool = False, now: int | None = None
    ) -> None:
        """Write concurrency ``limits`` (see ``check_limits``); with ``replace``, drop the
        other concurrency limits (rate limits stay)."""
        checked = check_limits(limits)
        fl = self.tables.flow_limits
        stamp = self._stamp(now)
        changed = list(checked)
        with self.driver.writing() as conn:
            if replace:
                dropped = fl.c.name.notin_(list(checked)) & fl.c.concurrency.isnot(None)
                changed += [r.name for r in conn.execute(select(fl.c.name).where(dropped))]
                conn.execute(
                    fl.update().where(fl.c.name.notin_(list(checked))).values(concurrency=None)
                )
            for name, limit in checked.items():
                self._upsert(conn, name, {"concurrency": limit, "updated_at_ms": stamp})
            conn.execute(delete(fl).where(fl.c.concurrency.is_(None), fl.c.interval_ms.is_(None)))
        # A limit raised or removed makes room at once for the messages parked at its gate.
        promote_gates(self.driver, changed, self._now(now))

    @transient
    def set_rate_limits(
        self, rates: Mapping[str, Any], *, replace: bool = False, now: int | None = None
    ) -> None:
        """Write rate limits (see ``check_rates``); with ``replace``, drop the other rate
        limits (concurrency limits stay). A changed rate starts afresh."""
        checked = check_rates(rates)
        fl = self.tables.flow_limits
        stamp = self._stamp(now)
        none = {"interval_ms": None, "tau_ms": None, "tat_ms": None, "rate": None}
        changed: list[str] = []
        with self.driver.writing() as conn:
            if replace:
                dropped = fl.c.name.notin_(list(checked)) & fl.c.interval_ms.isnot(None)
                changed += [r.name for r in conn.execute(select(fl.c.name).where(dropped))]
                conn.execute(fl.update().where(fl.c.name.notin_(list(checked))).values(**none))
            current = {
                r.name: r.interval_ms
                for r in conn.execute(
                    select(fl.c.name, fl.c.interval_ms).where(fl.c.name.in_(checked))
                )
            }
            for name, (text, interval) in checked.items():
                if current.get(name) == interval:
                    continue  # unchanged: keep its state
                self._upsert(
                    conn,
                    name,
                    {
                        "interval_ms": interval,
                        "tau_ms": 0,
                        "tat_ms": None,
                        "rate": text,
                        "updated_at_ms": stamp,
                    },
                )
                changed.append(name)
            conn.execute(delete(fl).where(fl.c.concurrency.is_(None), fl.c.interval_ms.is_(None)))
        # Messages given their turn under a rate that changed are due again: the next sweep
        # gives them their turn under the new one.
        if changed:
            self.driver.execute(self.driver.rate_release(changed, self._now(now)))

    @transient
    def remove_limit(self, name: str, *, now: int | None = None) -> bool:
        """Drop the concurrency and the rate limit named ``name``."""
        fl = self.tables.flow_limits
        with self.driver.writing() as conn:
            removed = bool(conn.execute(delete(fl).where(fl.c.name == name)).rowcount)
        if removed:  # its gate has no limit now: every message parked there goes
            # On the store's clock (an injected one too), as the sweep that timed them.
            at = self._now(now)
            promote_gates(self.driver, [name], at)
            self.driver.execute(self.driver.rate_release([name], at))
        return removed

    @transient
    def limits(self) -> dict[str, int]:
        fl = self.tables.flow_limits
        with self.driver.reading() as conn:
            rows = conn.execute(
                select(fl.c.name, fl.c.concurrency)
                .where(fl.c.concurrency.isnot(None))
                .order_by(fl.c.name)
            )
            return {str(r.name): int(r.concurrency) for r in rows}

    @transient
    def rate_limits(self) -> dict[str, dict[str, Any]]:
        """Each rate limit: its text, interval and when its next delivery may start."""
        fl = self.tables.flow_limits
        with self.driver.reading() as conn:
            rows = conn.execute(
                select(fl.c.name, fl.c.rate, fl.c.interval_ms, fl.c.tau_ms, fl.c.tat_ms)
                .where(fl.c.interval_ms.isnot(None))
                .order_by(fl.c.name)
            ).all()
        return {
            str(r.name): {
                "rate": r.rate,
                "interval_ms": int(r.interval_ms),
                "next_at_ms": None if r.tat_ms is None else int(r.tat_ms) - int(r.tau_ms or 0),
            }
            for r in rows
        }
