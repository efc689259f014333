"""A delivery's lease as the code that runs its task sees it: the task's context and the result
backend, in the worker's process or in a pool child (guarantees.md, invariant 14).

Every write made for the delivery goes through ``check`` then ``within``: once the lease clock
has run out, ``check`` raises ``LeaseLost`` at once, without a round trip; while it runs, the
call is bounded by what is left of the lease (sqlease._db.bounds), and a call that did not
finish in time ends in ``LeaseLost``: its write may or may not have been made, and the
database's fencing decides whose writes count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from sqlease._core.clock_slots import delivery_clock
from sqlease._core.lease_clock import DeliveryClock
from sqlease._core.lease_watch import lease_watch
from sqlease._db.bounds import bounded
from sqlease.errors import LeaseLost
from sqlease.types import Fence


class DeliveryLease:
    """One delivery's lease clock, and the guard around each call made for it."""

    def __init__(self, fence: Fence, clock: DeliveryClock) -> None:
        self.fence = fence
        self.clock = clock
        self._watches: list[int] = []

    @classmethod
    def of(cls, fence: Fence, lease_ms: int, clock_ref: str | None) -> DeliveryLease:
        """The lease of ``fence``, whose worker publishes its deadline at ``clock_ref``
        (``delivery_info[CLOCK_KEY]``; None: none published). One clock per delivery and
        process, shared by the task's context and the result backend."""
        return cls(fence, delivery_clock(fence, lease_ms, clock_ref))

    def check(self, what: str) -> float:
        """``LeaseLost`` at once if the lease clock ran out; else the time the call is sent
        (a renewing write confirmed by the database counts from it: ``confirmed``)."""
        if self.clock.lost():
            raise LeaseLost(
                self.fence.message_id,
                self.fence.attempt,
                f"{what}: the lease clock ran out (no renewal confirmed in time)",
            )
        return self.clock.monotonic()

    @contextmanager
    def within(self, what: str) -> Iterator[None]:
        """A call made for this delivery, bounded by what is left of its lease (``LeaseLost``
        at once if nothing is left)."""
        self.check(what)
        try:
            with bounded(self.clock.remaining):
                yield
        except (OperationalError, PoolTimeout) as exc:  # no answer, or no free connection
            if not self.clock.lost():
                raise
            raise LeaseLost(
                self.fence.message_id,
                self.fence.attempt,
                f"{what}: no answer from the database within the lease",
            ) from exc

    def confirmed(self, sent_at: float) -> None:
        """A renewing write sent at ``sent_at`` was confirmed (a checkpoint, a renewal)."""
        self.clock.confirmed(sent_at)

    def refused(self, detail: str) -> LeaseLost:
        """The database refused a write: lost for good; the error to raise."""
        self.clock.mark_lost()
        return LeaseLost(self.fence.message_id, self.fence.attempt, detail)

    def watch(self, callback: Callable[[], Any]) -> None:
        """Call ``callback()`` once as soon as the lease is known lost: now, in this thread,
        if it is; else from the watch's thread (sqlease._core.lease_watch), until ``close``."""
        if self.clock.lost():
            callback()
            return
        self._watches.append(lease_watch().watch(self.clock, callback))

    def close(self) -> None:
        """The task returned: no more callbacks."""
        watch = lease_watch()
        for handle in self._watches:
            watch.unwatch(handle)
        self._watches = []
