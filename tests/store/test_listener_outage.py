"""A LISTEN connection while the server cannot be reached: one warning for the outage, at most
one try a second (every caller polls meanwhile), and a note when it listens again."""

from __future__ import annotations

import logging
import time
import uuid
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from sqlease._db.postgresql import listener as wakeup

pytestmark = [pytest.mark.pg, pytest.mark.timeout(60)]


def test_an_outage_is_warned_once_and_tried_at_most_once_a_second(
    pg_database_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    monkeypatch.setattr(wakeup, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=time.sleep))
    real_connect = psycopg.connect
    tries: list[float] = []
    down = [True]

    def connect(*args: Any, **kwargs: Any) -> Any:
        tries.append(now[0])
        if down[0]:
            raise psycopg.OperationalError("connection refused")
        return real_connect(*args, **kwargs)

    monkeypatch.setattr(wakeup.psycopg, "connect", connect)
    listener = wakeup.PostgresListener(make_url(pg_database_url), f"c{uuid.uuid4().hex[:8]}")
    with caplog.at_level(logging.DEBUG, logger=wakeup.__name__):
        assert listener.pending() is None  # "look everywhere"
        assert listener.pending() is None and listener.fileno() is None
        assert tries == [1000.0]  # not tried again within the second
        now[0] += wakeup.RETRY_LISTEN_S
        assert listener.pending() is None
        assert tries == [1000.0, 1001.0]
        down[0] = False
        now[0] += wakeup.RETRY_LISTEN_S
        assert listener.pending() == set()  # listening again
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "sqlease could not LISTEN for wake-ups (OperationalError); polling meanwhile"
    ]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["sqlease: listening for wake-ups again, after 2.0 s of polling"]
    generation = listener.generation
    listener._drop()  # a broken connection (not a failed try) is re-opened at its next use
    assert listener.pending() == set() and listener.generation == generation + 1
    listener._drop()
