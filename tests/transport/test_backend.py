"""The result backend on SQLite and PostgreSQL, through Celery's own API (no worker)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, states
from celery import exceptions as celery_exceptions
from celery.result import AsyncResult, GroupResult
from sqlalchemy import select

from conftest import record_naps, unique_prefix
from sqlease import ConfigurationError, Store
from sqlease._core.clock_slots import ClockSlots
from sqlease._core.lease_clock import LOST
from sqlease._core.results import FenceRefused, ResultStore
from sqlease.backend import SqleaseBackend
from sqlease.backend._fencing import REFUSED
from sqlease.backend._waits import _Costly
from sqlease.delivery import CLOCK_KEY
from sqlease.testing import FakeClock
from sqlease.transport import ATTEMPT_KEY, ID_KEY, LEASE_KEY, OWNER_KEY


@pytest.fixture
def app(db_url: str) -> Iterator[Celery]:
    prefix = unique_prefix()
    url = f"sqlease+{db_url}"
    app = Celery("backend_tests", broker=url, backend=url, set_as_current=False)
    app.conf.broker_transport_options = {"table_prefix": prefix}
    app.conf.result_extended = True

    @app.task(name="t.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    app.finalize()
    yield app
    app.close()


def backend_of(app: Celery) -> SqleaseBackend:
    backend = app.backend
    assert isinstance(backend, SqleaseBackend)
    return backend


def test_backend_is_found_through_the_entry_point(app: Celery) -> None:
    assert type(app.backend).__name__ == "SqleaseBackend"
    assert app.backend.as_uri().startswith("sqlease+")


def test_store_get_forget(app: Celery) -> None:
    backend = backend_of(app)
    backend.store_result("tid-1", {"answer": 42}, states.SUCCESS)
    result = AsyncResult("tid-1", app=app)
    assert result.get(timeout=5) == {"answer": 42}
    assert result.state == states.SUCCESS
    result.forget()
    assert AsyncResult("tid-1", app=app).state == states.PENDING


def test_failure_and_traceback(app: Celery) -> None:
    backend = backend_of(app)
    try:
        raise ValueError("nope")
    except ValueError as exc:
        backend.mark_as_failure("tid-f", exc, traceback="Traceback: here")
    result = AsyncResult("tid-f", app=app)
    assert result.state == states.FAILURE
    assert isinstance(result.result, ValueError)
    assert result.traceback == "Traceback: here"
    with pytest.raises(ValueError, match="nope"):
        result.get(timeout=5)


def test_result_extended_and_custom_states(app: Celery) -> None:
    backend = backend_of(app)
    request = SimpleNamespace(
        id="tid-x",
        task="t.add",
        args=(1, 2),
        kwargs={},
        hostname="w1",
        retries=0,
        delivery_info={"routing_key": "celery"},
        properties={},
        ignore_result=False,
        group=None,
        parent_id=None,
        root_id=None,
        children=[],
    )
    backend.store_result("tid-x", {"done": 3, "total": 10}, "PROGRESS", request=request)
    result = AsyncResult("tid-x", app=app)
    assert result.state == "PROGRESS"
    assert result.info == {"done": 3, "total": 10}
    backend.store_result("tid-x", 3, states.SUCCESS, request=request)
    meta = backend.get_task_meta("tid-x")
    assert meta["name"] == "t.add" and meta["args"] == [1, 2] and meta["worker"] == "w1"


def test_writes_after_success_are_ignored(app: Celery) -> None:
    backend = backend_of(app)
    backend.store_result("tid-s", 1, states.SUCCESS)
    backend.store_result("tid-s", 2, states.FAILURE)
    assert AsyncResult("tid-s", app=app).result == 1


def test_states_before_success_are_overwritten_and_success_is_kept_atomically(
    app: Celery,
) -> None:
    backend = backend_of(app)
    backend.mark_as_started("tid-k")
    backend.mark_as_retry("tid-k", ValueError("again"))
    assert AsyncResult("tid-k", app=app).state == states.RETRY
    backend.mark_as_done("tid-k", 7)
    backend.mark_as_started("tid-k")  # a late duplicate starting again
    assert AsyncResult("tid-k", app=app).result == 7


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys of every result read (the backend's ``get``: ResultStore.get_or_original, in
    any thread: app.backend is per thread)."""
    keys: list[str] = []
    real_get = ResultStore.get_or_original

    def counting_get(self: ResultStore, key: str, prefix: str) -> Any:
        keys.append(key)
        return real_get(self, key, prefix)

    monkeypatch.setattr(ResultStore, "get_or_original", counting_get)
    return keys


