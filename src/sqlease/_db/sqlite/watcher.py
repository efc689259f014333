"""SQLite's waker: the file's ``data_version``, which changes when another connection
commits."""

from __future__ import annotations

import sqlite3
import time

from sqlease._db.wakeup import close_quietly as _close_quietly


class SqliteWatcher:
    """Notices commits by any other connection to the same SQLite file, cheaply: the
    ``data_version`` pragma changes when another connection commits, and reading it takes no
    lock."""

    pushes = False
    watches = True
    generation = 0  # no connection to break: nothing is ever missed for good

    def __init__(self, path: str, check_interval: float = 0.005) -> None:
        self._path = path
        self._check_interval = check_interval
        self._conn: sqlite3.Connection | None = None
        self._version: int | None = None

    def fileno(self) -> int | None:
        return None

    def _read(self) -> int | None:
        try:
            if self._conn is None:
                self._conn = sqlite3.connect(
                    self._path, isolation_level=None, check_same_thread=False
                )
            row = self._conn.execute("PRAGMA data_version").fetchone()
            return int(row[0])
        except sqlite3.Error:
            self.close()
            return None

    def ready(self) -> bool:
        version = self._read()
        changed = version is None or version != self._version
        self._version = version
        return changed

    def pending(self) -> set[str] | None:
        self.ready()
        return None  # a commit names no queue: look everywhere

    @property
    def connected(self) -> bool:
        return True

    def wait_payloads(self, timeout: float) -> list[str] | None:
        self.wait(timeout)
        return None

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if self.ready():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(self._check_interval, remaining))

    def close(self) -> None:
        conn, self._conn = self._conn, None
        _close_quietly(conn)

    def __del__(self) -> None:
        self.close()
