"""Fenced transitions of held messages: release, park, fail."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import Connection

from sqlease._core.base import Aggregate, dump
from sqlease._db.driver import Change
from sqlease._db.retry import transient
from sqlease.types import Fence


class Transitions(Aggregate):
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
        change = Change(new_state, kind, reason, int(delay_ms), refund, error, dump(data))
        op = self.driver.message_transition(list(fences), change, self._now(now), also)
        return self.driver.execute(op)

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