def _until_napping(reads: list[str], count: int = 1) -> None:
    """Until a waiter in another thread has made its first ``count`` reads and is waiting for
    its notification (a thread's first get() reads, listens, and reads once more)."""
    deadline = time.monotonic() + 5
    while len(reads) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)


def _wait_in_thread(app: Celery, task_id: str, **get: Any) -> tuple[Any, dict[str, Any]]:
    """``AsyncResult(task_id).get(timeout=10, **get)`` in a thread: its value or error in the
    box."""
    import threading

    box: dict[str, Any] = {}

    def waiting() -> None:
        try:
            box["value"] = AsyncResult(task_id, app=app).get(timeout=10, **get)
        except Exception as exc:  # reported by the caller's assertion
            box["error"] = exc

    thread = threading.Thread(target=waiting)
    thread.start()
    return thread, box


def _writer(app: Celery) -> Celery:
    writer = Celery("writer", broker=app.conf.broker_url, backend=app.conf.result_backend)
    writer.conf.broker_transport_options = app.conf.broker_transport_options
    return writer


def test_get_with_on_message_is_given_every_state_then_the_result(app: Celery) -> None:
    """``AsyncResult.get(on_message=...)`` (Redis's backend supports it): each state the
    result takes while waited for, in order, then the final one; each written once the
    waiter has reported the one before, so no state is written over unseen."""
    import threading

    seen: list[tuple[str, Any]] = []
    reported = threading.Semaphore(0)

    def on_message(meta: dict[str, Any]) -> None:
        seen.append((meta["status"], meta["result"]))
        reported.release()

    writer = _writer(app)
    writer.backend.mark_as_started("tid-m", pid=7)  # already there when get() starts
    thread, box = _wait_in_thread(app, "tid-m", on_message=on_message)
    assert reported.acquire(timeout=10)
    for step in (1, 2):
        writer.backend.store_result("tid-m", {"step": step}, "PROGRESS")
        assert reported.acquire(timeout=10)
    writer.backend.store_result("tid-m", 42, states.SUCCESS)
    thread.join(10)
    assert box == {"value": 42}
    assert seen == [
        (states.STARTED, {"pid": 7}),
        ("PROGRESS", {"step": 1}),
        ("PROGRESS", {"step": 2}),
        (states.SUCCESS, 42),
    ]
    # A failure reaches on_message too, then raises as get() does.
    seen.clear()
    try:
        raise KeyError("gone")
    except KeyError as exc:
        writer.backend.mark_as_failure("tid-mf", exc)
    with pytest.raises(KeyError, match="gone"):
        AsyncResult("tid-mf", app=app).get(timeout=5, on_message=on_message)
    assert [status for status, _ in seen] == [states.FAILURE]
    fresh = AsyncResult("tid-mf", app=writer)  # no cached result: waited for again
    assert isinstance(fresh.get(timeout=5, propagate=False, on_message=on_message), KeyError)
    assert [status for status, _ in seen] == [states.FAILURE] * 2
    with pytest.raises(celery_exceptions.TimeoutError):
        AsyncResult("tid-none", app=app).get(timeout=0.3, on_message=on_message)
    writer.close()


