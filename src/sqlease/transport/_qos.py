"""Kombu's QoS, with the questions about unacked deliveries the transport asks of it."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection
from multiprocessing.util import Finalize
from typing import Any

from kombu.transport import virtual

from sqlease._core.heartbeat import Holder
from sqlease.delivery import fence_of
from sqlease.store import Fence

#: The QoS objects whose channels are open, restored at interpreter exit (as Kombu restores
#: each through its own finalizer).
_open: weakref.WeakSet[QoS] = weakref.WeakSet()


def _restore_at_exit() -> None:
    for qos in list(_open):
        qos.restore_unacked_once()


Finalize(None, _restore_at_exit, exitpriority=1)


def celery_pool_load() -> tuple[int, int] | None:
    """In a Celery worker whose pool is known: its size and its tasks received and not
    finished; None elsewhere."""
    from sqlease._celery import pool_room

    return pool_room.load()


class _Collected:
    """``QoS._on_collect``: when the QoS is collected unclosed, its holder abandons its
    leases (the heartbeat gives them back). Kombu's own finalizer holds the QoS through its
    callback, so neither it nor its channel and connection were ever collected, and the
    heartbeat renewed their leases for the life of the process."""

    __slots__ = ("_finalizer",)

    def __init__(self, qos: QoS, holder: Holder) -> None:
        self._finalizer = weakref.finalize(qos, holder.abandon)
        self._finalizer.atexit = False  # _restore_at_exit gives them back at exit

    def cancel(self) -> None:
        self._finalizer.detach()


class QoS(virtual.QoS):
    """Kombu's prefetch and unacked bookkeeping, extended by subclassing (as Kombu's redis
    transport does) rather than read from outside: a delivery is unacked while it is in
    ``_delivered`` and not yet marked ``_dirty`` (acked or rejected, removed at the next
    ``can_consume``). ``holder``: what the heartbeat knows its leases by."""

    #: With Celery's ``worker_disable_prefetch`` (sqlease._celery.no_prefetch), set on the
    #: task consumer's channel: how many more tasks the worker may take now (its pool's
    #: processes, or the autoscaler's most, less the tasks it holds).
    task_room: Callable[[], int] | None = None

    def __init__(self, channel: Any, prefetch_count: int = 0) -> None:
        super().__init__(channel, prefetch_count)
        self._on_collect.cancel()
        self.holder = Holder()
        self._on_collect = _Collected(self, self.holder)  # type: ignore[assignment]
        _open.add(self)
        # Deliveries on their way, which the credit counts as taken: redelivered messages
        # whose stored results are being looked for (sqlease.transport._deliveries).
        self.settling = 0

    def unacked_count(self) -> int:
        """Deliveries held: prefetched or running, not yet acked."""
        return len(self._delivered) - len(self._dirty)

    def can_consume(self) -> bool:
        if self.task_room is not None and self.task_room() <= 0:
            return False
        pcount = self.prefetch_count
        return not pcount or self.unacked_count() + self.settling < pcount

    def can_consume_max_estimate(self) -> int | None:
        pcount = self.prefetch_count
        if pcount:
            return max(pcount - self.unacked_count() - self.settling, 0)
        return None

    def credit(self) -> int | None:
        """How many deliveries the channel may take now: its free prefetch credit, and no
        more than its ``task_room`` when that is set; None when nothing limits it."""
        credit = self.can_consume_max_estimate()
        if self.task_room is not None:
            room = max(self.task_room(), 0)
            credit = room if credit is None else min(credit, room)
        return credit

    def holds_besides(self, acking: Collection[str]) -> bool:
        """Whether a delivery is held other than those with the tags ``acking`` (redelivered
        ones being settled count: they are delivered next)."""
        if self.settling:
            return True
        dirty = self._dirty
        return any(t not in dirty and t not in acking for t in self._delivered)

    def held_besides(self, acking: Collection[str]) -> int:
        """How many deliveries are held other than those with the tags ``acking`` (and
        redelivered ones being settled)."""
        dirty = self._dirty
        held = sum(1 for t in self._delivered if t not in dirty and t not in acking)
        return held + self.settling

    def refill_later(self) -> bool:
        """While messages are still buffered, wait until half of the prefetch credit is free
        before claiming: one claim (one commit) then fetches several, instead of one commit
        per finished task; the other half keeps the pool busy while the claim runs. (Against
        a quarter: about a fifth more tasks/s draining no-op tasks, prefork -c 2, prefetch 8.)
        An idle consumer (nothing held) claims at once."""
        pcount = self.prefetch_count
        if not pcount or pcount < 8:
            return False
        credit = self.can_consume_max_estimate()
        if self.unacked_count() == 0 or (credit is not None and credit >= pcount // 2):
            return False
        # Not while a pool process is idle: what the worker holds is then all running (long
        # tasks with a prefetch multiplier of 1, say) and nothing waits to keep it busy.
        load = celery_pool_load()
        return load is None or load[1] >= load[0]

    def fence_for(self, delivery_tag: str) -> Fence | None:
        """The lease the delivery ``delivery_tag`` holds (None if unknown or unleased)."""
        try:
            message: Any = self.get(delivery_tag)
        except KeyError:
            return None
        return fence_of(message.delivery_info)

    def in_a_run(self, delivery_tag: str) -> bool:
        """Whether the delivery belongs to a run (its ack lets the run's next message go)."""
        try:
            message: Any = self.get(delivery_tag)
        except KeyError:
            return False
        return bool((message.headers or {}).get("run_id"))
