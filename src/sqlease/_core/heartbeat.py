"""One heartbeat per process: renews every lease the process holds, in one statement per store,
and keeps each delivery's local lease clock (sqlease._core.lease_clock).

Renewals are single-flight (the thread renews, waits, renews again; no renewal starts before
the previous one returned). Each delivery's deadline is counted from the send time of the last
claim or renewal the database confirmed, and published in a shared-memory slot that the task
reads, in this process or in a pool child (sqlease._core.clock_slots). A lease is lost for
this process when the database refuses its renewal or when its deadline passes first (the
database was not reached in time): its slot then reads lost, it is no longer renewed, a
``lease_lost`` event is recorded (when the database can be reached) and the holder's callback
is told. It stays known as lost until it is dropped, so that its ack is refused here
(``drop_all_for_ack``) and never reaches a database that may still hold the lease for it.

Each lease may name its holder (a Kombu channel's QoS, ``Holder``). A holder collected
without being closed (a Kombu connection dropped without ``close()``) abandons its leases:
the next beat gives them back, where renewing them would keep its messages for the life of
the process.

A renewal waits no longer than the latest deadline it could extend (sqlease._db.bounds): a
database that does not answer makes it give up and close its connection, and the next beat
opens a new one. It runs on its own thread, never on the worker's event loop.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from sqlease._core.clock_slots import ClockSlots
from sqlease._core.lease_clock import LOST, Monotonic, deadline_after
from sqlease._core.store import Store
from sqlease._db.bounds import bounded
from sqlease.types import Fence

logger = logging.getLogger(__name__)

LostCallback = Callable[[Fence], None]


class Holder:
    """Who holds leases through the heartbeat. It holds no reference to its owner: the owner
    calls ``abandon`` from its finalizer (``weakref.finalize``), which must take no lock."""

    __slots__ = ("abandoned",)

    def __init__(self) -> None:
        self.abandoned = False

    def abandon(self) -> None:
        self.abandoned = True


@dataclass
class _Held:
    store: Store
    lease_ms: int
    interval: float
    task_id: str | None
    on_lost: LostCallback | None
    #: The lease clock: the last moment (monotonic) the lease can be held, LOST once lost.
    deadline: float
    #: Its slot in the shared clock table.
    slot: str
    #: Lost by the database's refusal (not by the clock): its ack is the database's to judge.
    refused: bool = False
    holder: Holder | None = None


class Heartbeat:
    def __init__(self, *, monotonic: Monotonic = time.monotonic, slots: ClockSlots | None = None):
        self._lock = threading.Lock()
        self._held: dict[Fence, _Held] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._sleeping_for = 0.0
        self._monotonic = monotonic
        self._slots = slots
        self.renewals = 0  # statements issued, for tests and stats

    # ---- bookkeeping -----------------------------------------------------------------

    def hold(
        self,
        store: Store,
        fence: Fence,
        *,
        lease_ms: int,
        interval: float,
        sent_at: float,
        task_id: str | None = None,
        on_lost: LostCallback | None = None,
        holder: Holder | None = None,
    ) -> None:
        """Keep renewing ``fence``'s lease, claimed by a statement sent at ``sent_at`` (this
        clock) and confirmed: its lease clock starts there."""
        self.hold_all(
            store,
            [(fence, task_id)],
            lease_ms=lease_ms,
            interval=interval,
            sent_at=sent_at,
            on_lost=on_lost,
            holder=holder,
        )

    def hold_all(
        self,
        store: Store,
        held: Sequence[tuple[Fence, str | None]],
        *,
        lease_ms: int,
        interval: float,
        sent_at: float,
        on_lost: LostCallback | None = None,
        holder: Holder | None = None,
    ) -> list[str]:
        """``hold`` for each ``(fence, task_id)`` of one claim (one lock, one slot-table
        lock for those new here: a busy worker holds a claim's batch per statement); where
        each one's lease clock is published (its ``delivery_info`` slot), in order."""
        if not held:
            return []
        deadline = deadline_after(sent_at, lease_ms / 1000.0)
        with self._lock:
            slots = self._slots
            if slots is None:
                slots = self._slots = ClockSlots()
            known = self._held
            new = list(dict.fromkeys(f for f, _ in held if f not in known))
            fresh = dict(zip(new, slots.take_all(new, deadline), strict=True)) if new else {}
            slot_refs: list[str] = []
            for fence, task_id in held:
                mine = known.get(fence)
                if mine is None:
                    slot = fresh[fence]
                else:  # held already (a renewed hold): its slot, the new deadline
                    slot = mine.slot
                    slots.write(slot, fence, deadline)
                known[fence] = _Held(
                    store, lease_ms, interval, task_id, on_lost, deadline, slot, holder=holder
                )
                slot_refs.append(slot)
            self._ensure_thread()
            # The thread may be asleep for a longer interval than this lease allows.
            if interval < self._sleeping_for:
                self._wake.set()
        return slot_refs

    def drop(self, fences: Iterable[Fence]) -> None:
        """Forget leases (call before acking or releasing them, so that a renewal racing with
        the ack is not mistaken for a lost lease)."""
        with self._lock:
            for fence in fences:
                held = self._held.pop(fence, None)
                if held is not None and self._slots is not None:
                    self._slots.free(held.slot)

    def drop_all_for_ack(self, fences: Iterable[Fence]) -> list[tuple[Fence, float | None]]:
        """Forget ``fences`` as they are acked: those whose ack may be sent, each with its
        lease clock. Not one whose clock ran out here: the database may still hold its lease
        while its task stopped or its result was refused. One not held here, or whose
        renewal the database refused, is the database's to judge (its clock None)."""
        now = self._monotonic()
        sendable: list[tuple[Fence, float | None]] = []
        with self._lock:
            for fence in fences:
                held = self._held.pop(fence, None)
                if held is not None and self._slots is not None:
                    self._slots.free(held.slot)
                if held is None or held.refused:
                    sendable.append((fence, None))
                elif held.deadline != LOST and held.deadline >= now:
                    sendable.append((fence, held.deadline))
        return sendable

    def holds(self, fence: Fence) -> bool:
        """``fence`` is held and renewed (not known lost)."""
        with self._lock:
            held = self._held.get(fence)
            return held is not None and held.deadline != LOST

    def alive_count(self) -> int:
        """Leases held here whose clock has not run out: the database may still hold them for
        this process."""
        now = self._monotonic()
        with self._lock:
            return sum(1 for held in self._held.values() if held.deadline >= now)

    def deadline_of(self, fence: Fence) -> float | None:
        """``fence``'s lease clock (``LOST`` once lost; None if not held here)."""
        with self._lock:
            held = self._held.get(fence)
            return None if held is None else held.deadline

    def clock_ref(self, fence: Fence) -> str | None:
        """Where ``fence``'s deadline is published (for its ``delivery_info``)."""
        with self._lock:
            held = self._held.get(fence)
            return None if held is None else held.slot

    # ---- the thread ------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="sqlease-heartbeat", daemon=True)
            self._thread.start()

    def _interval(self) -> float:
        with self._lock:
            live = [h.interval for h in self._held.values() if h.deadline != LOST]
        return min(live) if live else 1.0

    def _run(self) -> None:
        while not self._stopping:
            interval = self._interval()
            with self._lock:
                self._sleeping_for = interval
            self._wake.wait(interval)
            self._wake.clear()
            with self._lock:
                self._sleeping_for = 0.0
            if self._stopping:
                break
            try:
                self.beat()
            except Exception:  # never let the heartbeat die; the next beat retries
                logger.exception("sqlease heartbeat failed; retrying at the next interval")

    def beat(self) -> None:
        """Renew every held lease now (the thread calls this every interval); leases whose
        clock ran out are lost first, without asking the database."""
        now = self._monotonic()
        run_out: list[tuple[Fence, _Held]] = []
        groups: dict[tuple[int, int], list[tuple[Fence, _Held]]] = {}
        abandoned: list[tuple[Fence, _Held]] = []
        with self._lock:
            for fence, held in list(self._held.items()):
                if held.holder is not None and held.holder.abandoned:
                    del self._held[fence]
                    if self._slots is not None:
                        self._slots.free(held.slot)
                    if held.deadline != LOST:
                        abandoned.append((fence, held))
                    continue
                if held.deadline == LOST:
                    continue
                if held.deadline < now:
                    self._mark_lost(fence, held)
                    run_out.append((fence, held))
                    continue
                groups.setdefault((id(held.store), held.lease_ms), []).append((fence, held))
        until = now + min((h.lease_ms for _, h in run_out), default=0) / 1000.0
        self._report(
            [(f, h, "its lease clock ran out before a renewal was confirmed") for f, h in run_out],
            until,
        )
        # Given back before the renewals: a renewal on a slow or unreachable database may wait
        # as long as its leases last, and these messages are to be delivered again now.
        if abandoned:
            self._give_back(abandoned)
        for entries in groups.values():
            self._renew(entries)

    def _give_back(self, abandoned: list[tuple[Fence, _Held]]) -> None:
        """Give back the leases of holders collected unclosed (their messages delivered
        again now, the attempt refunded as a closed channel's are); a lease that cannot be
        given back runs out."""
        logger.warning(
            "sqlease: %d unacked message(s) of a Kombu connection that was garbage-collected "
            "without being closed are given back",
            len(abandoned),
        )
        by_store: dict[int, list[tuple[Fence, _Held]]] = {}
        for fence, held in abandoned:
            by_store.setdefault(id(held.store), []).append((fence, held))
        for entries in by_store.values():
            self._release(entries)

    def _release(self, entries: list[tuple[Fence, _Held]]) -> None:
        latest = max(held.deadline for _, held in entries)
        try:
            with bounded(lambda: latest - self._monotonic()):
                entries[0][1].store.release([f for f, _ in entries], refund=True)
        except Exception:
            logger.warning("sqlease: could not give them back; their leases run out")
            logger.debug("the release's error", exc_info=True)

    def _renew(self, entries: list[tuple[Fence, _Held]]) -> None:
        store = entries[0][1].store
        lease_ms = entries[0][1].lease_ms
        # Worth waiting for only while one of them may still be held.
        latest = max(held.deadline for _, held in entries)
        sent = self._monotonic()
        try:
            with bounded(lambda: latest - self._monotonic()):
                renewed = store.renew([f for f, _ in entries], lease_ms=lease_ms)
        except Exception as exc:
            # Each beat of an outage would repeat the same traceback: its first line will do.
            logger.warning(
                "sqlease could not renew %d lease(s) (%s); will retry",
                len(entries),
                str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
            )
            logger.debug("the renewal's error", exc_info=True)
            return
        self.renewals += 1
        confirmed = deadline_after(sent, lease_ms / 1000.0)
        now = self._monotonic()
        lost: list[tuple[Fence, _Held, str]] = []
        with self._lock:
            for fence, held in entries:
                if self._held.get(fence) is not held or held.deadline == LOST:
                    continue  # acked or released meanwhile, or lost already
                if fence.message_id not in renewed:
                    self._mark_lost(fence, held)
                    held.refused = True
                    lost.append((fence, held, "the database refused its renewal"))
                elif held.deadline < now:
                    # Confirmed, but after its clock ran out: the task may have stopped.
                    self._mark_lost(fence, held)
                    lost.append((fence, held, "its renewal was confirmed after its clock ran out"))
                elif confirmed > held.deadline:
                    held.deadline = confirmed
                    assert self._slots is not None
                    self._slots.write(held.slot, fence, confirmed)
        self._report(lost, now + lease_ms / 1000.0)

    def _mark_lost(self, fence: Fence, held: _Held) -> None:
        """(Under the lock.) Lost for good: no longer renewed; its slot reads lost."""
        held.deadline = LOST
        if self._slots is not None:
            self._slots.write(held.slot, fence, LOST)

    def _report(self, lost: list[tuple[Fence, _Held, str]], until: float) -> None:
        """Report lost leases: logged and their holders told first, then their events
        recorded if the database answers by ``until`` (one budget for all: a database out of
        reach must not hold the beat for a lease each)."""
        for fence, held, why in lost:
            self._tell(fence, held, why)
        for fence, held, why in lost:
            self._record(fence, held, why, until)

    def _tell(self, fence: Fence, held: _Held, why: str) -> None:
        logger.warning(
            "sqlease lease lost: message %s attempt %s (%s: taken over, expired, paused, "
            "cancelled or out of reach); its result and ack will be refused",
            fence.message_id,
            fence.attempt,
            why,
            extra={"message_id": fence.message_id, "attempt": fence.attempt},
        )
        if held.on_lost is not None:
            try:
                held.on_lost(fence)
            except Exception:
                logger.exception("lease-lost callback failed")

    def _record(self, fence: Fence, held: _Held, why: str, until: float) -> None:
        try:
            with bounded(lambda: until - self._monotonic()):
                held.store.record_event(
                    "lease_lost",
                    {"owner": fence.owner, "why": why},
                    task_id=held.task_id,
                    message_id=fence.message_id,
                    attempt=fence.attempt,
                )
        except Exception:
            logger.debug("could not record lease_lost event", exc_info=True)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()


_heartbeat = Heartbeat()


def heartbeat() -> Heartbeat:
    """The process's heartbeat."""
    return _heartbeat


def _reset_after_fork() -> None:
    # A forked child holds no leases of its own (the parent holds them) and has no thread; it
    # reads the parent's clock slots (their files), never writes them.
    global _heartbeat
    _heartbeat = Heartbeat()


os.register_at_fork(after_in_child=_reset_after_fork)