@pytest.mark.pg
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_on_message_sees_states_written_faster_than_it_reads(
    app: Celery, db_url: str, reads: list[str]
) -> None:
    """On PostgreSQL each write's notification carries its state: states written in quick
    succession while the waiter naps are each given to on_message, with no read back."""
    seen: list[tuple[str, Any]] = []
    thread, box = _wait_in_thread(
        app, "tid-q", on_message=lambda m: seen.append((m["status"], m["result"]))
    )
    _until_napping(reads)
    writer = _writer(app)
    for step in range(5):
        writer.backend.store_result("tid-q", {"step": step}, "PROGRESS")
    writer.backend.store_result("tid-q", "done", states.SUCCESS)
    thread.join(10)
    assert box == {"value": "done"}
    assert seen == [("PROGRESS", {"step": step}) for step in range(5)] + [(states.SUCCESS, "done")]
    assert len(reads) == 1  # the first read only
    writer.close()


@pytest.mark.pg
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("size", [10, 20_000])
def test_waiting_get_takes_the_result_from_its_notification(
    app: Celery, db_url: str, size: int, reads: list[str]
) -> None:
    """A result small enough to travel with its NOTIFY is not read back; a larger one is.
    (The waiting thread's first get() reads twice before it naps: before and after it starts
    listening.)"""
    thread, box = _wait_in_thread(app, "tid-n")
    _until_napping(reads, 2)
    writer = _writer(app)
    value = "x" * size
    writer.backend.store_result("tid-n", value, states.SUCCESS)
    thread.join(10)
    assert box.get("value") == value, box
    assert len(reads) == (2 if size < 7000 else 3)
    writer.close()


@pytest.mark.parametrize("task_id", ["t" * 1000, "é" * 500, "キ" * 333])
def test_a_task_id_of_1000_bytes_gets_its_result_and_a_longer_one_a_clear_error(
    app: Celery, task_id: str, reads: list[str]
) -> None:
    """Celery lets a caller choose any task id; its result key is an index key. Up to 1000
    bytes of UTF-8 it is stored and heard by a waiting client, also on a redelivery's write
    that keeps the success; past that (the result of a task published through another
    broker), an error names the key and nothing is stored."""
    thread, box = _wait_in_thread(app, task_id)
    _until_napping(reads)
    writer = _writer(app)
    writer.backend.store_result(task_id, {"n": 1}, states.SUCCESS)
    thread.join(10)
    assert box.get("value") == {"n": 1}, box
    writer.backend.store_result(task_id, "late", states.FAILURE)
    assert AsyncResult(task_id, app=writer).get(timeout=5) == {"n": 1}
    longer = task_id + "x" * 90
    with pytest.raises(ConfigurationError, match=r"result key .* over 1100 .* not stored"):
        writer.backend.store_result(longer, {"n": 2}, states.SUCCESS)
    assert AsyncResult(longer, app=writer).state == states.PENDING
    writer.close()


@pytest.mark.pg
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_get_after_publishing_skips_its_first_read_and_still_sees_old_results(
    app: Celery, db_url: str, reads: list[str]
) -> None:
    """A thread that already waits for results listens before it publishes (on_task_call), so
    its get() needs no first read; a reused task id whose SUCCESS is already stored (and so
    is kept, not rewritten) is still found."""
    backend = backend_of(app)
    writer = _writer(app)
    writer.backend.store_result("warm-up", 0, states.SUCCESS)
    assert AsyncResult("warm-up", app=app).get(timeout=5) == 0  # this thread now listens
    reads.clear()
    backend.on_task_call(None, "tid-fresh")
    writer.backend.store_result("tid-fresh", 42, states.SUCCESS)
    assert AsyncResult("tid-fresh", app=app).get(timeout=5) == 42
    assert reads == []
    # A task id used again: the old SUCCESS stands, and get() finds it.
    backend._cache.clear()
    backend.on_task_call(None, "warm-up")
    writer.backend.store_result("warm-up", 1, states.SUCCESS)
    started = time.monotonic()
    assert AsyncResult("warm-up", app=app).get(timeout=5) == 0
    assert time.monotonic() - started < 0.5  # woken by the kept write's notification
    backend._cache.clear()
    backend.on_task_call(None, "warm-up")  # and with no write at all: the safety read
    assert AsyncResult("warm-up", app=app).get(timeout=5) == 0
    writer.close()


