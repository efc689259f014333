"""Kill a worker in the middle of a long task and watch another worker resume it from its
last checkpoint.

    python examples/checkpoints/run.py [--dir FOLDER]

Exits 0 when the task finished on attempt 2, resumed from the checkpointed page, and imported
every page exactly once; 1 otherwise.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # example_support.py, shared by the examples

from example_support import Worker, folder_from_args, run, say  # noqa: E402

PAGES = 10
KILL_AFTER_PAGE = 4


def scenario(folder: Path, workers: list[Worker]) -> list[str]:
    """Run the scenario; returns the failed checks (empty when everything held)."""
    # Imported here: tasks.py reads SQLEASE_EXAMPLE_DIR, which folder_from_args() has set.
    import tasks

    import sqlease

    say(f"broker and results: {tasks.URL}")
    say(f"lease {tasks.app.conf.broker_transport_options['lease_seconds']} s; logs in {folder}")

    first = Worker("worker1", folder, HERE)
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

    second = Worker("worker2", folder, HERE)
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
    folder = folder_from_args(
        "checkpoints", ("checkpoints.db", "catalog.db", "worker1.log", "worker2.log"), __doc__
    )
    return run(folder, scenario)


if __name__ == "__main__":
    sys.exit(main())
