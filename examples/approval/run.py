"""A task waits for a person's approval: it parks (holding no worker), someone approves it
with the ``sqlease`` command, and the next delivery returns the decision.

    python examples/approval/run.py [--dir FOLDER]

Exits 0 when the approved refund was made exactly once and the rejected one not at all; 1
otherwise.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def say(text: str = "") -> None:
    print(text, flush=True)


class Worker:
    """``celery -A tasks worker`` in its own session (one process group with its pool)."""

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

    def stop(self) -> None:
        """Celery's warm shutdown (SIGTERM), or SIGKILL if it takes too long."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

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
    folder = Path(parser.parse_args().dir or tempfile.mkdtemp(prefix="sqlease-approval-"))
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("approval.db", "payments.db", "worker1.log"):
        for suffix in ("", "-wal", "-shm"):
            (folder / (stale + suffix)).unlink(missing_ok=True)
    # tasks.py (here and in the workers, which inherit the environment) reads it.
    os.environ["SQLEASE_EXAMPLE_DIR"] = str(folder)
    return folder


def wait_for(what: str, predicate: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
    return value


def sqlease_cli(url: str, *args: str) -> str:
    """Run the ``sqlease`` command (``python -m sqlease``) as an operator would."""
    command = [sys.executable, "-m", "sqlease", "--url", url, *args]
    say("    $ " + shlex.join(["sqlease", *args]))
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    output = (done.stdout + done.stderr).rstrip()
    for line in output.splitlines():
        say(("    | " + line).rstrip())
    if done.returncode != 0:
        raise RuntimeError(f"sqlease {args[0]} exited with {done.returncode}")
    return output


def scenario(folder: Path, workers: list[Worker]) -> list[str]:
    """Run the scenario; returns the failed checks (empty when everything held)."""
    # Imported here: tasks.py reads SQLEASE_EXAMPLE_DIR, which folder_from_args() has set.
    import tasks

    import sqlease

    say(f"broker and results: {tasks.URL}; worker log in {folder}")
    worker = Worker("worker1", folder)
    workers.append(worker)
    say(f"\n[1] started a worker (pid {worker.pid}), one process")
    approved = tasks.refund_order.delay(42, 120)
    rejected = tasks.refund_order.delay(43, 5000)
    say(f"[2] sent refund_order(42, $120): task {approved.id}")
    say(f"    sent refund_order(43, $5000): task {rejected.id}")

    admin = sqlease.Admin(tasks.URL)  # the producer's publish created the tables
    for result in (approved, rejected):
        wait_for(
            "the task to wait for approval",
            lambda r=result: admin.task(r.id).state == "waiting_approval",
        )
    snap = admin.task(approved.id)
    say("[3] both tasks are parked, waiting for approval (and hold no worker)")
    say(f"    Admin: state={snap.state} attempt={snap.attempt} waiting={snap.waiting}")
    say(f"    AsyncResult.state: {approved.state}")
    say(f"    queue counts: {admin.stats()}")
    say("\n[4] an operator looks at the first task:")
    sqlease_cli(tasks.URL, "show", approved.id)

    say("\n[5] the operator decides, from the command line:")
    sqlease_cli(tasks.URL, "approve", approved.id, "--note", "ok")
    sqlease_cli(tasks.URL, "reject", rejected.id, "--reason", "over the refund limit")

    outcome: dict[str, Any] = approved.get(timeout=60)
    other: dict[str, Any] = rejected.get(timeout=60)
    say(f"\n[6] order 42 finished: {outcome}")
    say(f"    order 43 finished: {other}")
    made = tasks.refunds()
    say(f"    the provider's refunds (order, amount): {made}")
    wait_for("the ack", lambda: admin.task(approved.id).state == "succeeded", timeout=15)
    say("\n[7] the first task afterwards:")
    sqlease_cli(tasks.URL, "show", approved.id)

    failures = []
    expected = {"order_id": 42, "refunded": True, "note": "ok", "attempt": 2}
    if {k: outcome.get(k) for k in expected} != expected:
        failures.append(f"expected {expected} (plus the refund), got {outcome}")
    if other != {"order_id": 43, "refunded": False, "reason": "over the refund limit"}:
        failures.append(f"the rejected refund returned {other}")
    if made != [(42, 120)]:
        failures.append(f"expected exactly one refund (42, 120), the provider made {made}")
    if snap.waiting is None or snap.waiting.get("kind") != "approval":
        failures.append(f"the waiting request was not visible: {snap.waiting}")
    if not failures:
        say("\nOK: order 42 refunded once after approval from the CLI; order 43 rejected")
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
