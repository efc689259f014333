"""Helpers for testing code that uses sqlease: a fake clock to inject into the store."""

from __future__ import annotations

import threading


class FakeClock:
    """A clock in epoch milliseconds that moves only when told to. Pass it as ``clock=``."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = int(start_ms)
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            return self._now

    def advance(self, ms: int) -> int:
        if ms < 0:
            raise ValueError("a clock never goes back")
        with self._lock:
            self._now += int(ms)
            return self._now

    def set(self, now_ms: int) -> None:
        with self._lock:
            self._now = int(now_ms)
