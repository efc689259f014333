"""What the worker's event loop asks of the database, as jobs, and the runners that do them
without blocking the loop.

Every claim, ack, take, offer, due-time read and transition the fetcher makes is a ``Job``
(its ``Kind`` and what it needs). A runner takes jobs in order and turns the ones waiting
into ops (``Batcher.prepare``: the acks of every waiting job go with the first waiting
claim, as one statement), so acks and claims share commits; outcomes (``Done``) come back on
the loop thread through ``notify``. Three runners, one protocol:

- ``LoopCalls`` (sqlease.transport._loop_calls): the loop sends each op itself, on a
  connection it keeps per lane, and reads its rows when the socket is readable (PostgreSQL
  with psycopg's statement generator);
- ``BackgroundCalls`` (sqlease.transport._background): a thread executes them (a psycopg
  without that generator);
- ``InlineCalls`` (here): executes each at once (SQLite: a local transaction of a few tens
  of microseconds, no network round trip to hide; and clients without an event loop).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlease._db.driver import Driver, Lane, Op
from sqlease._db.rows import held_ahead
from sqlease.store import Message, Store
from sqlease.transport._background import BackgroundCalls, Done, Job
from sqlease.transport._loop_calls import LoopCalls

__all__ = [
    "Batcher",
    "Done",
    "InlineCalls",
    "Job",
    "Kind",
    "Runner",
    "Terms",
    "make_runner",
]


class Kind(enum.Enum):
    """What a job asks for; its ``Job.context`` says the rest."""

    #: ``fences``: acks
    ACKS = "acks"
    #: ``channel``, ``queues``, ``limit``, ``fences``: a claim, with acks (and those of the
    #: ACKS jobs waiting)
    CLAIM = "claim"
    #: ``op``, ``channel``: delete on fetch (consumers that never ack)
    TAKE = "take"
    #: ``op``, ``fences``, ``queues``: the idle worker's offer (with the acks that left it
    #: idle, if any); its outcome is when the next delayed message is due
    OFFER = "offer"
    #: ``op``: when the next delayed message of the queues is due
    DUE = "due"
    #: ``op``, ``fences``: release or fail deliveries
    CHANGE = "change"
    #: ``op`` (its answer: handoffs already read), ``notified``: delivered in their turn,
    #: after the takes submitted before them
    HANDED = "handed"


@dataclass(frozen=True, slots=True)
class Terms:
    """The lease a transport's claims ask for."""

    owner: str
    lease_ms: int


class Runner(Protocol):
    """Jobs submitted from the loop thread, done in order; their outcomes are collected on
    the loop thread after ``notify`` woke it (``InlineCalls``: at once)."""

    #: outcomes are ready as soon as ``submit`` returns
    synchronous: bool

    def submit(self, key: Any, **context: Any) -> None: ...

    def collect(self) -> list[Done]: ...

    @property
    def pending(self) -> bool: ...

    def wait_idle(self, timeout: float) -> bool: ...

    def stop(self, timeout: float = 5.0) -> None: ...


