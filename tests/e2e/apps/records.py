"""Execution records shared by the e2e apps: one row per task execution in a SQLite file
(``E2E_RECORDS``), written from inside the worker's pool processes. Standard library only."""

from __future__ import annotations

import os
import sqlite3
import time
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS executions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL,
    name TEXT NOT NULL,
    label TEXT,
    attempt INTEGER,
    message_id INTEGER,
    retries INTEGER,
    routing_key TEXT,
    run_id TEXT,
    hostname TEXT,
    pid INTEGER NOT NULL,
    started REAL NOT NULL,
    ended REAL
)
"""


def init_records(path: str) -> None:
    """Create the executions file in WAL mode (readers never block writers). The test process
    does this once before any worker starts: switching a file to WAL needs an exclusive lock
    that SQLite does not wait for, so pool processes doing it at once fail "database is
    locked"."""
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(SCHEMA)
    finally:
        conn.close()


def connect_records(path: str) -> sqlite3.Connection:
    """A connection to the executions file (autocommit; waits up to 30 s for the lock)."""
    return sqlite3.connect(path, timeout=30, isolation_level=None)


def start(task: Any, label: str | None) -> int:
    request = task.request
    properties = getattr(request, "properties", None) or {}
    info = properties.get("delivery_info") or {}
    headers = getattr(request, "headers", None) or {}
    conn = connect_records(os.environ["E2E_RECORDS"])
    try:
        cursor = conn.execute(
            "INSERT INTO executions (task_id, name, label, attempt, message_id, retries, "
            "routing_key, run_id, hostname, pid, started) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                request.id,
                task.name,
                label,
                info.get("sqlease_attempt"),
                info.get("sqlease_id"),
                request.retries,
                (request.delivery_info or {}).get("routing_key"),
                headers.get("run_id", getattr(request, "run_id", None)),
                request.hostname,
                os.getpid(),
                time.time(),
            ),
        )
        row_id = cursor.lastrowid
    finally:
        conn.close()
    assert row_id is not None
    return row_id


def end(row_id: int) -> None:
    conn = connect_records(os.environ["E2E_RECORDS"])
    try:
        conn.execute("UPDATE executions SET ended = ? WHERE id = ?", (time.time(), row_id))
    finally:
        conn.close()
