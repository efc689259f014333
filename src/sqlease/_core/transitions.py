"""Fenced transitions of held messages: release, park, fail."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import Connection

from sqlease._core.base import Aggregate, dump
from sqlease._core.leases import promote_owed
from sqlease._db.driver import Change, Op
from sqlease._db.retry import transient
from sqlease._db.rows import Acked
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
    ) -> Acked:
        change = Change(new_state, kind, reason, int(delay_ms), refund, error, dump(data))
        now = self._now(now)
        op = self.driver.message_transition(list(fences), change, now, also)
        return promote_owed(self.driver, self.driver.execute(op), now)

    def release_op(
        self,
        fences: Iterable[Fence],
        *,
        delay_ms: int = 0,
        refund: bool = False,
        error: str | None = None,
        now: int | None = None,
    ) -> Op[Acked]:
        """``release`` as one op (for the worker's event loop)."""
        data = {"delay_ms": delay_ms, "refund": refund} if (delay_ms or refund) else None
        change = Change("ready", "released", None, int(delay_ms), refund, error, dump(data))
        return self.driver.message_transition(list(fences), change, self._now(now))

    @transient
    def release_rejected(self, fence: Fence, *, now: int | None = None) -> bool:
        """``release_rejected_op`` at once."""
        now = self._now(now)
        done = self.driver.execute(self.release_rejected_op(fence, now=now))
        return bool(promote_owed(self.driver, done, now))

    def release_rejected_op(self, fence: Fence, *, now: int | None = None) -> Op[Acked]:
        """A delivery its worker rejected with requeue (Celery: a hard time limit without
        ``acks_on_failure_or_timeout``, ``reject_on_worker_lost``, ``Reject(requeue=True)``),
        released as one op. A final result it stored (Celery stores the time limit's FAILURE
        first) no longer completes its next delivery: the worker asked for it to run again,
        it did not lose its ack (as ``requeue`` of a dead message)."""
        results = self.tables.results

        def unlink(conn: Connection) -> None:
            conn.execute(
                results.update()
                .where(results.c.message_id == fence.message_id)
                .values(message_id=None)
            )

        change = Change("ready", "released", None, 0, False, None, None)
        return self.driver.message_transition([fence], change, self._now(now), unlink)

    def fail_op(
        self, fence: Fence, reason: str, *, error: str | None = None, now: int | None = None
    ) -> Op[Acked]:
        """``fail`` as one op (for the worker's event loop)."""
        change = Change("dead", "failed", reason, 0, False, error, dump({"reason": reason}))
        return self.driver.message_transition([fence], change, self._now(now))

    @transient
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
        now = self._now(now)
        op = self.release_op(fences, delay_ms=delay_ms, refund=refund, error=error, now=now)
        return promote_owed(self.driver, self.driver.execute(op), now)

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

    @transient
    def fail(
        self,
        fence: Fence,
        reason: str,
        *,
        error: str | None = None,
        now: int | None = None,
    ) -> bool:
        """Mark a held message dead (kept, listable, requeueable); its run goes on."""
        now = self._now(now)
        done = self.driver.execute(self.fail_op(fence, reason, error=error, now=now))
        return bool(promote_owed(self.driver, done, now))
