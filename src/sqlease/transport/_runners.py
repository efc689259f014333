"""The transport's hot statements (claims, takes, acks, the idle worker's offers) and the
runner that sends a busy worker's claims and acks without blocking its event loop.

Every call the transport makes to the store's claim, take and ack operations is in ``Leases``:
run now (``claim``, ``ack``, …) or, where it is one statement, the same op for the event loop
to send (``prepare``). Two runners, one protocol: ``LoopCalls`` (sqlease.transport._loop_calls)
sends the prepared statement from the event loop itself and reads its rows when the socket is
readable; ``BackgroundCalls`` (sqlease.transport._background) runs the calls on a thread, for a
psycopg without the statement generator the loop drives.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from sqlease._core.leases import delivery_order, split_exhausted
from sqlease._db.driver import Lane, Op
from sqlease.store import Fence, Message
from sqlease.transport._background import BackgroundCalls, Done, Job
from sqlease.transport._completion import hold
from sqlease.transport._loop_calls import LoopCalls

if TYPE_CHECKING:
    from sqlease.transport._transport import Transport

#: The key of ack writes on the runner (claims are keyed by their channel).
ACKS: Any = object()


class Runner(Protocol):
    """Calls submitted from the loop thread, run in order; their outcomes are collected on
    the loop thread after ``notify`` woke it."""

    def submit(self, key: Any, call: Callable[[], Any], **context: Any) -> None: ...

    def collect(self) -> list[Done]: ...

    @property
    def pending(self) -> bool: ...

    def wait_idle(self, timeout: float) -> bool: ...

    def stop(self, timeout: float = 5.0) -> None: ...


class Leases:
    """One transport's claims and acks, on the store."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def claim(self, queues: list[str], limit: int) -> tuple[list[Message], bool]:
        """Lease up to ``limit`` messages; also whether the store had fewer than asked."""
        transport = self._transport
        messages = transport.store.claim(
            queues,
            transport.owner,
            lease_ms=transport.options.lease_ms,
            limit=limit,
            on_exhausted=transport.record_exhausted,
        )
        return hold(transport, messages), len(messages) < limit

    def claim_with_acks(
        self, queues: list[str], limit: int, fences: list[Fence]
    ) -> tuple[set[int], list[Message], bool]:
        """Ack ``fences`` and claim as ``claim`` does, in one statement on PostgreSQL: the ids
        acked, the messages claimed, and whether the store had fewer than asked. (Never
        "fewer" when acks went with it: the claim may not have seen them free a run's next
        message, so the queues are not known to be drained.)"""
        transport = self._transport
        acked, messages = transport.store.ack_and_claim(fences, queues, **self._terms(limit))
        return acked, hold(transport, messages), not fences and len(messages) < limit

    def _terms(self, limit: int) -> dict[str, Any]:
        transport = self._transport
        return {
            "owner": transport.owner,
            "lease_ms": transport.options.lease_ms,
            "limit": limit,
            "on_exhausted": transport.record_exhausted,
        }

    def take(self, queues: list[str], limit: int) -> list[Message]:
        """Delete on fetch (consumers that never ack): up to ``limit`` messages."""
        return self._transport.store.take(queues, limit=limit)

    def ack(self, fences: list[Fence]) -> set[int]:
        return self._transport.store.ack(fences)

    def ack_and_offer(
        self, fences: list[Fence], queues: list[str], terms: dict[str, Any]
    ) -> tuple[set[int], int | None]:
        """The acks that leave the worker idle, with its handoff offer: the ids acked, and
        the milliseconds until the next delayed message is due."""
        transport = self._transport
        return transport.store.ack_and_offer(fences, queues, transport.owner, **terms)

    def offer(self, queues: list[str], terms: dict[str, Any]) -> int | None:
        """The idle worker's offer for ``queues`` (none: withdrawn); the milliseconds until
        the next delayed message is due."""
        transport = self._transport
        return transport.store.offer(queues, transport.owner, **terms)

    # ---- the runner ---------------------------------------------------------------------

    def runner(self, hub: Any, notify: Callable[[], None]) -> Runner:
        """A runner for a busy worker's calls in the event loop ``hub``."""
        driver = self._transport.store.driver
        # Read at call time from the package: ``sqlease.transport.NONBLOCKING = False`` (the
        # benchmarks, the tests) puts the statements on a thread instead.
        nonblocking = sys.modules[__package__].NONBLOCKING
        if driver.nonblocking and nonblocking and hub is not None:
            # The loop sends the statements itself and reads their rows when they come.
            return LoopCalls(hub, driver.line(Lane.LEASES), notify, self.prepare, self.combine)
        # A psycopg without the generator the loop drives: a thread waits instead.
        return BackgroundCalls(
            notify,
            self.combine,
            # The thread runs one statement after another: it keeps its connection.
            on_start=lambda: driver.pin_thread(Lane.LEASES),
            on_exit=lambda: driver.release_thread(Lane.LEASES),
        )

    def combine(self, jobs: list[Job]) -> list[Done]:
        """The waiting calls, run now (on the background thread, or in the loop where they
        are not one statement): the acks of every waiting call are written with the first
        waiting claim, in one statement (or together, when no claim waits)."""
        fences, first = _acks_and_first_claim(jobs)
        try:
            if first is not None:
                acked, claimed, short = self.claim_with_acks(
                    first.context["queues"], first.context["limit"], fences
                )
            else:
                acked, claimed, short = (self.ack(fences) if fences else set()), [], False
        except BaseException as exc:  # none of it is known to be written: all report it
            return [Done(job.key, error=exc, context=job.context) for job in jobs]
        return _outcomes(jobs, first, acked, claimed, short=short)

    def prepare(self, jobs: list[Job]) -> Op[list[Done]] | None:
        """The same as one statement for the loop to send (None where it is not one)."""
        transport = self._transport
        fences, first = _acks_and_first_claim(jobs)
        store = transport.store
        if first is None:
            acks = store.ack_op(fences)
            if not acks.sendable:
                return None
            return acks.then(lambda acked: _outcomes(jobs, None, acked, [], short=False))
        queues, limit = first.context["queues"], first.context["limit"]
        terms = self._terms(limit)
        terms.pop("on_exhausted")
        op = store.ack_and_claim_op(fences, queues, **terms)
        if not op.sendable:
            return None

        def outcomes(found: tuple[set[int], list[Message]]) -> list[Done]:
            acked, messages = found
            delivered, exhausted = split_exhausted(messages)
            if exhausted:
                transport.record_exhausted(exhausted)
                if len(delivered) < limit:  # a look past them, as claim() takes
                    delivered += store.claim(queues, limit=limit - len(delivered), **terms)
            delivered = delivery_order(delivered)
            # Never "short" when acks went with the claim (see claim_with_acks).
            short = not fences and len(delivered) < limit
            return _outcomes(jobs, first, acked, hold(transport, delivered), short=short)

        return op.then(outcomes)


def _acks_and_first_claim(jobs: list[Job]) -> tuple[list[Fence], Job | None]:
    """The acks of every waiting call, and the first waiting claim (they go as one statement)."""
    fences = [fence for job in jobs for fence in job.context["pending"]]
    first = next((job for job in jobs if job.key is not ACKS), None)
    return fences, first


def _outcomes(
    jobs: list[Job], first: Job | None, acked: set[int], claimed: list[Message], *, short: bool
) -> list[Done]:
    """One outcome per waiting call, once the acks went with the first claim's statement."""
    outcomes: list[Done] = []
    for job in jobs:
        if job is first:
            outcome = Done(job.key, value=(claimed, short), context=job.context)
        elif job.key is ACKS:
            outcome = Done(job.key, context=job.context)
        else:
            outcome = job.run()  # a second claim (another channel): on its own
        outcome.acked = acked
        outcomes.append(outcome)
    return outcomes