@pytest.mark.pg
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_results_heard_while_waiting_for_another_are_not_waited_for_again(
    app: Celery, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst published by one thread: the first get() consumes the notifications of the
    others' results too, so each later get() reads its result at once instead of napping for
    a notification already gone (it took one second per result)."""
    backend = backend_of(app)
    writer = _writer(app)
    writer.backend.store_result("warm-up", 0, states.SUCCESS)
    assert AsyncResult("warm-up", app=app).get(timeout=5) == 0  # this thread now listens
    ids = [f"burst-{i}" for i in range(5)]
    for task_id in ids:
        backend.on_task_call(None, task_id)
    for i, task_id in enumerate(ids):
        writer.backend.store_result(task_id, i, states.SUCCESS)
    naps = record_naps(monkeypatch, backend)
    assert [AsyncResult(task_id, app=app).get(timeout=5) for task_id in ids] == list(range(5))
    assert all(naps), naps  # none waited out its safety interval for a consumed notification
    writer.close()


@pytest.mark.pg
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_failure_carried_by_its_notification_raises_as_usual(
    app: Celery, db_url: str, reads: list[str]
) -> None:
    thread, box = _wait_in_thread(app, "tid-f")
    _until_napping(reads, 2)
    writer = _writer(app)
    writer.backend.mark_as_failure("tid-f", KeyError("no such order"))
    thread.join(10)
    assert isinstance(box.get("error"), KeyError) and "no such order" in str(box["error"])
    assert len(reads) == 2  # before and after listening; the failure came with its notification
    writer.close()


@pytest.mark.pg
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_waiting_get_with_a_binary_serializer_reads_the_result_back(
    app: Celery, db_url: str
) -> None:
    app.conf.result_serializer = "pickle"
    app.conf.accept_content = ["json", "pickle"]
    app.conf.result_accept_content = ["json", "pickle"]
    backend = SqleaseBackend(app=app, url=app.conf.result_backend)
    thread, box = _wait_in_thread(app, "tid-p")
    time.sleep(0.1)
    backend.store_result("tid-p", {"set": {1, 2}}, states.SUCCESS)
    thread.join(10)
    assert box.get("value") == {"set": {1, 2}}, box


def test_group_save_restore_delete(app: Celery) -> None:
    backend = backend_of(app)
    children = [AsyncResult(f"child-{i}", app=app) for i in range(3)]
    for i, child in enumerate(children):
        backend.store_result(child.id, i * 10, states.SUCCESS)
    group = GroupResult("grp-1", children, app=app)
    group.save()
    restored = GroupResult.restore("grp-1", app=app)
    assert restored is not None
    assert restored.get(timeout=5) == [0, 10, 20]
    restored.delete()
    assert GroupResult.restore("grp-1", app=app) is None


def test_get_many_for_join_native(app: Celery) -> None:
    backend = backend_of(app)
    ids = [f"jn-{i}" for i in range(20)]
    for i, tid in enumerate(ids):
        backend.store_result(tid, i, states.SUCCESS)
    group = GroupResult("grp-2", [AsyncResult(t, app=app) for t in ids], app=app)
    assert group.join_native(timeout=5) == list(range(20))


def test_get_times_out_with_celery_error(app: Celery) -> None:
    from celery.exceptions import TimeoutError as CeleryTimeout

    started = time.monotonic()
    with pytest.raises(CeleryTimeout):
        AsyncResult("never", app=app).get(timeout=0.2)
    assert time.monotonic() - started < 3


def test_chord_counter_is_atomic(app: Celery) -> None:
    backend = backend_of(app)
    values = [backend.incr(b"chord-unlock-x") for _ in range(5)]
    assert values == [1, 2, 3, 4, 5]
    backend.delete(b"chord-unlock-x")
    assert backend.incr(b"chord-unlock-x") == 1


def test_a_chord_part_is_counted_once_however_often_it_reports(app: Celery) -> None:
    """A part that runs again (its worker died between storing its result and counting it)
    reports a second time: it must neither count twice nor fire the callback again."""
    backend = backend_of(app)
    results = backend.results
    assert results.incr("chord-unlock-p", part="a") == 1
    assert results.incr("chord-unlock-p", part="b") == 2
    assert results.incr("chord-unlock-p", part="a") == 0  # already counted: nothing changes
    assert results.incr("chord-unlock-p", part="c") == 3
    assert results.parts_settled([("chord-unlock-p", "a"), ("chord-unlock-p", "d")]) == {
        ("chord-unlock-p", "a")
    }


def test_the_last_counted_part_reporting_again_may_send_the_callback_only_if_it_never_was(
    app: Celery,
) -> None:
    """A worker killed after the chord's last count and before Celery sent the callback (and
    deleted the counter): the part's redelivery gets the chord's size again from its repeat
    count, so Celery sends the callback. Once the counter is deleted, a repeat gets 0."""
    backend = backend_of(app)
    results = backend.results
    backend.set_chord_size("g1", 2)
    key = "chord-unlock-g1"
    assert results.incr(key, part="a") == 1
    assert results.incr(key, part="b") == 2  # the last count; then the worker dies
    assert results.incr(key, part="a") == 0  # not the last count: nothing
    assert results.incr(key, part="b") == 2  # the counter still stands at b's count: again
    counters = results.counters
    with results.store.engine.connect() as conn:
        stored = conn.execute(select(counters.c.value).where(counters.c.key == key)).scalar()
    assert stored == 2  # counted once each
    backend.delete(key.encode())  # Celery, after sending the callback
    assert results.incr(key, part="b") == 0


def test_which_redelivered_chord_parts_need_nothing_more(app: Celery) -> None:
    backend = backend_of(app)
    results = backend.results
    backend.set_chord_size("g2", 3)
    key = "chord-unlock-g2"
    results.incr(key, part="a")
    results.incr(key, part="b")
    # a and b are counted; the chord is not complete, so even the latest count (b) needs
    # nothing more; c was never counted.
    parts = [(key, "a"), (key, "b"), (key, "c")]
    assert results.parts_settled(parts) == {(key, "a"), (key, "b")}
    results.incr(key, part="c")  # the last count: c's callback may not have been sent
    assert results.parts_settled(parts) == {(key, "a"), (key, "b")}
    backend.delete(key.encode())  # the callback was sent: all settled
    assert results.parts_settled(parts) == {(key, "a"), (key, "b"), (key, "c")}
    # Without a stored size, the latest count is not known to be short of it: run again.
    results.incr("chord-unlock-g3", part="x")
    assert results.parts_settled([("chord-unlock-g3", "x")]) == set()


@pytest.fixture
def published(app: Celery, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The arguments of every chord callback the backend sends (captured, not published)."""
    sent: list[Any] = []
    monkeypatch.setattr(app.amqp, "_retry_publish", lambda send, ret: sent.append(ret))
    return sent


