"""Charge a card exactly once although the worker is killed after the charge: the second
delivery gets the stored receipt from the durable step instead of charging again.

    python examples/steps/run.py [--dir FOLDER]

Exits 0 when the provider recorded exactly one charge and the task, finished on attempt 2,
returned that charge's receipt; 1 otherwise.
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
ORDER_ID = 42
AMOUNT_CENTS = 12_000


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
    folder = Path(parser.parse_args().dir or tempfile.mkdtemp(prefix="sqlease-steps-"))
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("steps.db", "payments.db", "worker1.log", "worker2.log"):
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


def scenario(folder: Path, workers: list[Worker]) -> list[str]:
    """Run the scenario; returns the failed checks (empty when everything held)."""
    # Imported here: tasks.py reads SQLEASE_EXAMPLE_DIR, which folder_from_args() has set.
    import tasks

    import sqlease

    say(f"broker and results: {tasks.URL}")
    say(f"payment provider's records: {tasks.PROVIDER}; worker logs in {folder}")

    first = Worker("worker1", folder)
    workers.append(first)
    say(f"\n[1] started worker 1 (pid {first.pid})")
    result = tasks.checkout.delay(ORDER_ID, AMOUNT_CENTS)
    say(f"[2] sent checkout(order {ORDER_ID}, {AMOUNT_CENTS} cents): task {result.id}")

    admin = sqlease.Admin(tasks.URL)  # the producer's publish created the tables

    def charge_step_done() -> bool:
        return any(
            s["name"] == "charge" and s["status"] == "succeeded"
            for s in admin.task(result.id).steps
        )

    wait_for("the charge step to finish", charge_step_done)
    charged = tasks.charges(ORDER_ID)
    say(f"    the provider charged the card: {charged}")
    say("    step 'charge' recorded as succeeded; worker 1 is now packing the parcel")
    first.kill()
    say("[3] killed worker 1 with SIGKILL: the task did not finish, nothing was acked")

    second = Worker("worker2", folder)
    workers.append(second)
    say(f"[4] started worker 2 (pid {second.pid}); it takes the task over when the lease expires")
    outcome: dict[str, Any] = result.get(timeout=60)
    say(f"[5] finished: {outcome}")

    wait_for("the ack", lambda: admin.task(result.id).state == "succeeded", timeout=15)
    snap = admin.task(result.id)
    after = tasks.charges(ORDER_ID)
    say(f"\nthe provider's charges for order {ORDER_ID}: {after}")
    for step in snap.steps:
        say(f"step {step['name']}: {step['status']} (on attempt {step['attempt']})")
    kinds = [f"{e['kind']}@{e['attempt']}" for e in snap.events]
    say(f"timeline: {', '.join(kinds)}")

    failures = []
    if len(after) != 1:
        failures.append(f"expected exactly one charge, the provider has {len(after)}: {after}")
    elif outcome.get("receipt") != after[0]:
        failures.append(f"the task returned {outcome.get('receipt')}, the provider has {after[0]}")
    if charged != after:
        failures.append(f"the charge changed after the crash: {charged} -> {after}")
    if outcome.get("attempt") != 2:
        failures.append(f"expected the task to finish on attempt 2, got {outcome}")
    if snap.steps != [{"name": "charge", "status": "succeeded", "attempt": 1, "error": None}]:
        failures.append(f"unexpected step records: {snap.steps}")
    if not failures:
        say(
            f"\nOK: one charge ({after[0]['charge_id']}) across the crash; attempt 2 returned "
            "the receipt stored by attempt 1"
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
