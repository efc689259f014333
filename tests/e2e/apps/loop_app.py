"""The app of the event-loop test (tests/e2e/test_loop_thread.py): a broker and a result
backend on one PostgreSQL URL (``LOOP_URL``), tables under ``LOOP_PREFIX``.

In the worker's main process it wraps psycopg's blocking calls (execute, commit, rollback,
connect) and appends to ``LOOP_RECORD`` one line for each made on the main thread, which runs
the event loop: when, what, and who asked (the frames of its stack in sqlease, Kombu and
Celery). Statements the loop sends without waiting go through psycopg's generator
(``Cursor._execute_gen``), which this does not wrap: those are the ones it is meant to send."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import psycopg
from celery import Celery
from celery.exceptions import Reject

import sqlease  # noqa: F401  (registers the sqlease transport)

MAIN_PID = os.getpid()
_RECORD = os.environ.get("LOOP_RECORD")


def _where() -> list[str]:
    """The stack's frames in sqlease (``transport/_channel.py:_put``), Kombu and Celery
    (``kombu/messaging.py:_publish``), innermost first."""
    frames = []
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        for package, keep in (("/sqlease/", ""), ("/kombu/", "kombu/"), ("/celery/", "celery/")):
            if package in path:
                part = path.rsplit(package, 1)[1]
                frames.append(f"{keep}{part}:{frame.f_code.co_name}")
                break
        frame = frame.f_back
    return frames


def _record(what: str, sql: Any = None) -> None:
    if _RECORD is None or os.getpid() != MAIN_PID:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    text = sql.decode() if isinstance(sql, bytes) else str(sql or "")
    line = {"t": time.time(), "what": what, "sql": " ".join(text.split())[:120], "at": _where()}
    with open(_RECORD, "a") as out:
        out.write(json.dumps(line) + "\n")


def _wrap(cls: Any, name: str) -> None:
    original = getattr(cls, name)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        _record(name, args[0] if args and name.startswith("execute") else None)
        return original(self, *args, **kwargs)

    setattr(cls, name, wrapped)


if _RECORD is not None:
    for _name in ("execute", "executemany"):
        _wrap(psycopg.Cursor, _name)
    for _name in ("commit", "rollback"):
        _wrap(psycopg.Connection, _name)
    _connect = psycopg.Connection.connect.__func__  # type: ignore[attr-defined]

    def _connect_recorded(cls: Any, *args: Any, **kwargs: Any) -> Any:
        _record("connect")
        return _connect(cls, *args, **kwargs)

    psycopg.Connection.connect = classmethod(_connect_recorded)  # type: ignore[method-assign,assignment]
    psycopg.connect = psycopg.Connection.connect  # type: ignore[assignment]


def make_app(url: str, prefix: str) -> Celery:
    app = Celery("loop", broker=f"sqlease+{url}", backend=f"sqlease+{url}", set_as_current=False)
    app.conf.update(
        broker_transport_options={
            "table_prefix": prefix,
            "lease_seconds": 10,
            "polling_interval": 0.5,
        },
        result_backend_transport_options={"table_prefix": prefix},
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=4,
        enable_utc=True,
    )

    @app.task(name="loop.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="loop.late", shared=False, acks_late=True)
    def late(x: int) -> int:
        return x

    @app.task(name="loop.fail", shared=False)
    def fail() -> None:
        raise ValueError("this task fails")

    @app.task(name="loop.reject", shared=False, acks_late=True)
    def reject() -> None:
        raise Reject("rejected on purpose", requeue=False)

    @app.task(name="loop.retry", shared=False, bind=True, max_retries=1)
    def retry(self: Any) -> str:
        if self.request.retries == 0:
            raise self.retry(countdown=0.2)
        return "retried"

    return app


if "LOOP_URL" in os.environ:
    app = make_app(os.environ["LOOP_URL"], os.environ["LOOP_PREFIX"])
