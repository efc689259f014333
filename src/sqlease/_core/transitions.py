"""Fenced transitions of held messages: release, park, fail."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import Connection

from sqlease._core.base import StoreBase, by_owner, dump
from sqlease._db.retry import transient
from sqlease.types import Fence


class Transitions(StoreBase):
    """Release, park and fail held messages."""

    @transient
    def _transition(
        self,
        fences: Iterable[Fence],
        *,
        new_state: str,
        kind: str,
        reason: str | None = None,
        delay_ms: int = 0,
        refund: bool = False,
        error: str | None = None,
        data: Any = None,
        now: int | None = None,
        also: Callable[[Connection], None] | None = None,
    ) -> set[int]:
        now = self._now(now)
        changed: set[int] = set()
        groups = by_owner(fences)
        if not groups:
            return changed
        data_text = dump(data)
        with self._writing(statements=len(groups) + (also is not None)) as conn:
            for owner, group in groups.items():
                params = {
                    **self.driver.fence_params(group),
                    "owner": owner,
                    "now": now,
                    "delay_ms": max(0, int(delay_ms)),
                    "refund": 1 if refund else 0,
                    "new_state": new_state,
                    "reason": reason,
                    "error": error,
                    "kind": kind,
                    "data": data_text,
                    "channel": self.notify_channel,
                }
                rows = [r._mapping for r in conn.execute(self.sql.transition, params).fetchall()]
                changed.update(int(m["id"]) for m in rows)
                self.driver.after_transitions(conn, rows, kind, data_text, now)
            if changed and also is not None:
                also(conn)  # the caller's write, in the same transaction
        return changed

    def release(
        self,
        fences: Iterable[Fence],
        *,
        delay_ms: int = 0,
        refund: bool = False,
        error: str | None = None,
        now: int | None = None,
    ) -> set[int]:
        """Give leases back so the messages can be claimed again (after ``delay_ms``).

        ``refund`` returns the delivery to the attempt budget: use it for deliveries that
        never started (warm shutdown, prefetched messages). The attempt number itself never
        goes back, so the old fence stays stale.
        """
        return self._transition(
            fences,
            new_state="ready",
            kind="released",
            delay_ms=delay_ms,
            refund=refund,
            error=error,
            data={"delay_ms": delay_ms, "refund": refund} if (delay_ms or refund) else None,
            now=now,
        )

    def park(
        self,
        fence: Fence,
        reason: str,
        *,
        data: Any = None,
        now: int | None = None,
        also: Callable[[Connection], None] | None = None,
    ) -> bool:
        """Take a held message out of circulation (paused, waiting for input, …) until
        ``requeue``; the event kind is ``reason``. Its run stays blocked behind it. ``also``
        runs in the same transaction when the park succeeded."""
        return bool(
            self._transition(
                [fence],
                new_state="parked",
                kind=reason,
                reason=reason,
                data=data,
                now=now,
                also=also,
            )
        )

    def fail(
        self,
        fence: Fence,
        reason: str,
        *,
        error: str | None = None,
        now: int | None = None,
    ) -> bool:
        """Mark a held message dead (kept, listable, requeueable)."""
        return bool(
            self._transition(
                [fence],
                new_state="dead",
                kind="failed",
                reason=reason,
                error=error,
                data={"reason": reason},
                now=now,
            )
        )
