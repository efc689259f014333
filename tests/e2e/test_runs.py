"""Per-run serialization through the ``run_id`` header under a real prefork worker with
concurrency 4: the tasks of one run never overlap and keep their enqueue order, while
different runs proceed in parallel."""

from __future__ import annotations

import itertools
import statistics

import pytest

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow

RUNS = 3
PER_RUN = 8


@pytest.mark.timeout(120)
def test_run_id_serializes_each_run_and_runs_overlap(e2e: E2E) -> None:
    e2e.start_worker(concurrency=4)
    app = e2e.app()
    sleep = app.tasks["e2e.sleep"]
    run_ids = [f"run-{n}" for n in range(RUNS)]
    for seq in range(PER_RUN):  # interleaved: run-0 #0, run-1 #0, run-2 #0, run-0 #1, …
        for run_id in run_ids:
            sleep.apply_async((0.15,), {"label": str(seq)}, headers={"run_id": run_id})

    wait_for(lambda: len(e2e.finished()) == RUNS * PER_RUN, 60, "every task to finish")
    rows = e2e.executions()
    assert len(rows) == RUNS * PER_RUN
    e2e.assert_first_starts(rows)
    by_run = {run_id: [r for r in rows if r["run_id"] == run_id] for run_id in run_ids}
    for run_id, run in by_run.items():
        run.sort(key=lambda r: r["started"])
        assert [int(r["label"]) for r in run] == list(range(PER_RUN)), run_id
        for before, after in itertools.pairwise(run):
            assert after["started"] >= before["ended"], (run_id, before, after)

    def overlap(a: list[dict[str, float]], b: list[dict[str, float]]) -> bool:
        return any(x["started"] < y["ended"] and y["started"] < x["ended"] for x in a for y in b)

    runs = list(by_run.values())
    assert overlap(runs[0], runs[1]) and overlap(runs[1], runs[2]) and overlap(runs[0], runs[2])
    assert len({r["pid"] for r in rows}) > 1  # several pool processes took part


@pytest.mark.timeout(120)
def test_next_task_of_a_run_starts_promptly_after_the_previous_one(
    e2e: E2E, request: pytest.FixtureRequest
) -> None:
    """The next task of a run becomes claimable when the previous one is acked; the worker
    must write that ack (and claim the next one) at once, not at the next safety poll
    (``polling_interval``, 1 s by default)."""
    e2e.start_worker(concurrency=2, E2E_POLLING_INTERVAL=1.0)
    app = e2e.app(polling_interval=1.0)
    for seq in range(6):
        app.tasks["e2e.add"].apply_async((seq, 0), {"label": str(seq)}, headers={"run_id": "r"})
    rows = wait_for(lambda: (r := e2e.finished()) and len(r) == 6 and r, 30, "the run")
    assert [int(r["label"]) for r in rows] == list(range(6))
    gaps = [b["started"] - a["ended"] for a, b in itertools.pairwise(rows)]
    assert statistics.median(gaps) < 0.4, [round(g, 3) for g in gaps]
