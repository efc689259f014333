"""A LISTEN connection nobody reads is closed before its notifications hold back VACUUM.

Unread, the channel's notifications fill the connection's socket; its server process then
blocks writing to it while it holds a snapshot (``backend_xmin``), and no VACUUM of the
database can remove a row deleted after that snapshot. Real time, short limits."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from sqlease._db.postgresql import listener as wakeup

pytestmark = [pytest.mark.pg, pytest.mark.timeout(120)]


def _backend(admin: psycopg.Connection[Any], app: str) -> tuple[Any, ...] | None:
    return admin.execute(
        "SELECT pid, backend_xmin, wait_event FROM pg_stat_activity WHERE application_name = %s",
        (f"{app}-listen",),
    ).fetchone()


def _flood(url: str, channel: str, stop: threading.Event) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        while not stop.is_set():
            # Short payloads, as the store's (queue names): the server process blocks while
            # it reads them out of the queue, under a snapshot.
            conn.execute(
                "SELECT pg_notify(%s, 'celery-' || i) FROM generate_series(1, 200) i",
                (channel,),
            )


def _listener(url: str, app: str, channel: str) -> wakeup.PostgresListener:
    from sqlalchemy.engine import make_url

    listener = wakeup.PostgresListener(
        make_url(url).update_query_dict({"application_name": app}), channel
    )
    assert listener.pending() == set()  # connects and listens
    return listener


def test_an_unread_listener_is_closed_and_releases_its_snapshot(
    pg_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wakeup, "REAP_EVERY_S", 0.1)
    monkeypatch.setattr(wakeup, "_reaper_pid", None)  # a reaper with the short interval
    monkeypatch.setattr(wakeup, "UNREAD_LIMIT_S", 3600.0)
    app, channel = f"reap{uuid.uuid4().hex[:6]}", f"c{uuid.uuid4().hex[:8]}"
    listener = _listener(pg_database_url, app, channel)
    stop = threading.Event()
    flood = threading.Thread(target=_flood, args=(pg_database_url, channel, stop), daemon=True)
    flood.start()
    try:
        with psycopg.connect(pg_database_url, autocommit=True) as admin:
            # Unread: the server process blocks writing to it, mostly while it holds a
            # snapshot (inside its read of the notification queue). It can also block in the
            # flush after that read, without one; the listener must be closed either way.
            deadline, blocked = time.monotonic() + 30, None
            while True:
                row = _backend(admin, app)
                if row is not None and row[2] == "ClientWrite":
                    blocked = row
                    if row[1] is not None:
                        break
                if time.monotonic() >= deadline:
                    assert blocked is not None, f"never blocked writing: {row}"
                    break
                time.sleep(0.1)
            monkeypatch.setattr(wakeup, "UNREAD_LIMIT_S", 0.5)
            deadline = time.monotonic() + 30
            while _backend(admin, app) is not None:
                assert time.monotonic() < deadline, "the unread listener was never closed"
                time.sleep(0.1)
        generation = listener.generation
        listener.pending()  # reopens at its next use, and says so
        assert listener.connected and listener.generation == generation + 1
    finally:
        stop.set()
        flood.join(10)
        listener.close()


def test_a_listener_that_is_read_stays_open(
    pg_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wakeup, "REAP_EVERY_S", 0.1)
    monkeypatch.setattr(wakeup, "_reaper_pid", None)
    monkeypatch.setattr(wakeup, "UNREAD_LIMIT_S", 0.5)
    app, channel = f"read{uuid.uuid4().hex[:6]}", f"c{uuid.uuid4().hex[:8]}"
    listener = _listener(pg_database_url, app, channel)
    stop = threading.Event()
    flood = threading.Thread(target=_flood, args=(pg_database_url, channel, stop), daemon=True)
    flood.start()
    try:
        generation, got = listener.generation, 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            got += len(listener.wait_payloads(0.2) or [])
        assert got > 0
        assert listener.connected and listener.generation == generation
    finally:
        stop.set()
        flood.join(10)
        listener.close()
