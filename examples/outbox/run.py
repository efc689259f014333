"""Save an order and enqueue its shipping task in one transaction: the task exists if and
only if the order was committed (a transactional outbox without a relay).

    python examples/outbox/run.py [--dir FOLDER]

Exits 0 when the committed order was shipped, and the rolled-back order left neither a row nor
a task behind; 1 otherwise.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # example_support.py, shared by the examples

from example_support import Worker, folder_from_args, run, say  # noqa: E402


class PaymentDeclined(Exception):
    pass


def exists(admin: Any, task_id: str) -> bool:
    """Does sqlease know this task (from another connection than the transaction's)?"""
    import sqlease

    try:
        admin.task(task_id)
    except sqlease.UnknownTask:
        return False
    return True


def queue_counts(admin: Any) -> dict[str, Any]:
    """Admin.stats() for the default queue (it lists only queues that have messages)."""
    counts: dict[str, Any] = admin.stats().get("celery", {})
    return counts


def scenario(folder: Path, workers: list[Worker]) -> list[str]:
    """Run the scenario; returns the failed checks (empty when everything held)."""
    # Imported here: tasks.py reads SQLEASE_EXAMPLE_DIR, which folder_from_args() has set.
    import tasks
    from sqlalchemy import insert

    import sqlease

    say(f"one SQLite file for orders, tasks and results: {tasks.DB}")

    # 1. The schema. sqlease's tables are created before the first transactional publish: on
    #    SQLite a publish inside your transaction cannot create them (your transaction holds
    #    the write lock), so run `sqlease migrate` (or start a worker) first.
    command = [sys.executable, "-m", "sqlease", "--url", tasks.URL, "migrate"]
    say("\n[1] $ " + shlex.join(["sqlease", *command[3:]]))
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    say("    | " + (done.stdout + done.stderr).strip())
    if done.returncode != 0:
        raise RuntimeError("sqlease migrate failed")
    tasks.metadata.create_all(tasks.engine)
    say("    created the tables orders and shipments (SQLAlchemy, same file)")
    admin = sqlease.Admin(tasks.URL)

    # 2. A transaction that commits: the order and its task appear together.
    say("\n[2] order 1: save it and enqueue ship_order(1) in one transaction")
    with tasks.engine.begin() as conn, sqlease.transaction(conn):
        conn.execute(insert(tasks.orders).values(id=1, item="a book"))
        committed = tasks.ship_order.delay(1)
        visible_inside = exists(admin, committed.id)
        say(f"    enqueued task {committed.id}")
        say(f"    seen from another connection before the commit: {visible_inside}")
    state = admin.task(committed.id).state
    say(f"    after the commit: order saved, task {state}")

    # 3. A transaction that fails after .delay(): both the order and the task are rolled back.
    say("\n[3] order 2: save it, enqueue ship_order(2), then the payment is declined")
    rolled_back_id = None
    try:
        with tasks.engine.begin() as conn, sqlease.transaction(conn):
            conn.execute(insert(tasks.orders).values(id=2, item="a lamp"))
            rolled_back_id = tasks.ship_order.delay(2).id
            say(f"    enqueued task {rolled_back_id}")
            raise PaymentDeclined("card declined")
    except PaymentDeclined as exc:
        say(f"    the transaction raised {type(exc).__name__}({exc}) and rolled back")
    assert rolled_back_id is not None
    orders_now = tasks.saved_orders()
    rolled_back_exists = exists(admin, rolled_back_id)
    say(f"    orders in the table: {orders_now}")
    say(f"    does sqlease know task {rolled_back_id}? {rolled_back_exists}")
    say(f"    queue 'celery': {queue_counts(admin)}")

    # 4. A worker runs what was committed, and only that.
    worker = Worker("worker1", folder, HERE)
    workers.append(worker)
    say(f"\n[4] started a worker (pid {worker.pid})")
    outcome: dict[str, Any] = committed.get(timeout=60)
    say(f"    ship_order(1) returned {outcome}")
    deadline = time.monotonic() + 15
    while admin.task(committed.id).state != "succeeded" and time.monotonic() < deadline:
        time.sleep(0.05)  # the result is stored; the worker acks right after
    time.sleep(1.0)  # give a stray task (there should be none) the time to run
    stats = queue_counts(admin)
    shipments = tasks.shipped()
    say(f"    shipments (order, item): {shipments}")
    say(f"    queue 'celery': {stats or 'no messages left'}")

    failures = []
    if visible_inside:
        failures.append("the task was visible to another connection before the commit")
    if state != "queued":
        failures.append(f"the committed task should be queued after the commit, not {state}")
    if orders_now != [(1, "a book")]:
        failures.append(f"only order 1 should be saved: {orders_now}")
    if rolled_back_exists:
        failures.append(f"the rolled-back task {rolled_back_id} exists")
    if outcome != {"order_id": 1, "item": "a book", "shipped": True}:
        failures.append(f"unexpected result of ship_order(1): {outcome}")
    if shipments != [(1, "a book")]:
        failures.append(f"exactly order 1 should have shipped: {shipments}")
    if any(stats.get(k) for k in ("ready", "scheduled", "leased", "waiting", "paused", "dead")):
        failures.append(f"the queue should be empty: {stats}")
    if not failures:
        say("\nOK: shipped exactly the committed order; the rolled-back order left no task")
    return failures


def main() -> int:
    folder = folder_from_args("outbox", ("outbox.db", "worker1.log"), __doc__)
    return run(folder, scenario)


if __name__ == "__main__":
    sys.exit(main())
