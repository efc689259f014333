"""``python -m sqlease demo``: a worker on embedded SQLite is killed mid-task (SIGKILL, no
cleanup); another worker takes the task over when the lease expires and resumes it from its
last checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PAGES = 12


def _say(text: str) -> None:
    print(text, flush=True)


def _start_worker(name: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "sqlease.cli._demo_app",
        "worker",
        "--pool",
        "prefork",
        "-c",
        "1",
        "-l",
        "warning",
        "-n",
        f"{name}@%h",
        "--without-mingle",
        "--without-gossip",
    ]
    handle = log.open("ab")
    return subprocess.Popen(
        command, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
    )


def _kill(worker: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(worker.pid, sig)
    except ProcessLookupError:
        pass
    try:
        worker.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


def run(workdir: str | None = None, *, pages: int = PAGES, kill_after_page: int = 4) -> int:
    folder = Path(workdir or tempfile.mkdtemp(prefix="sqlease-demo-"))
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "demo.db"
    url = f"sqlease+sqlite:///{db}"
    env = dict(os.environ, SQLEASE_DEMO_URL=url)
    os.environ["SQLEASE_DEMO_URL"] = url
    from sqlease.cli import _demo_app as demo_app
    from sqlease.store import Store

    log = folder / "workers.log"
    _say(f"sqlease demo: broker and results in {db} (SQLite, WAL)")
    _say("lease 3 s, heartbeat every 1 s; worker logs in " + str(log))
    workers: list[subprocess.Popen[bytes]] = []
    try:
        first = _start_worker("worker1", env, log)
        workers.append(first)
        _say(f"\n[1] started worker 1 (pid {first.pid})")
        result = demo_app.import_catalog.delay(pages)
        _say(f"[2] sent import_catalog({pages} pages): task {result.id}")
        store = Store(f"sqlite:///{db}")
        seen = 0
        deadline = time.monotonic() + 60
        while seen < kill_after_page and time.monotonic() < deadline:
            record = store.get_task(result.id)
            page = int(record.checkpoint.get("page", 0)) if record else 0
            if page != seen:
                seen = page
                _say(f"    worker 1 checkpointed page {page}/{pages}")
            time.sleep(0.05)
        _kill(first, signal.SIGKILL)
        _say(f"[3] killed worker 1 with SIGKILL after page {seen}: no cleanup, no ack")
        second = _start_worker("worker2", env, log)
        workers.append(second)
        _say(
            f"[4] started worker 2 (pid {second.pid}); it takes the task over once the dead "
            "worker's lease expires"
        )
        outcome: Any = result.get(timeout=90)
        _say(f"[5] finished: {outcome}")
        _say(
            f"    resumed from page {outcome['resumed_from']} on delivery attempt "
            f"{outcome['attempt']}: pages 1-{outcome['resumed_from']} were not redone"
        )
        _say("\ntimeline of the task:")
        events = store.events(task_id=result.id)
        start = events[0].at_ms if events else 0
        for event in events:
            if event.kind == "checkpoint":
                detail = f"page {event.data.get('checkpoint', {}).get('page')}"
            elif event.kind == "claimed":
                host, pid = [*str(event.data.get("owner", "?:?")).split(":"), "?"][:2]
                detail = f"by {host} pid {pid}"
            else:
                detail = ""
            _say(
                f"  +{(event.at_ms - start) / 1000:6.2f}s  attempt {event.attempt}  "
                f"{event.kind:<10} {detail}"
            )
        ok = outcome["pages"] == pages and outcome["attempt"] >= 2
        _say("\nnothing lost, nothing redone." if ok else "\nunexpected outcome")
        return 0 if ok else 1
    finally:
        for worker in workers:
            if worker.poll() is None:
                _kill(worker, signal.SIGTERM)
