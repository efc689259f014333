"""``Admin.tasks()`` (and ``sqlease tasks``) with no filter: every recent task, finished ones
included, newest first, from the task records, a page at a time by keyset."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sqlease import Store
from sqlease.admin import Admin
from sqlease.cli import main
from sqlease.testing import FakeClock


def test_no_filter_lists_finished_tasks_too_newest_first_by_pages(
    make_store: Callable[..., Store],
    clock: FakeClock,
    db_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = make_store()
    admin = Admin(store.engine.url, store=store)
    store.enqueue("celery", "{}", task_id="done", task_name="app.demo")
    [m] = store.claim(["celery"], "w", lease_ms=1000)
    store.ack([m.fence])  # finished, no result backend: known from its ack
    for n in range(5):
        clock.advance(10)
        store.enqueue("celery", "{}", task_id=f"t{n}", task_name="app.later")
    listed = admin.tasks(limit=4)
    assert [t.task_id for t in listed] == ["t4", "t3", "t2", "t1"]
    assert {t.state for t in listed} == {"queued"}
    cursor = f"{listed[-1].created_at_ms}:{listed[-1].task_id}"
    rest = admin.tasks(limit=4, before=cursor)
    assert [(t.task_id, t.state) for t in rest] == [("t0", "queued"), ("done", "succeeded")]
    assert rest[-1].task_name == "app.demo"
    with pytest.raises(ValueError, match="unfiltered list only"):
        admin.tasks(state="queued", before=cursor)
    # the command line: the demo's finished task is listed with no filter, and pages go on
    base = ["--url", db_url, "--table-prefix", store.tables.prefix, "tasks"]
    assert main([*base, "--limit", "4"]) == 0
    page = capsys.readouterr().out
    assert "t4" in page and "done" not in page and f"next page: --before {cursor}" in page
    assert main([*base, "--limit", "4", "--before", cursor]) == 0
    page = capsys.readouterr().out
    assert "done" in page and "succeeded" in page and "next page" not in page
    assert main([*base, "--before", "yesterday"]) == 1
    assert "not a page cursor: 'yesterday'" in capsys.readouterr().err
