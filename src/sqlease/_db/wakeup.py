"""What idle clients wait on: the ``Waker`` protocol, and the waker that only polls.

Each dialect has its own: PostgreSQL's LISTEN connection (sqlease._db.postgresql.listener),
SQLite's watch of the file's ``data_version`` (sqlease._db.sqlite.watcher). Neither is relied
on for correctness: a lost notification only costs latency, because every consumer also polls
on a safety interval.
"""

from __future__ import annotations

import time
from typing import Any, Protocol


def close_quietly(conn: Any) -> None:
    if conn is not None:
        try:
            conn.close()
        except Exception:
            pass


class Waker(Protocol):
    """What consumers wait on. Callers ask ``pushes`` instead of the dialect: a pushing waker
    (LISTEN) delivers each notification's payload (a queue name, a handoff, a result), so a
    caller may act on what it names and nap longer between safety polls; a watching one
    (``data_version``) only notices that something changed, so its payloads are always None,
    which means "look everywhere"."""

    #: Notifications arrive with their payloads (True), or only as "something changed".
    pushes: bool
    #: ``ready()`` notices another connection's commit cheaply: worth checking every few
    #: milliseconds (SQLite's ``data_version``), not only at the safety poll.
    watches: bool
    #: Counts the connections made: while it is unchanged, no notification was missed.
    generation: int

    def fileno(self) -> int | None:
        """A socket the event loop can watch, or None (then the loop polls)."""

    def ready(self) -> bool:
        """Consume pending signals without blocking; True if anything may have changed."""

    def pending(self) -> set[str] | None:
        """Consume pending signals without blocking: their payloads, or None when the waker
        cannot tell (no connection, a broken one, or a waker that carries no payloads)."""

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a signal; True if one came."""

    def wait_payloads(self, timeout: float) -> list[str] | None:
        """Block up to ``timeout`` seconds for a signal: the payloads that came (empty if
        none did), or None when the waker cannot tell."""

    @property
    def connected(self) -> bool:
        """Listening without a break now (a watching waker always is)."""

    def close(self) -> None: ...


class PollingWaker:
    """No push at all (PostgreSQL behind a pooler in transaction mode, without a direct
    listen connection): every wait is the safety poll, so an idle worker finds new work within
    its ``polling_interval`` and ``AsyncResult.get()`` within its interval."""

    pushes = False
    watches = False
    generation = 0

    def fileno(self) -> int | None:
        return None

    def ready(self) -> bool:
        return False

    def pending(self) -> set[str] | None:
        return None

    @property
    def connected(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
        time.sleep(max(timeout, 0.0))
        return False

    def wait_payloads(self, timeout: float) -> list[str] | None:
        self.wait(timeout)
        return None

    def close(self) -> None:
        pass
