"""A worker's event loop never waits on the database for its own work (docs/explanation/
delivery.md): a real ``celery worker -P prefork`` on PostgreSQL runs one task at a time (the
handoff path), a burst, a countdown, a failure, a reject, a retry, a revoke and a remote-control
ping, then idles through safety polls; psycopg's blocking calls made meanwhile on the main
process's main thread (the loop's) are recorded (tests/e2e/apps/loop_app.py).

Claims, acks, takes, offers, due-time reads, rejects and releases go to the loop's runner, which
sends them without waiting, and a connection the runner needs is opened on a thread: none may
appear. What may: a publish from the loop (a remote-control reply, the worker's heartbeat
event), which is synchronous by Kombu's contract, and Celery's own result-backend calls in the
main process (a revoked task's state)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sqlease import Store
from sqlease.admin import Admin

from .apps.loop_app import make_app

pytestmark = [pytest.mark.pg, pytest.mark.timeout(180)]

APPS = Path(__file__).parent / "apps"
#: Who may make a blocking call on the loop thread: a publish (Kombu's synchronous contract)
#: and Celery's result backend.
ALLOWED = ("kombu/messaging.py:_publish", "backend/")


@pytest.fixture
def worker(pg_database_url: str, tmp_path: Path) -> Iterator[dict[str, object]]:
    prefix = f"loop{uuid.uuid4().hex[:8]}_"
    record = tmp_path / "blocking.jsonl"
    Store(pg_database_url, table_prefix=prefix)  # the tables, before the worker starts
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "loop_app",
                "worker",
                "-P",
                "prefork",
                "-c",
                "2",
                "-l",
                "info",
                "-n",
                "loop@e2e",
                "--without-mingle",
                "--without-gossip",
            ],
            env=dict(
                os.environ,
                LOOP_URL=pg_database_url,
                LOOP_PREFIX=prefix,
                LOOP_RECORD=str(record),
                PYTHONPATH=os.pathsep.join([str(APPS), os.environ.get("PYTHONPATH", "")]),
            ),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while "loop@e2e ready." not in log.read_text(errors="ignore"):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "worker not ready"
            time.sleep(0.1)
        yield {"url": pg_database_url, "prefix": prefix, "record": record, "log": log}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def test_the_loop_thread_makes_no_blocking_call_for_its_own_work(worker: dict) -> None:
    app = make_app(worker["url"], worker["prefix"])
    add = app.tasks["loop.add"]
    # Warm up: the pools' connections are opened, the first offers made.
    for _ in range(5):
        assert add.delay(1, 1).get(timeout=30) == 2
    time.sleep(1.0)
    start = time.time()

    for i in range(20):  # one at a time: handoffs to the idle worker's offer
        assert add.delay(i, 1).get(timeout=30) == i + 1
    burst = [add.delay(i, i) for i in range(100)]  # claims with acks
    assert [r.get(timeout=60) for r in burst] == [2 * i for i in range(100)]
    assert app.tasks["loop.late"].delay(7).get(timeout=30) == 7
    assert add.apply_async((2, 3), countdown=1).get(timeout=30) == 5  # a due-time read
    with pytest.raises(ValueError, match="this task fails"):
        app.tasks["loop.fail"].delay().get(timeout=30)
    rejected = app.tasks["loop.reject"].delay()
    assert app.tasks["loop.retry"].delay().get(timeout=30) == "retried"
    revoked = add.apply_async((1, 2), countdown=2)
    revoked.revoke()
    assert app.control.ping(timeout=2.0)  # a take of the remote-control queue, and a reply
    time.sleep(3.0)  # revoked's countdown passes; safety polls and idle offers
    assert revoked.state == "REVOKED"
    admin = Admin(f"sqlease+{worker['url']}", table_prefix=worker["prefix"])
    snapshot = admin.task(rejected.id)
    assert (snapshot.state, snapshot.reason) == ("failed", "rejected")
    end = time.time()

    calls = [json.loads(line) for line in worker["record"].read_text().splitlines()]
    window = [c for c in calls if start <= c["t"] <= end]
    assert any(any(a.startswith(ALLOWED) for a in c["at"]) for c in window), (
        "the recorder saw none of the publishes it should: it is not wired in"
    )
    own = [c for c in window if not any(a.startswith(ALLOWED) for a in c["at"])]
    assert not own, json.dumps(own[:5], indent=1)
    # Celery's events (the worker heartbeat every 2 s) are published off the loop: in a
    # partition they would hold it for as long as the partition lasts.
    events = [c for c in window if any(a.startswith("celery/events/") for a in c["at"])]
    assert not events, json.dumps(events[:3], indent=1)