def test_a_chord_callback_fires_once_when_a_part_reports_twice(
    app: Celery, published: list[Any]
) -> None:
    backend = backend_of(app)
    header = GroupResult("twice-g", [AsyncResult("tw-a", app=app), AsyncResult("tw-b", app=app)])
    header.save()
    body = dict(app.signature("t.add", args=(1,)))
    for task_id in ("tw-a", "tw-b"):
        backend.store_result(task_id, 1, states.SUCCESS)
    for task_id in ("tw-a", "tw-a", "tw-b", "tw-b"):  # each part reports twice
        request = SimpleNamespace(id=task_id, group="twice-g", chord=body, task="t.add")
        backend.on_chord_part_return(request, states.SUCCESS, 1)
    assert published == [[1, 1]]


def test_a_part_delivered_again_after_its_chord_fired_leaves_the_body_alone(
    app: Celery, published: list[Any]
) -> None:
    # Celery's test_chord_header_id_duplicated_on_rabbitmq_msg_duplication: a part's message
    # published twice reports after the chord fired, when Celery has deleted the group.
    # Celery's base restores the group before counting and failed the body with
    # "GroupResult … no longer exists".
    backend = backend_of(app)
    header = GroupResult("late-g", [AsyncResult("late-a", app=app), AsyncResult("late-b", app=app)])
    header.save()
    body = app.signature("t.add", args=(1,))
    body_id = body.freeze().id
    for task_id in ("late-a", "late-b"):
        backend.store_result(task_id, 1, states.SUCCESS)
        request = SimpleNamespace(id=task_id, group="late-g", chord=dict(body), task="t.add")
        backend.on_chord_part_return(request, states.SUCCESS, 1)
    assert published == [[1, 1]]
    assert GroupResult.restore("late-g", app=app) is None  # Celery deleted it on firing
    late = SimpleNamespace(id="late-a", group="late-g", chord=dict(body), task="t.add")
    backend.on_chord_part_return(late, states.SUCCESS, 1)
    assert app.AsyncResult(body_id).state == states.PENDING  # not FAILURE (ChordError)
    assert published == [[1, 1]]


