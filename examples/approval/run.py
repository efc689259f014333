"""A task waits for a person's approval: it parks (holding no worker), someone approves it
with the ``sqlease`` command, and the next delivery returns the decision.

    python examples/approval/run.py [--dir FOLDER]

Exits 0 when the approved refund was made exactly once and the rejected one not at all; 1
otherwise.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # example_support.py, shared by the examples

from example_support import Worker, folder_from_args, run, say, wait_for  # noqa: E402


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
    worker = Worker("worker1", folder, HERE)
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
    folder = folder_from_args("approval", ("approval.db", "payments.db", "worker1.log"), __doc__)
    return run(folder, scenario)


if __name__ == "__main__":
    sys.exit(main())
