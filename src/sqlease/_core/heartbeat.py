"""One heartbeat per process: renews every lease the process holds, in one statement per store.

Renewals are single-flight (the thread renews, waits, renews again; no renewal starts before
the previous one returned). A lease the database no longer confirms is dropped from the
bookkeeping, recorded as a ``lease_lost`` event, and reported to the holder's callback; the
task that runs under it learns at its next fenced write.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlease._core.store import Store
from sqlease.types import Fence

logger = logging.getLogger(__name__)

LostCallback = Callable[[Fence], None]


@dataclass
class _Held:
    store: Store
    lease_ms: int
    interval: float
    task_id: str | None
    on_lost: LostCallback | None


class Heartbeat:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Fence, _Held] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._sleeping_for = 0.0
        self.renewals = 0  # statements issued, for tests and stats

    # ---- bookkeeping -----------------------------------------------------------------

    def hold(
        self,
        store: Store,
        fence: Fence,
        *,
        lease_ms: int,
        interval: float,
        task_id: str | None = None,
        on_lost: LostCallback | None = None,
    ) -> None:
        with self._lock:
            self._held[fence] = _Held(store, lease_ms, interval, task_id, on_lost)
            self._ensure_thread()
            # The thread may be asleep for a longer interval than this lease allows.
            if interval < self._sleeping_for:
                self._wake.set()

    def drop(self, fences: Iterable[Fence]) -> None:
        """Forget leases (call before acking or releasing them, so that a renewal racing with
        the ack is not mistaken for a lost lease)."""
        with self._lock:
            for fence in fences:
                self._held.pop(fence, None)

    def holds(self, fence: Fence) -> bool:
        with self._lock:
            return fence in self._held

    def held_count(self) -> int:
        with self._lock:
            return len(self._held)

    # ---- the thread ------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="sqlease-heartbeat", daemon=True)
            self._thread.start()

    def _interval(self) -> float:
        with self._lock:
            if not self._held:
                return 1.0
            return min(h.interval for h in self._held.values())

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
        """Renew every held lease now (the thread calls this every interval)."""
        with self._lock:
            groups: dict[tuple[int, int], list[tuple[Fence, _Held]]] = {}
            for fence, held in self._held.items():
                groups.setdefault((id(held.store), held.lease_ms), []).append((fence, held))
        for entries in groups.values():
            store = entries[0][1].store
            lease_ms = entries[0][1].lease_ms
            try:
                renewed = store.renew([f for f, _ in entries], lease_ms=lease_ms)
            except Exception:
                logger.warning(
                    "sqlease could not renew %d lease(s); will retry", len(entries), exc_info=True
                )
                continue
            self.renewals += 1
            for fence, held in entries:
                if fence.message_id in renewed:
                    continue
                with self._lock:
                    still_held = self._held.pop(fence, None) is not None
                if still_held:  # not acked or released meanwhile: really lost
                    self._lost(fence, held)

    def _lost(self, fence: Fence, held: _Held) -> None:
        logger.warning(
            "sqlease lease lost: message %s attempt %s (taken over, expired, paused or "
            "cancelled); its result will be refused",
            fence.message_id,
            fence.attempt,
            extra={"message_id": fence.message_id, "attempt": fence.attempt},
        )
        try:
            held.store.record_event(
                "lease_lost",
                {"owner": fence.owner},
                task_id=held.task_id,
                message_id=fence.message_id,
                attempt=fence.attempt,
            )
        except Exception:
            logger.debug("could not record lease_lost event", exc_info=True)
        if held.on_lost is not None:
            try:
                held.on_lost(fence)
            except Exception:
                logger.exception("lease-lost callback failed")

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()


_heartbeat = Heartbeat()


def heartbeat() -> Heartbeat:
    """The process's heartbeat."""
    return _heartbeat


def _reset_after_fork() -> None:
    # A forked child holds no leases of its own (the parent holds them) and has no thread.
    global _heartbeat
    _heartbeat = Heartbeat()


os.register_at_fork(after_in_child=_reset_after_fork)