def test_a_chord_whose_group_is_gone_fails_its_body(app: Celery, published: list[Any]) -> None:
    # The parts read the header only when the last one joins it; a group deleted before then
    # (by hand, or expired) still fails the body with Celery's ChordError, not a bare error.
    backend = backend_of(app)
    header = GroupResult("gone-g", [AsyncResult("gone-a", app=app), AsyncResult("gone-b", app=app)])
    header.save()
    backend.set_chord_size("gone-g", 2)
    body = app.signature("t.add", args=(1,))
    body_id = body.freeze().id
    backend.store_result("gone-a", 1, states.SUCCESS)
    first = SimpleNamespace(id="gone-a", group="gone-g", chord=dict(body), task="t.add")
    backend.on_chord_part_return(first, states.SUCCESS, 1)
    header.delete()
    backend.store_result("gone-b", 1, states.SUCCESS)
    last = SimpleNamespace(id="gone-b", group="gone-g", chord=dict(body), task="t.add")
    backend.on_chord_part_return(last, states.SUCCESS, 1)
    failed = app.AsyncResult(body_id)
    assert failed.state == states.FAILURE
    assert "GroupResult gone-g no longer exists" in str(failed.result)
    assert published == []


def test_chord_with_a_nested_group_waits_for_every_part(app: Celery, published: list[Any]) -> None:
    # Header group(a, chain(b, group(c, d))): a, c and d report as parts (Celery publishes the
    # size, 3, through set_chord_size), while the restored header has two entries. Counting to
    # len(header) fired the body after a and c, then joined d, which had not run: a worker
    # with one process waited forever (Celery's test_canvas::test_nested_group_chain).
    backend = backend_of(app)
    inner = GroupResult("inner-g", [AsyncResult("part-c", app=app), AsyncResult("part-d", app=app)])
    header = GroupResult("chord-g", [AsyncResult("part-a", app=app), inner], app=app)
    header.save()
    backend.set_chord_size("chord-g", 3)
    body = dict(app.signature("t.add", args=(1,)))
    parts = [("part-a", 1), ("part-c", 3), ("part-d", 4)]
    for task_id, value in parts:  # all stored first, so a premature join would not block
        backend.store_result(task_id, value, states.SUCCESS)
    for n, (task_id, value) in enumerate(parts, 1):
        request = SimpleNamespace(id=task_id, group="chord-g", chord=body, task="t.add")
        backend.on_chord_part_return(request, states.SUCCESS, value)
        assert request.chord is body
        assert published == ([] if n < 3 else [[1, [3, 4]]])
    # The size is deleted with the chord's counter.
    assert backend.get(backend.get_key_for_chord("chord-g")) is None


def test_pickle_round_trip_keeps_the_url(app: Celery) -> None:
    import pickle

    backend = backend_of(app)
    clone = pickle.loads(pickle.dumps(backend))
    assert clone.url == backend.url


# ---- fencing ------------------------------------------------------------------------------


def _leased(app: Celery) -> tuple[Store, Any, Any]:
    """A message claimed twice: the first delivery's lease was taken over."""
    backend = backend_of(app)
    store = backend.results.store
    real_now = int(time.time() * 1000)
    store.enqueue("celery", "{}", task_id="tid-fence", now=real_now)
    [first] = store.claim(["celery"], "w1", lease_ms=60_000, now=real_now)
    [second] = store.claim(["celery"], "w2", lease_ms=60_000, now=real_now + 60_001)
    return store, first, second


