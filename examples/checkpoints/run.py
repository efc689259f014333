"""Kill a worker in the middle of a long task and watch another worker resume it from its
last checkpoint.

    python examples/checkpoints/run.py [--dir FOLDER]

Exits 0 when the task finished on attempt 2, resumed from the checkpointed page, and imported
every page exactly once; 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PAGES = 10
KILL_AFTER_PAGE = 4


def say(text: str = "") -> None:
    print(text, flush=True)


class Worker:
    """``celery -A tasks worker`` in its own session: it and its pool child form one process
    group, so ``os.killpg`` kills both at once, like a crash or an OOM kill of the machine."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        self.log = folder / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--pool", "prefork"]
        command += ["-c", "1", "-l", "warning", "-n", f"{name}@%h"]
        command += ["--without-mingle", "--without-gossip"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                command,
                cwd=HERE,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid = self.proc.pid

    def kill(self) -> None:
        """SIGKILL the whole process group: no cleanup, no ack, no goodbye."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Celery's warm shutdown (SIGTERM), or SIGKILL if it takes too long."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def folder_from_args() -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir",
        default=os.environ.get("SQLEASE_EXAMPLE_DIR"),
        help="folder for the databases and worker logs (default: a new temporary folder)",
    )
    folder = Path(parser.parse_args().dir or tempfile.mkdtemp(prefix="sqlease-checkpoints-"))
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("checkpoints.db", "catalog.db", "worker1.log", "worker2.log"):
        for suffix in ("", "-wal", "-shm"):
            (folder / (stale + suffix)).unlink(missing_ok=True)
    # tasks.py (here and in the workers, which inherit the environment) reads it.
    os.environ["SQLEASE_EXAMPLE_DIR"] = str(folder)
    return folder


def scenario(folder: Path, workers: list[Worker]) -> list[str]:
    """Run the scenario; returns the failed checks (empty when everything held)."""
    # Imported here: tasks.py reads SQLEASE_EXAMPLE_DIR, which folder_from_args() has set.
    import tasks

    import sqlease

    say(f"broker and results: {tasks.URL}")
    say(f"lease {tasks.app.conf.broker_transport_options['lease_seconds']} s; logs in {folder}")

    first = Worker("worker1", folder)
    workers.append(first)
    say(f"\n[1] started worker 1 (pid {first.pid})")
    result = tasks.import_catalog.delay(PAGES)
    say(f"[2] sent import_catalog({PAGES} pages): task {result.id}")

    admin = sqlease.Admin(tasks.URL)  # the producer's publish created the tables
    seen = 0
    deadline = time.monotonic() + 60
    while seen < KILL_AFTER_PAGE:
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker 1 did not reach page {KILL_AFTER_PAGE} in 60 s")
        page = int(admin.task(result.id).checkpoint.get("page", 0))
        if page != seen:
            seen = page
            say(f"    checkpoint page {page}/{PAGES}   AsyncResult: {result.state} {result.info}")
        time.sleep(0.05)
    first.kill()
    snap = admin.task(result.id)
    killed_at = int(snap.checkpoint["page"])
    say(f"[3] killed worker 1 with SIGKILL after page {killed_at}")
    say(f"    sqlease says: state={snap.state} attempt={snap.attempt} (its lease has not expired)")

    second = Worker("worker2", folder)
    workers.append(second)
    say(f"[4] started worker 2 (pid {second.pid}); it takes the task over when the lease expires")
    outcome: dict[str, Any] = result.get(timeout=60)
    say(f"[5] finished: {outcome}")

    say("\nimported pages (page, attempt):")
    imports = tasks.imported_pages()
    say("    " + ", ".join(f"({page}, {attempt})" for page, attempt, _ in imports))
    say("\ntimeline of the task:")
    deadline = time.monotonic() + 15
    while admin.task(result.id).state != "succeeded" and time.monotonic() < deadline:
        time.sleep(0.05)  # the result is stored; the worker acks right after
    events = admin.task(result.id).events
    start = events[0]["at_ms"] if events else 0
    for event in events:
        detail = ""
        if event["kind"] == "checkpoint":
            detail = f"page {(event['data'] or {}).get('checkpoint', {}).get('page')}"
        elif event["kind"] == "claimed":
            detail = f"by {(event['data'] or {}).get('owner')}"
        line = f"    +{(event['at_ms'] - start) / 1000:6.2f}s  attempt {event['attempt']}  "
        say(line + f"{event['kind']:<10} {detail}".rstrip())

    failures = []
    pages = [page for page, _, _ in imports]
    if outcome != {"pages": PAGES, "resumed_from": killed_at, "attempt": 2}:
        failures.append(f"expected resumed_from={killed_at} on attempt 2, got {outcome}")
    if pages != list(range(1, PAGES + 1)):
        failures.append(f"every page should be imported exactly once, in order: {pages}")
    expected = [(p, 1 if p <= killed_at else 2) for p in range(1, PAGES + 1)]
    if [(page, attempt) for page, attempt, _ in imports] != expected:
        failures.append("pages 1..N should come from attempt 1 and the rest from attempt 2")
    if result.state != "SUCCESS":
        failures.append(f"AsyncResult.state is {result.state}, not SUCCESS")
    if not failures:
        say(
            f"\nOK: resumed from page {killed_at} on attempt 2; "
            f"each of the {PAGES} pages was imported exactly once"
        )
    return failures


def main() -> int:
    folder = folder_from_args()
    workers: list[Worker] = []
    try:
        failures = scenario(folder, workers)
    except Exception as exc:
        failures = [f"{type(exc).__name__}: {exc}"]
    finally:
        for worker in workers:
            worker.stop()
    if failures:
        for failure in failures:
            say(f"FAILED: {failure}")
        for worker in workers:
            say(f"\n--- last lines of {worker.log} ---\n{worker.tail()}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