@dataclass
class Batcher:
    """Turns the waiting jobs into one op: the acks of every waiting job with the first
    waiting claim (one statement, one commit), or else the first job (all the waiting acks
    at once). The jobs it leaves wait for the next op, in order."""

    store: Store
    terms: Terms
    #: ops prepared, by kind (for tests and the statistics)
    counts: dict[Kind, int] = field(default_factory=dict)

    def prepare(self, jobs: Sequence[Job]) -> tuple[Op[list[Done]], list[Job]]:
        """An op for some of ``jobs`` (those returned: their outcomes are its answer). Jobs
        keep their order, but for acks: they go with the first claim after them, or alone
        before the first job that is neither."""
        acks = [job for job in jobs if job.key is Kind.ACKS]
        first = next((job for job in jobs if job.key is not Kind.ACKS), None)
        if first is not None and first.key is Kind.CLAIM:
            return self._ack_claim(acks, first), [*acks, first]
        if acks:
            return self._acks(acks), acks
        assert first is not None
        return self._one(first), [first]

    def _count(self, kind: Kind) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def _acks(self, acks: list[Job]) -> Op[list[Done]]:
        self._count(Kind.ACKS)
        fences = [f for job in acks for f in job.context["fences"]]
        return self.store.ack_op(fences).then(
            lambda acked: [Done(j.key, value=None, context=j.context, acked=acked) for j in acks]
        )

    def _ack_claim(self, acks: list[Job], claim: Job) -> Op[list[Done]]:
        self._count(Kind.CLAIM)
        fences = [f for job in (*acks, claim) for f in job.context["fences"]]
        queues, limit = claim.context["queues"], claim.context["limit"]
        op = self.store.ack_and_claim_op(
            fences, queues, self.terms.owner, lease_ms=self.terms.lease_ms, limit=limit
        )

        def outcomes(found: tuple[set[int], list[Message]]) -> list[Done]:
            acked, messages = found
            done = [Done(j.key, value=None, context=j.context, acked=acked) for j in acks]
            # Never "short" when acks went with the claim: it may not have seen them free a
            # run's next message, so its queues are not known to be drained.
            short = not fences and len(messages) < limit and not held_ahead(messages)
            context = {**claim.context, "short": short, "held_ahead": held_ahead(messages)}
            return [*done, Done(claim.key, value=messages, context=context, acked=acked)]

        return op.then(outcomes)

    def _one(self, job: Job) -> Op[list[Done]]:
        """A take, an offer, a due-time read or a transition: the op its job carries (built
        without I/O when it was submitted)."""
        self._count(job.key)
        op: Op[Any] = job.context["op"]
        return op.then(lambda value: [Done(job.key, value=value, context=job.context)])


class InlineCalls:
    """Does each job at once, in the caller's thread: ``submit`` returns with its outcome
    ready in ``collect()``."""

    synchronous = True

    def __init__(self, driver: Driver, batcher: Batcher) -> None:
        self._driver = driver
        self._batcher = batcher
        self._done: list[Done] = []

    def submit(self, key: Any, **context: Any) -> None:
        job = Job(key, context)
        try:
            op, _ = self._batcher.prepare([job])
            found: list[Done] = self._driver.execute(op)
        except BaseException as exc:  # handed to the loop thread's collect, as the others do
            found = [Done(key, error=exc, context=context)]
        self._done.extend(found)

    def collect(self) -> list[Done]:
        done, self._done = self._done, []
        return done

    @property
    def pending(self) -> bool:
        return bool(self._done)

    def wait_idle(self, timeout: float) -> bool:
        return True

    def stop(self, timeout: float = 5.0) -> None:
        pass


def make_runner(
    store: Store,
    batcher: Batcher,
    *,
    hub: Any,
    notify: Callable[[], None],
    wake_from_thread: Callable[[], None],
    loop_statements: bool,
    give_up_after: float | None = None,
) -> Runner:
    """The runner for a transport: in the event loop ``hub`` (None: no loop, a client that
    drains by itself), on a driver whose statements cross a network (``remote``), the loop
    sends them itself where the driver can (``loop_statements`` off: a thread does), else a
    thread; everything else runs inline. ``give_up_after``: seconds without an answer after
    which the loop gives a statement up and sends it again on a new connection."""
    driver = store.driver
    if hub is None or not driver.remote:
        return InlineCalls(driver, batcher)
    if driver.nonblocking and loop_statements:
        # The loop sends the statements itself and reads their rows when they come.
        return LoopCalls(
            hub,
            driver,
            batcher.prepare,
            notify,
            wake_from_thread=wake_from_thread,
            give_up_after=give_up_after,
        )
    # A thread executes them, one after another, on the connection it keeps.
    return BackgroundCalls(
        driver,
        batcher.prepare,
        wake_from_thread,
        on_start=lambda: driver.pin_thread(Lane.LEASES),
        on_exit=lambda: driver.release_thread(Lane.LEASES),
    )