def _request(message: Any) -> SimpleNamespace:
    return SimpleNamespace(
        id=message.task_id,
        task="t.add",
        args=(),
        kwargs={},
        hostname="w",
        retries=0,
        ignore_result=False,
        group=None,
        parent_id=None,
        root_id=None,
        children=[],
        delivery_info={},
        properties={
            "delivery_info": {
                ID_KEY: message.id,
                ATTEMPT_KEY: message.attempt,
                OWNER_KEY: message.lease_owner,
                LEASE_KEY: 60_000,
            }
        },
    )


def test_stale_delivery_cannot_store_a_result(app: Celery) -> None:
    backend = backend_of(app)
    _, first, second = _leased(app)
    backend.store_result("tid-fence", "stale", states.FAILURE, request=_request(first))
    assert AsyncResult("tid-fence", app=app).state == states.PENDING
    backend.store_result("tid-fence", "fresh", states.SUCCESS, request=_request(second))
    assert AsyncResult("tid-fence", app=app).get(timeout=5) == "fresh"
    backend.store_result("tid-fence", "late", states.SUCCESS, request=_request(first))
    assert AsyncResult("tid-fence", app=app).result == "fresh"


def test_a_result_past_its_lease_clock_is_refused_without_a_round_trip(
    app: Celery, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker published that the delivery's lease clock ran out (it could not renew in
    time): its result is refused here, although the database still holds the lease, and its
    request is marked so (its ack is not sent either: sqlease._core.heartbeat)."""
    backend = backend_of(app)
    store = backend.results.store
    store.enqueue("celery", "{}", task_id="tid-clock")
    [message] = store.claim(["celery"], "w1", lease_ms=60_000)
    slots = ClockSlots(folder=str(tmp_path))
    try:
        request = _request(message)
        ref = slots.take(message.fence, time.monotonic() + 30)
        request.properties["delivery_info"][CLOCK_KEY] = ref
        backend.store_result("tid-clock", "in time", states.STARTED, request=request)
        assert AsyncResult("tid-clock", app=app).state == states.STARTED  # written
        slots.write(ref, message.fence, LOST)

        def no_round_trip(*_args: Any, **_kwargs: Any) -> Any:
            raise AssertionError("a result past its lease clock reached the database")

        monkeypatch.setattr(backend.results, "put", no_round_trip)
        backend.store_result("tid-clock", "late", states.SUCCESS, request=request)
        assert getattr(request, REFUSED, False)
        monkeypatch.undo()
        assert AsyncResult("tid-clock", app=app).state == states.STARTED
        assert store.is_held(message.fence)  # the database would still have taken it
    finally:
        slots.close()


def test_stale_delivery_cannot_advance_a_chord(app: Celery) -> None:
    backend = backend_of(app)
    store, first, second = _leased(app)
    results = ResultStore(store)
    with pytest.raises(FenceRefused):
        results.incr("chord-x", fence=first.fence, task_id="tid-fence")
    assert results.incr("chord-x", fence=second.fence, task_id="tid-fence") == 1
    assert backend.get(b"chord-x") is None  # counters are not results


def test_results_expire_and_cleanup(make_store: Any, clock: FakeClock) -> None:
    results = ResultStore(make_store())
    results.put("k1", b"v", expires_ms=1_000)
    results.put("k2", b"v")
    assert results.get("k1") == b"v"
    clock.advance(1_000)
    assert results.get("k1") is None  # expired rows read as absent at once
    assert results.cleanup() == 1
    assert results.get("k2") == b"v"


def test_completed_messages_lists_final_outcomes_only(make_store: Any) -> None:
    store = make_store()
    results = ResultStore(store)
    store.enqueue("q", "{}", task_id="a")
    store.enqueue("q", "{}", task_id="b")
    a, b = store.claim(["q"], "w", lease_ms=60_000, limit=2)
    assert results.put("celery-task-meta-a", b"{}", state="SUCCESS", task_id="a", fence=a.fence)
    assert results.put("celery-task-meta-b", b"{}", state="STARTED", task_id="b", fence=b.fence)
    assert results.completed_messages([a.id, b.id]) == {a.id}


def test_parts_added_to_a_counter_and_its_fresh_start(make_store: Any) -> None:
    """``add_part`` (Celery's add_to_chord) and ``reset_counter`` (a chord applied again) on
    exact keys: a chord whose id extends another's is not touched."""
    results = ResultStore(make_store())
    key, other = "chord-unlock-g1", "chord-unlock-g10"
    for counter in (key, other):
        results.put(counter, b"2")  # the chord's size
        assert results.incr(counter, part="a") == 1
        assert results.incr(counter, part="b") == 2
    assert results.add_part(key, "c") == 1
    assert results.add_part(key, "d") == 2
    assert results.added_parts(key) == ["c", "d"]
    assert results.added_parts(other) == []
    assert results.incr(key, part="a") == 0  # counted already
    # b's count (2) is the latest but short of the chord's size with the added parts (4):
    # nothing more for it, where the other chord's b (2 of 2) may still owe the callback.
    assert results.part_state(key, "b") == (True, 4)
    assert results.part_state(other, "b") == (False, 2)
    assert results.parts_settled([(key, "b"), (other, "b")]) == {(key, "b")}

    results.reset_counter(key, ["a", "b"])
    assert results.get(key) is None
    assert results.added_parts(key) == []
    assert results.part_state(key, "a") == (False, None)  # neither counted nor sized
    assert results.incr(key, part="a") == 1  # counted afresh
    assert results.incr(key, part="c") == 2  # the added part's record went too
    assert results.get(other) == b"2"
    assert results.incr(other, part="a") == 0  # the other chord keeps its records


def test_a_waits_costly_parent_check_runs_at_most_a_tenth_of_the_time(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``get()`` on a result with parents has Celery check them at each turn of the wait,
    reading each pending one (a chord's header: 1,000 reads); a client waiting on a
    1,000-part chord next to an in-process worker kept it waiting (50 s on SQLite). A check
    that costs runs for no more than a tenth of the wait: here each costs 100 s on the
    checks' clock, which stands still otherwise, so the wait's first is its only one."""
    import threading

    clock = FakeClock(0)
    monkeypatch.setattr(_Costly, "clock", staticmethod(lambda: clock() / 1000))
    checks: list[float] = []

    def costly(self: AsyncResult) -> None:  # as reading a large header's pending results
        checks.append(time.monotonic())
        clock.advance(100_000)

    monkeypatch.setattr(AsyncResult, "_maybe_reraise_parent_error", costly)
    box: dict[str, Any] = {}
    child = AsyncResult("tid-c", app=app, parent=AsyncResult("tid-p", app=app))
    thread = threading.Thread(target=lambda: box.update(value=child.get(timeout=10)))
    thread.start()
    time.sleep(2.5)  # two turns or more of the wait (a nap of 1 s, woken by nothing)
    _writer(app).backend.mark_as_done("tid-c", "done")
    thread.join(10)
    assert box.get("value") == "done", box
    assert len(checks) == 2, checks  # get()'s own check, then the wait's first


def test_a_cheap_check_runs_every_turn_and_a_costly_one_a_tenth_of_the_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock(0)
    monkeypatch.setattr(_Costly, "clock", staticmethod(lambda: clock() / 1000))
    ran: list[int] = []
    cost = {"ms": 1}

    def check() -> None:
        ran.append(clock())
        clock.advance(cost["ms"])

    costly = _Costly(check)
    for _ in range(5):  # 1 ms: under CHEAP, so every turn
        costly()
        clock.advance(100)
    assert len(ran) == 5
    cost["ms"] = 300
    costly()  # runs (the last check was cheap) and costs 300 ms: none for 3 s after it
    started = ran[-1]
    for _ in range(40):
        clock.advance(100)
        costly()
    gaps = [b - a for a, b in itertools.pairwise(ran[5:])]
    assert ran[5] == started and gaps and all(gap >= 3_000 for gap in gaps), gaps
    assert len(ran) == 5 + 1 + 1  # the 4.3 s after it hold one more
    costly(force=True)  # a failure's last check runs whatever it costs
    assert len(ran) == 8
