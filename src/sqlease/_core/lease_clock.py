"""The local lease clock: the latest moment a delivery's lease can still be held, known to its
holder without asking the database (guarantees.md, invariant 14).

The database decides when a lease ends, on its own clock: ``now + lease`` as of the statement
that claimed or renewed it. That statement ran after its holder sent it, so, counted on the
holder's clock from the moment the statement was *sent*, the lease lasts at least ``lease``,
but for two things the holder cannot see:

- **Clock rates.** The holder counts on its monotonic clock, the database on its wall clock;
  either may run a little fast or slow. NTP-disciplined clocks differ by at most 500 ppm
  (NTP's largest slew) and free-running quartz by about 100 ppm: the margin takes 1 % of the
  lease, twenty times the worst of them.
- **Acting on it.** Lease times are whole milliseconds on the database (truncated), and the
  holder acts on its clock a little after the moment it set: a wait for the deadline wakes
  late on a loaded machine (the CPU shared with other processes, a green thread waiting for
  its hub while another runs), and the task stops only once it has woken. Another worker
  claims an expired lease within milliseconds of its end, so the holder must have stopped by
  then: a fixed 250 ms, at most a tenth of the lease (a partition test on a loaded two-core
  machine saw a gevent task wake 190 ms after its deadline).

So the deadline is ``sent + lease - margin``. It only moves forward while it has not passed:
once it has, the delivery is lost for its holder for good, whatever a renewal that comes back
later says (the task may already have stopped; the database's lease then runs out unrenewed).

What this rests on: the database server's wall clock is not stepped forward while leases run
(NTP slews, it does not step, once synchronized), and the holder's monotonic clock is the
machine's (``time.monotonic``: one clock for every process of a machine, which is what lets a
prefork child read its parent's deadlines, sqlease._core.clock_slots).
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Share of the lease kept back for the rates of the holder's and the database's clocks.
RATE_MARGIN = 0.01
#: Seconds kept back for timestamp resolution and for how late a loaded process wakes to act on
#: its clock (at most a tenth of the lease).
FIXED_MARGIN_S = 0.25
#: The deadline of a delivery known lost.
LOST = float("-inf")

Monotonic = Callable[[], float]


def margin_seconds(lease_s: float) -> float:
    """What a holder keeps back of a lease of ``lease_s`` seconds (see the module's
    docstring)."""
    return lease_s * RATE_MARGIN + min(FIXED_MARGIN_S, lease_s * 0.1)


def deadline_after(sent_at: float, lease_s: float) -> float:
    """The last moment (holder's monotonic clock) a lease of ``lease_s`` seconds, claimed or
    renewed by a statement sent at ``sent_at`` and confirmed by the database, can be held."""
    return sent_at + lease_s - margin_seconds(lease_s)


class DatabaseTime:
    """What a holder knows of the database's clock, for leases it did not ask for itself: a
    publish that leased a message to this worker's standing offer (the handoff) ran on the
    database's clock, at a time the worker never saw.

    Every statement that reports the database's time it ran at (``db_ms``) and that was sent at
    ``sent_at`` bounds the offset between the two clocks from below: the statement ran after it
    was sent, so ``local - database >= sent_at - db_ms``. The bound ages by the rate margin, as
    the two clocks may drift apart since; the best (latest-aged) bound is kept."""

    def __init__(self) -> None:
        self._offset: float | None = None
        self._at = 0.0

    def note(self, sent_at: float, db_ms: int) -> None:
        """A statement sent at ``sent_at`` ran at ``db_ms`` on the database's clock."""
        offset = sent_at - db_ms / 1000.0
        if self._offset is None or offset >= self._aged(sent_at):
            self._offset, self._at = offset, sent_at

    def _aged(self, now: float) -> float:
        assert self._offset is not None
        return self._offset - RATE_MARGIN * max(0.0, now - self._at)

    def sent_equivalent(self, expires_ms: int, lease_ms: int, now: float) -> float | None:
        """For a lease that ends at ``expires_ms`` on the database's clock: the local time that a
        claim of it would have been sent at, at the latest (so that ``deadline_after`` of it
        is conservative). None if no statement told this holder the database's time yet."""
        if self._offset is None:
            return None
        return (expires_ms - lease_ms) / 1000.0 + self._aged(now)


class DeliveryClock:
    """One delivery's lease clock as its task sees it (in the worker's process or in a pool
    child): the deadline the worker's heartbeat publishes (``shared``: a callable reading it,
    ``LOST`` once the worker knows the lease gone or no longer holds the delivery; None where
    the worker published none), and the confirmations of the task's own renewing writes
    (a checkpoint, ``ensure_lease``). The later of the two counts, until either says lost."""

    def __init__(
        self,
        lease_s: float,
        *,
        shared: Callable[[], float] | None = None,
        monotonic: Monotonic = time.monotonic,
    ) -> None:
        self.lease_s = lease_s
        self._shared = shared
        self.monotonic = monotonic
        self._own: float | None = None
        self._lost = False

    def deadline(self) -> float | None:
        """The last moment the lease can be held; ``LOST`` once it is known gone (passed, or
        marked lost); None while nothing is known (no published deadline, no confirmation of
        the task's own): the database alone decides then."""
        if self._lost:
            return LOST
        shared = self._shared() if self._shared is not None else None
        if shared is None:
            deadline = self._own
        elif shared == LOST:
            deadline = LOST
        else:
            deadline = shared if self._own is None else max(shared, self._own)
        if deadline is not None and deadline < self.monotonic():
            self._lost = True  # passed (or marked lost by the worker): lost for good
            return LOST
        return deadline

    def remaining(self) -> float | None:
        """Seconds until the deadline (0.0 once lost; None while nothing is known)."""
        deadline = self.deadline()
        return None if deadline is None else max(0.0, deadline - self.monotonic())

    def lost(self) -> bool:
        """The lease is known lost: its deadline passed, or it was marked lost."""
        return self.deadline() == LOST

    def confirmed(self, sent_at: float) -> None:
        """A renewing write sent at ``sent_at`` was confirmed by the database. It moves the
        deadline only while the deadline has not passed."""
        if self.lost():
            return
        mine = deadline_after(sent_at, self.lease_s)
        self._own = mine if self._own is None else max(self._own, mine)

    def mark_lost(self) -> None:
        """The database refused a write of this delivery: lost for good."""
        self._lost = True
