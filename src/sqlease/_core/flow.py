"""Flow control: the validation of concurrency keys and limits, and the configured limits per
task name and per queue (the ``flow_limits`` table) that claims enforce."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import delete, select

from sqlease._core.base import StoreBase
from sqlease._db.retry import transient
from sqlease.errors import ConfigurationError

#: The kinds of configured limit, the prefix of their gate's name.
LIMIT_KINDS = ("task", "queue")
#: Longest key accepted (it is stored in every gated message and slot row).
MAX_KEY_LENGTH = 200


def check_limit(limit: Any, what: str) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigurationError(f"{what} must be an integer >= 1, not {limit!r}")
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
    if limit is None:
        raise ConfigurationError(
            f"concurrency_key {key!r} was given without a concurrency_limit: give both"
        )
    return key, check_limit(limit, f"concurrency_limit of key {key!r}")


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


class FlowLimits(StoreBase):
    """The configured limits per task name and per queue."""

    @transient
    def set_limits(
        self, limits: Mapping[str, int], *, replace: bool = False, now: int | None = None
    ) -> None:
        """Write ``limits`` (see ``check_limits``); with ``replace``, drop the others."""
        checked = check_limits(limits)
        fl = self.tables.flow_limits
        at = self._now(now)
        stamp = self.now_ms() if at is None else at
        with self.engine.begin() as conn:
            if replace:
                conn.execute(delete(fl).where(fl.c.name.notin_(list(checked))))
            for name, limit in checked.items():
                updated = conn.execute(
                    fl.update()
                    .where(fl.c.name == name)
                    .values(concurrency=limit, updated_at_ms=stamp)
                ).rowcount
                if not updated:
                    conn.execute(
                        fl.insert().values(name=name, concurrency=limit, updated_at_ms=stamp)
                    )

    @transient
    def remove_limit(self, name: str) -> bool:
        fl = self.tables.flow_limits
        with self.engine.begin() as conn:
            return bool(conn.execute(delete(fl).where(fl.c.name == name)).rowcount)

    @transient
    def limits(self) -> dict[str, int]:
        fl = self.tables.flow_limits
        with self._reading() as conn:
            rows = conn.execute(select(fl.c.name, fl.c.concurrency).order_by(fl.c.name))
            return {str(r.name): int(r.concurrency) for r in rows}
