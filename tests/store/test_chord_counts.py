"""A chord part's whole count in one transaction (``ResultStore.count_part``), and the
result backend counting each part through it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, states
from celery.result import AsyncResult, GroupResult
from sqlalchemy import select

from conftest import isolated_app
from sqlease._core.results import FenceRefused, ResultStore
from sqlease.backend import SqleaseBackend
from sqlease.testing import FakeClock

KEY, HEADER = "chord-unlock-g", "celery-taskset-meta-g"


def _expiry(results: ResultStore, key: str) -> int | None:
    """The expiry stored for ``key`` in either table (the counter's, else the result's)."""
    with results.store.driver.reading() as conn:
        for table in (results.counters, results.results):
            row = conn.execute(select(table.c.expires_at_ms).where(table.c.key == key)).first()
            if row is not None:
                return None if row[0] is None else int(row[0])
    raise AssertionError(f"no row for {key}")


def _sized(make_store: Any, size: int) -> ResultStore:
    results = ResultStore(make_store())
    results.put(KEY, str(size).encode())  # the chord's size (set_chord_size)
    results.put(HEADER, b"{}")  # the saved header
    return results


def test_a_part_is_counted_once_with_what_its_count_read(make_store: Any) -> None:
    results = _sized(make_store, 3)
    first = results.count_part(KEY, "a", group_key=HEADER)
    assert (first.value, first.settled, first.size, first.header) == (1, False, 3, True)
    again = results.count_part(KEY, "a", group_key=HEADER)
    assert (again.value, again.settled) == (0, True)  # counted already, nothing owed
    assert results.count_part(KEY, "b", group_key=HEADER).value == 2
    assert results.count_part(KEY, "c", group_key=HEADER).value == 3
    # The last count delivered again while its counter stands: the callback may be owed.
    last = results.count_part(KEY, "c", group_key=HEADER)
    assert (last.value, last.settled) == (3, False)
    assert results.part_state(KEY, "b") == (True, 3)


def test_a_part_whose_header_is_gone_counts_nothing(make_store: Any) -> None:
    results = ResultStore(make_store())
    counted = results.count_part(KEY, "a", group_key=HEADER)
    assert (counted.value, counted.settled, counted.header) == (0, False, False)
    assert results.part_state(KEY, "a") == (False, None)  # no record of a count
    assert results.incr(KEY) == 1  # the counter was never started


def test_a_stale_delivery_counts_nothing(make_store: Any) -> None:
    store = make_store()
    results = ResultStore(store)
    results.put(HEADER, b"{}")
    store.enqueue("celery", "{}", task_id="a")
    [first] = store.claim(["celery"], "w1", lease_ms=1_000)
    store.clock.advance(1_001)
    [second] = store.claim(["celery"], "w2", lease_ms=60_000)
    with pytest.raises(FenceRefused):
        results.count_part(KEY, "a", group_key=HEADER, fence=first.fence, task_id="a")
    assert (
        results.count_part(KEY, "a", group_key=HEADER, fence=second.fence, task_id="a").value == 1
    )


def test_expiries_are_written_by_counts_that_do_not_complete_the_chord(
    make_store: Any, clock: FakeClock
) -> None:
    results = _sized(make_store, 10)
    results.put("celery-task-meta-a", b"{}")
    part_key = "celery-task-meta-a"
    asked = [(KEY, 100.0), (HEADER, 100.0), (part_key, 100.0)]
    start = clock()
    assert results.count_part(KEY, "a", group_key=HEADER, expiries=asked).expired
    for key in (KEY, HEADER, part_key):
        assert _expiry(results, key) == start + 100_000
    # Within a hundredth of the time asked (1 s here) the rows are left as they are ...
    clock.advance(900)
    assert results.count_part(KEY, "b", group_key=HEADER, expiries=asked[:2]).expired
    assert _expiry(results, HEADER) == start + 100_000
    # ... beyond it they are set again, a later expiry is shortened, and none means none.
    clock.advance(200)
    assert results.count_part(KEY, "c", group_key=HEADER, expiries=[(HEADER, 100.0)]).expired
    assert _expiry(results, HEADER) == start + 101_100
    results.expire(part_key, 1_000)
    assert results.count_part(KEY, "x", group_key=HEADER, expiries=[(part_key, 50.0)]).expired
    assert _expiry(results, part_key) == start + 1_100 + 50_000
    assert results.count_part(KEY, "y", group_key=HEADER, expiries=[(part_key, None)]).expired
    assert _expiry(results, part_key) is None


def test_the_count_that_completes_the_chord_leaves_the_expiries(
    make_store: Any, clock: FakeClock
) -> None:
    results = _sized(make_store, 2)
    assert results.count_part(KEY, "a", group_key=HEADER).value == 1
    last = results.count_part(KEY, "b", group_key=HEADER, expiries=[(HEADER, 100.0)])
    assert (last.value, last.expired) == (2, False)  # Celery's base deletes the chord instead
    assert _expiry(results, HEADER) is None
    # The request's own size stands over the stored one.
    results.put("chord-unlock-h", b"2")
    results.put("celery-taskset-meta-h", b"{}")
    early = results.count_part(
        "chord-unlock-h", "a", group_key="celery-taskset-meta-h", size=1, expiries=[(HEADER, 1.0)]
    )
    assert (early.value, early.expired) == (1, False)


@pytest.fixture
def app(db_url: str) -> Iterator[Celery]:
    app = isolated_app("chord_counts", db_url)
    app.conf.result_expires = 3600

    @app.task(name="t.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    app.finalize()
    yield app
    app.close()


def test_the_backend_counts_a_part_in_one_transaction(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part that does not complete its chord: one write transaction (the count, whether
    the header is saved, and the expiries Celery's base asks for), no read; the last part
    still joins the header and sends the body."""
    backend = app.backend
    assert isinstance(backend, SqleaseBackend)
    sent: list[Any] = []
    monkeypatch.setattr(app.amqp, "_retry_publish", lambda send, ret: sent.append(ret))
    ids = ["one-a", "one-b", "one-c"]
    GroupResult("one-g", [AsyncResult(i, app=app) for i in ids]).save()
    backend.set_chord_size("one-g", 3)
    body = dict(app.signature("t.add", args=(1,)))
    for task_id in ids:
        backend.store_result(task_id, 1, states.SUCCESS)
    driver = backend.results.store.driver
    opened: list[str] = []
    for name in ("writing", "reading"):
        real = getattr(driver, name)

        @contextmanager
        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            opened.append(_name)
            with _real(*args, **kwargs) as conn:
                yield conn

        monkeypatch.setattr(driver, name, counted)
    request = SimpleNamespace(id="one-a", group="one-g", chord=body, task="t.add")
    backend.on_chord_part_return(request, states.SUCCESS, 1)
    assert opened == ["writing"]
    monkeypatch.undo()
    monkeypatch.setattr(app.amqp, "_retry_publish", lambda send, ret: sent.append(ret))
    results = backend.results
    expected = [
        "chord-unlock-one-g",
        "celery-taskset-meta-one-g",
        *(["celery-task-meta-one-a"] if hasattr(type(backend), "_chord_result_expires") else []),
    ]
    for key in expected:
        assert _expiry(results, key) is not None, key
    for task_id in ids[1:]:
        request = SimpleNamespace(id=task_id, group="one-g", chord=body, task="t.add")
        backend.on_chord_part_return(request, states.SUCCESS, 1)
    assert sent == [[1, 1, 1]]
    assert GroupResult.restore("one-g", app=app) is None  # deleted once the body was sent
