"""The Celery app every broker runs in benchmarks/celery_bench.py (same tasks, same settings).

Tasks report to the benchmark process by one UDP datagram on loopback, so completion is
counted the same way for every broker and result backend."""

from __future__ import annotations

import json
import os
import socket
import time

from celery import Celery
from celery.signals import task_success

import sqlease  # registers the sqlease transport  # noqa: F401

BROKER = os.environ.get("BENCH_BROKER", "memory://")
BACKEND = os.environ.get("BENCH_BACKEND") or None
UDP_PORT = int(os.environ.get("BENCH_UDP", "0"))

app = Celery("bench", broker=BROKER, backend=BACKEND)
app.conf.update(
    worker_prefetch_multiplier=4,
    # BENCH_TRANSPORT_OPTIONS: JSON merged into sqlease's options (e.g. '{"handoff": false}')
    broker_transport_options={
        "table_prefix": os.environ.get("BENCH_PREFIX", "sqlease_"),
        # For comparison: the worker's statements on a background thread (the fallback for a
        # psycopg without the statement generator its event loop drives).
        **({"loop_statements": False} if os.environ.get("BENCH_SQLEASE_CLAIMS_THREAD") else {}),
        **json.loads(os.environ.get("BENCH_TRANSPORT_OPTIONS") or "{}"),
    }
    if BROKER.startswith("sqlease")
    # BENCH_BROKER_OPTIONS: another broker's transport options (e.g. '{"confirm_publish": true}')
    else json.loads(os.environ.get("BENCH_BROKER_OPTIONS") or "{}"),
    result_backend_transport_options={},
    worker_hijack_root_logger=False,
)
if os.environ.get("BENCH_ACKS_LATE"):
    # Another broker acking as sqlease does by default: after the task ran, and a task whose
    # pool process died given back (like for like: a worker killed mid-task loses nothing).
    app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True)
_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def _report(payload: bytes) -> None:
    if UDP_PORT:
        _sock.sendto(payload, ("127.0.0.1", UDP_PORT))


@app.task(name="bench.noop", ignore_result=True)
def noop() -> None:
    _report(b"d")


@app.task(name="bench.stamp", ignore_result=True)
def stamp(sent: float) -> None:
    _report(f"l{time.time() - sent:.6f}".encode())


@app.task(name="bench.add")
def add(x: int, y: int) -> int:
    return x + y


#: bench.timed's own start and end (wall clock), reported once its result is stored
_timed: dict[str, float] = {}


@app.task(name="bench.timed")
def timed() -> int:
    """``benchmarks/get_split.py``: the task's start and end, reported with the moment its
    result was stored (the ``task_success`` signal, which Celery sends after the result
    backend's write returned)."""
    _timed["start"] = time.time()
    _timed["end"] = time.time()
    return 4


@app.task(name="bench.stored")
def stored(x: int) -> int:
    """``benchmarks/celery_bench.py``'s drain with a result backend: counted once its result is
    stored (``task_success`` fires after the backend's write returned)."""
    return x


@task_success.connect(sender=stored)
def _stored(**_: object) -> None:
    _report(b"s")


@task_success.connect(sender=timed)
def _timed_stored(**_: object) -> None:
    _report(f"g{_timed.pop('start'):.6f},{_timed.pop('end'):.6f},{time.time():.6f}".encode())


@app.task(name="bench.ident")
def ident(x: int) -> int:
    """``benchmarks/chord_bench.py``: a chord's header part (Celery's ``identity``)."""
    return x


@app.task(name="bench.tsum")
def tsum(values: list[int]) -> int:
    """``benchmarks/chord_bench.py``: a chord's body (Celery's ``tsum``)."""
    return sum(values)
