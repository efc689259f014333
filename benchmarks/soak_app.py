"""The Celery app of benchmarks/soak.py: one task whose argument says how it ends.

Each execution reports to the soak process by one UDP datagram on loopback,
``"<outcome> <tag> <seconds late>"``: outcome ``s`` (succeeded), ``f`` (raised), ``j``
(rejected: a dead message), ``r`` (asked for a retry); tag ``m`` (the steady stream), ``e``
(an ETA task), ``b`` (the backlog queue), ``c`` (the capacity batch); the lateness is the
start time minus when the task was due (its publish, or its ETA). The sqlease maintenance
pass's summaries and sqlease's warnings travel the same way (``M …`` / ``W …``), so the soak
sees what each pass pruned without reading the worker's log.

Settings come from the environment (set by soak.py): SOAK_BROKER (the broker and result
backend URL), SOAK_TRANSPORT_OPTIONS (JSON), SOAK_RESULT_EXPIRES (seconds), SOAK_UDP.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from celery import Celery, signals
from celery.exceptions import Reject

import sqlease  # registers the sqlease transport  # noqa: F401

BROKER = os.environ.get("SOAK_BROKER", "sqlease+postgresql://postgres@127.0.0.1:55433/postgres")
UDP_PORT = int(os.environ.get("SOAK_UDP", "0"))

app = Celery("soak", broker=BROKER, backend=BROKER)
app.conf.update(
    broker_transport_options=json.loads(os.environ.get("SOAK_TRANSPORT_OPTIONS") or "{}"),
    result_expires=float(os.environ.get("SOAK_RESULT_EXPIRES", "180")),
    worker_hijack_root_logger=False,
)
_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def _report(payload: str) -> None:
    if UDP_PORT:
        try:
            _sock.sendto(payload.encode()[:60000], ("127.0.0.1", UDP_PORT))
        except OSError:
            pass


@app.task(name="soak.work", bind=True, max_retries=3)
def work(self: Any, due: float, kind: str = "ok", tag: str = "m") -> float:
    """``kind``: ``ok``, ``fail`` (raises), ``reject`` (Reject without requeue: the message is
    kept dead), ``retry`` (asks for one retry a second later, then succeeds)."""
    late = time.time() - due
    if kind == "retry" and self.request.retries == 0:
        _report(f"r {tag} {late:.6f}")
        raise self.retry(countdown=1)
    if kind == "fail":
        _report(f"f {tag} {late:.6f}")
        raise ValueError("soak: a planned failure")
    if kind == "reject":
        _report(f"j {tag} {late:.6f}")
        raise Reject("soak: a planned reject", requeue=False)
    # A retried task reports as the tag "t": its start is due a second after the retry.
    _report(f"s {'t' if self.request.retries else tag} {late:.6f}")
    return due


class _UdpLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:
            return
        if record.levelno >= logging.WARNING:
            _report(f"W {record.name}: {text}")
        elif text.startswith("sqlease maintenance:"):
            _report(f"M {text}")


def _install_log_handler(**_: Any) -> None:
    handler = _UdpLog(logging.INFO)
    logger = logging.getLogger("sqlease")
    if not any(isinstance(h, _UdpLog) for h in logger.handlers):
        logger.addHandler(handler)
    # The maintenance pass logs its summary at INFO; the worker runs at -l warning.
    logging.getLogger("sqlease._core.maintenance").setLevel(logging.INFO)


signals.after_setup_logger.connect(_install_log_handler, weak=False)
signals.worker_process_init.connect(_install_log_handler, weak=False)
