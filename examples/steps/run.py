"""Charge a card exactly once although the worker is killed after the charge: the second
delivery gets the stored receipt from the durable step instead of charging again.

    python examples/steps/run.py [--dir FOLDER]

Exits 0 when the provider recorded exactly one charge and the task, finished on attempt 2,
returned that charge's receipt; 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # example_support.py, shared by the examples

from example_support import Worker, folder_from_args, run, say, wait_for  # noqa: E402

ORDER_ID = 42
AMOUNT_CENTS = 12_000


def scenario(folder: Path, workers: list[Worker]) -> list[str]:
    """Run the scenario; returns the failed checks (empty when everything held)."""
    # Imported here: tasks.py reads SQLEASE_EXAMPLE_DIR, which folder_from_args() has set.
    import tasks

    import sqlease

    say(f"broker and results: {tasks.URL}")
    say(f"payment provider's records: {tasks.PROVIDER}; worker logs in {folder}")

    first = Worker("worker1", folder, HERE)
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

    second = Worker("worker2", folder, HERE)
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
    folder = folder_from_args(
        "steps", ("steps.db", "payments.db", "worker1.log", "worker2.log"), __doc__
    )
    return run(folder, scenario)


if __name__ == "__main__":
    sys.exit(main())
