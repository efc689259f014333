"""A real Flower (the PyPI package) against a worker on sqlease: its API lists the worker,
the tasks with their states and runtimes, a task's detail, and revokes and rate-limits
through remote control, as it does on Redis or RabbitMQ."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest

from .conftest import E2E, wait_for

pytest.importorskip("flower")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(base: str, path: str) -> Any:
    with urllib.request.urlopen(f"{base}{path}", timeout=10) as response:
        return json.loads(response.read())


def _post(base: str, path: str, **form: str) -> Any:
    data = urllib.parse.urlencode(form).encode()
    with urllib.request.urlopen(f"{base}{path}", data=data, timeout=10) as response:
        return json.loads(response.read())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_flowers_api_sees_workers_tasks_and_controls_them(e2e: E2E) -> None:
    worker = e2e.start_worker(events=True, concurrency=2)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(e2e.tmp / "flower.log", "wb")  # noqa: SIM115 - closed below
    flower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "e2e_app",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            "--purge_offline_workers=0",
        ],
        env=e2e.env(FLOWER_UNAUTHENTICATED_API="true"),
        cwd=e2e.tmp,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def up() -> bool:
            try:
                return bool(_get(base, "/api/workers?refresh=1"))
            except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
                return False

        wait_for(up, 60, "Flower to see the worker")
        workers = _get(base, "/api/workers?refresh=1")
        assert worker.nodename in workers, workers
        app = e2e.app()
        done = [app.tasks["e2e.add"].delay(i, i) for i in range(5)]
        later = app.tasks["e2e.add"].apply_async((1, 1), countdown=60)

        def tasks_seen() -> dict[str, Any]:
            found = _get(base, "/api/tasks")
            ok = all(found.get(r.id, {}).get("state") == "SUCCESS" for r in done)
            return found if ok else {}

        tasks = wait_for(tasks_seen, 60, "Flower to list the tasks as SUCCESS")
        first = tasks[done[0].id]
        assert first["name"] == "e2e.add" and first["runtime"] is not None
        assert first["worker"] == worker.nodename
        info = _get(base, f"/api/task/info/{done[0].id}")
        assert info["state"] == "SUCCESS" and info["result"] in ("0", 0)
        assert "revoked" in _post(base, f"/api/task/revoke/{later.id}")["message"].lower()
        limited = _post(
            base, "/api/task/rate-limit/e2e.add", workername=worker.nodename, ratelimit="10/m"
        )
        assert "rate limit" in limited.get("message", "").lower(), limited
    finally:
        os.killpg(flower.pid, signal.SIGTERM)
        try:
            flower.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(flower.pid, signal.SIGKILL)
            flower.wait(timeout=10)
        log.close()
    # Flower's revoke is Celery's, which sqlease makes durable: the scheduled task is cancelled
    # in the database, not only in the worker's memory.
    wait_for(lambda: e2e.admin.task(later.id).state == "cancelled", 30, "the durable revoke")
