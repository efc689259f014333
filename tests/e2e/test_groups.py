"""Groups, chords and chunks published as one batch, run by a real worker with the sqlease
result backend (both databases): every task of a group of 1,000 runs once and
``GroupResult.get()`` has every result; a chord's counter completes its body; chunks and an
explicit ``sqlease.batch()`` run whole."""

from __future__ import annotations

from collections import Counter

import pytest
from celery import chord, group

import sqlease

from .conftest import E2E
from .test_context import app_for, effects

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_group_of_1000_runs_every_task_once(e2e: E2E) -> None:
    app = app_for(e2e, lease=30.0)
    e2e.start_worker(app="context_app", pool="threads", concurrency=4)
    once = app.tasks["ctx.once"]
    result = group(once.s(i) for i in range(1000)).apply_async()
    assert result.get(timeout=240) == [2 * i for i in range(1000)]
    runs = Counter(row["task_id"] for row in effects(e2e, "body"))
    assert set(runs) == {r.id for r in result.results}
    assert set(runs.values()) == {1}


def test_chords_chunks_and_explicit_batches_complete(e2e: E2E) -> None:
    app = app_for(e2e, lease=30.0)
    e2e.start_worker(app="context_app", pool="threads", concurrency=4)
    add, tsum = app.tasks["ctx.add"], app.tasks["ctx.tsum"]
    header = (add.s(i, 1) for i in range(200))
    assert chord(header, tsum.s())().get(timeout=120) == sum(i + 1 for i in range(200))
    chunks = add.chunks(zip(range(100), range(100), strict=True), 10).apply_async()
    assert chunks.get(timeout=120) == [[2 * i for i in range(j, j + 10)] for j in range(0, 100, 10)]
    with sqlease.batch():
        results = [add.delay(i, i) for i in range(50)]
        nested = group(add.s(i, 0) for i in range(50)).apply_async()
    assert [r.get(timeout=60) for r in results] == [2 * i for i in range(50)]
    assert nested.get(timeout=60) == list(range(50))
