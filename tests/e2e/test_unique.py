"""Unique tasks under a real worker: duplicates of a task's own ``unique_key`` enqueue
nothing, their AsyncResults answer with the original's result, a key frees when its task
ends, headers give the same, bad terms are refused at publish."""

from __future__ import annotations

import pytest

from sqlease import Admin, ConfigurationError

from .conftest import E2E, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_duplicates_run_once_and_answer_with_the_originals_result(e2e: E2E) -> None:
    backend = e2e.broker
    app = e2e.app(backend=backend)
    report = app.tasks["e2e.report"]
    first = report.delay("ann")
    again = [report.delay("ann"), report.apply_async(("ann",))]
    other = report.delay("bob")  # another key
    assert e2e.store.size("celery") == 2
    e2e.start_worker(concurrency=2, E2E_BACKEND=backend)
    expected = f"report for ann by {first.id}"
    assert first.get(timeout=30) == expected
    assert [r.get(timeout=30) for r in again] == [expected, expected]
    assert again[0].state == "SUCCESS"
    assert other.get(timeout=30) == f"report for bob by {other.id}"
    assert len(e2e.finished(label="ann")) == 1
    admin = Admin(e2e.broker, table_prefix=e2e.prefix)
    assert admin.original_of(again[1].id) == first.id
    state = admin.unique("report:ann")
    assert state is not None and state.duplicates == 2 and not state.holding
    kinds = e2e.kinds(first.id)
    assert kinds.count("duplicate") == 2 and kinds[-1] in ("acked", "succeeded")
    # The key was released by the ack: the next publish runs.
    later = report.delay("ann")
    assert later.get(timeout=30) == f"report for ann by {later.id}"
    assert len(e2e.finished(label="ann")) == 2


@pytest.mark.timeout(120)
def test_a_running_task_holds_its_key_and_headers_choose_the_scope(e2e: E2E) -> None:
    e2e.start_worker(concurrency=2)
    app = e2e.app()
    sleep = app.tasks["e2e.sleep"]
    sleep.apply_async((0.6,), {"label": "long"}, headers={"unique_key": "nightly"})
    wait_for(lambda: e2e.executions(label="long"), 30, "the first to start")
    sleep.apply_async((0.0,), {"label": "dup"}, headers={"unique_key": "nightly"})
    # scope "queued": a running task lets one more queue behind it.
    sleep.apply_async(
        (0.0,), {"label": "behind"}, headers={"unique_key": "q", "unique_scope": "queued"}
    )
    wait_for(lambda: len(e2e.finished()) == 2, 30, "the long task and the other key")
    assert e2e.executions(label="dup") == []
    # A period outlives the task.
    sleep.apply_async((0.0,), {"label": "p1"}, headers={"unique_key": "p", "unique_for": 60})
    wait_for(lambda: e2e.finished(label="p1"), 30, "the period's task")
    sleep.apply_async((0.0,), {"label": "p2"}, headers={"unique_key": "p", "unique_for": 60})
    assert e2e.store.size("celery") == 0
    assert e2e.executions(label="p2") == []


def test_bad_unique_terms_are_refused_at_publish(e2e: E2E) -> None:
    app = e2e.app()
    sleep = app.tasks["e2e.sleep"]
    with pytest.raises(ConfigurationError, match="unique_scope"):
        sleep.apply_async((0.1,), headers={"unique_key": "k", "unique_scope": "always"})
    with pytest.raises(ConfigurationError, match="unique_for"):
        sleep.apply_async((0.1,), headers={"unique_key": "k", "unique_for": -5})
    with pytest.raises(ConfigurationError, match="unique_key"):
        sleep.apply_async((0.1,), headers={"unique_key": 42})
    with pytest.raises(ConfigurationError, match="unique_key"):
        app.tasks["e2e.report"].delay("x" * 300)  # the task's own key, too long
    assert e2e.store.size("celery") == 0
