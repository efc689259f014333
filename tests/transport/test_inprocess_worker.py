"""Celery's own in-process test worker (``celery.contrib.testing.worker.start_worker``, what
``celery.contrib.pytest``'s ``celery_worker`` fixtures use) runs on sqlease as on any broker:
solo and threads pools, the ping check, results through sqlease's backend, a retry, the
STARTED state (``task_track_started``), ``autoretry_for`` with backoff, a clean stop that
leaves nothing leased, the canvas (chain, group, chord, link, link_error, a chord's error)
with the result API (forget, GroupResult save and restore, ``get(on_message=...)``), a frozen
chord applied twice, parts added to a chord (``add_to_chord``), and a
client sending through a topic exchange it never declared."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from celery import Celery, chain, chord, group
from celery.contrib.testing.worker import start_worker
from celery.result import GroupResult

from conftest import unique_prefix
from sqlease import Store

pytestmark = pytest.mark.timeout(60)


def _app(db_url: str, prefix: str) -> Celery:
    url = "sqlease+" + db_url
    app = Celery("inprocess", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        broker_transport_options={"table_prefix": prefix, "polling_interval": 0.05},
        result_backend_transport_options={"table_prefix": prefix},
    )
    app.loader.import_task_module("celery.contrib.testing.tasks")  # celery.ping

    @app.task(name="inprocess.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="inprocess.retry_once", bind=True, shared=False, max_retries=3)
    def retry_once(self: Any) -> int:
        if self.request.retries == 0:
            raise self.retry(countdown=0.1)
        return self.request.retries

    return app


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_celerys_test_worker_runs_tasks_on_sqlease(db_url: str, pool: str) -> None:
    prefix = unique_prefix()
    app = _app(db_url, prefix)
    add, retry_once = app.tasks["inprocess.add"], app.tasks["inprocess.retry_once"]
    with start_worker(app, pool=pool, concurrency=2, perform_ping_check=True, shutdown_timeout=10):
        assert add.delay(2, 2).get(timeout=10) == 4
        results = [add.delay(i, i) for i in range(10)]
        assert [r.get(timeout=10) for r in results] == [2 * i for i in range(10)]
        assert retry_once.delay().get(timeout=10) == 1
        # A result is stored before its task's ack is written (acks_late): stopping the
        # worker right after get() could close the channel with that ack still on its way,
        # and the finished task would be released (to be settled from its stored result at
        # its next delivery, not run again). Let the worker ack, then stop it.
        store = Store(db_url, table_prefix=prefix)
        deadline = time.monotonic() + 10
        while store.size("celery") and time.monotonic() < deadline:
            time.sleep(0.02)
    assert store.size("celery") == 0
    table = store.tables.messages
    with store.engine.connect() as conn:
        left = conn.execute(table.select().where(table.c.queue == "celery")).fetchall()
    assert left == []  # acked: nothing leased or parked behind the stopped worker
    app.close()


def test_canvas_callbacks_and_result_api_through_the_test_worker(db_url: str) -> None:
    prefix = unique_prefix()
    app = _app(db_url, prefix)
    errors: list[str] = []

    @app.task(name="inprocess.total", shared=False)
    def total(values: list[int]) -> int:
        return sum(values)

    @app.task(name="inprocess.boom", shared=False)
    def boom() -> None:
        raise ValueError("boom")

    @app.task(name="inprocess.on_error", shared=False)
    def on_error(request: Any, exc: BaseException, traceback: str) -> None:
        errors.append(f"{request.id} {exc!r}")

    add = app.tasks["inprocess.add"]
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=True):
        assert chain(add.s(1, 1), add.s(2), add.s(3)).delay().get(timeout=10) == 7
        assert group(add.s(i, i) for i in range(5)).delay().get(timeout=10) == [0, 2, 4, 6, 8]
        assert chord((add.s(i, i) for i in range(5)), total.s()).delay().get(timeout=10) == 20
        linked = add.apply_async((1, 2), link=add.s(10))
        assert linked.get(timeout=10) == 3
        assert linked.children and linked.children[0].get(timeout=10) == 13
        failed = boom.apply_async(link_error=on_error.s())
        with pytest.raises(ValueError, match="boom"):
            failed.get(timeout=10)
        deadline = time.monotonic() + 10
        while not errors and time.monotonic() < deadline:
            time.sleep(0.02)
        assert errors == [f"{failed.id} ValueError('boom')"]
        saved = group(add.s(1, 1), add.s(2, 2)).delay()
        saved.save()
        assert GroupResult.restore(saved.id, app=app).get(timeout=10) == [2, 4]
        done = add.delay(3, 3)
        assert done.get(timeout=10) == 6
        done.forget()
        assert done.state == "PENDING"
    app.close()


def test_started_state_and_autoretry_with_backoff(db_url: str) -> None:
    # task_track_started: the STARTED state is written through sqlease's fenced backend
    # while the task runs; autoretry_for with retry_backoff republishes with its countdown
    # (Celery's backoff is whole seconds: 1 s before the first retry).
    prefix = unique_prefix()
    app = _app(db_url, prefix)
    app.conf.task_track_started = True
    release = threading.Event()

    @app.task(name="inprocess.held", shared=False)
    def held() -> str:
        release.wait(10)
        return "done"

    @app.task(
        name="inprocess.flaky",
        bind=True,
        shared=False,
        autoretry_for=(ValueError,),
        retry_backoff=True,
        retry_jitter=False,
        max_retries=1,
    )
    def flaky(self: Any, failures: int) -> int:
        if self.request.retries < failures:
            raise ValueError(f"failure {self.request.retries + 1}")
        return self.request.retries

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        running = held.delay()
        deadline = time.monotonic() + 10
        while running.state == "PENDING" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert running.state == "STARTED"
        assert running.info["pid"] and running.info["hostname"]
        release.set()
        assert running.get(timeout=10) == "done" and running.state == "SUCCESS"
        retried = flaky.delay(1)
        sent = time.monotonic()
        assert retried.get(timeout=10) == 1
        assert time.monotonic() - sent >= 1.0  # the backoff's countdown was kept
        gave_up = flaky.delay(5)
        with pytest.raises(ValueError, match="failure 2"):
            gave_up.get(timeout=10)
        assert gave_up.state == "FAILURE"
    app.close()


def test_get_on_message_follows_a_running_tasks_progress(db_url: str) -> None:
    # AsyncResult.get(on_message=...) is given the task's own states (update_state) while it
    # runs; each step waits for the client to have seen the one before, so none is written
    # over unseen. STARTED, written just before the first step, may be written over unseen,
    # or come after it: the client listens, then reads the state (PROGRESS already), then
    # takes the notifications sent before that read (Redis's result consumer also subscribes,
    # reads, then takes its messages), so the state read first may come again after it.
    prefix = unique_prefix()
    app = _app(db_url, prefix)
    app.conf.task_track_started = True
    steps = [threading.Event() for _ in range(2)]

    @app.task(name="inprocess.progress", bind=True, shared=False)
    def progress(self: Any) -> str:
        for done, seen_by_client in enumerate(steps, start=1):
            self.update_state(state="PROGRESS", meta={"done": done})
            assert seen_by_client.wait(10)
        return "finished"

    seen: list[tuple[str, Any]] = []

    def on_message(meta: dict[str, Any]) -> None:
        seen.append((meta["status"], meta["result"]))
        if meta["status"] == "PROGRESS":
            steps[meta["result"]["done"] - 1].set()

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert progress.delay().get(timeout=20, on_message=on_message) == "finished"
    progress = [entry for entry in seen if entry[0] != "STARTED"]
    in_order = [entry for i, entry in enumerate(progress) if i == 0 or entry != progress[i - 1]]
    assert in_order == [
        ("PROGRESS", {"done": 1}),
        ("PROGRESS", {"done": 2}),
        ("SUCCESS", "finished"),
    ]
    app.close()


def test_a_failed_chord_part_is_named_in_the_bodys_chord_error(db_url: str) -> None:
    # As with Redis's backend: the body fails with ChordError("Dependency <id> raised ...")
    # naming the header part that failed, its cause that part's exception.
    prefix = unique_prefix()
    app = _app(db_url, prefix)
    add = app.tasks["inprocess.add"]

    @app.task(name="inprocess.fail", shared=False)
    def fail(message: str) -> None:
        raise ValueError(message)

    @app.task(name="inprocess.total", shared=False)
    def total(values: list[int]) -> int:
        return sum(values)

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        body = chord([add.s(1, 1), fail.s("part failed"), add.s(2, 2)], total.s())()
        with pytest.raises(ValueError, match="part failed"):  # Celery raises the header's first
            body.get(timeout=10)
        deadline = time.monotonic() + 10
        while body.state == "PENDING" and time.monotonic() < deadline:
            time.sleep(0.02)
        failed_part = body.parent.results[1].id
        assert body.state == "FAILURE"
        assert type(body.result).__name__ == "ChordError"
        assert str(body.result) == f"Dependency {failed_part} raised ValueError('part failed')"
    app.close()


def test_a_client_routes_through_a_topic_exchange_it_never_declared(db_url: str) -> None:
    # The worker declares the topic exchange and binds its queue by pattern; a client that
    # knows only the exchange's name (no task_queues of its own) sends through it, as with
    # RabbitMQ: the message reaches the bound queue by its pattern.
    from kombu import Exchange, Queue

    prefix = unique_prefix()
    worker_app = _app(db_url, prefix)
    orders = Exchange("orders", type="topic")
    worker_app.conf.task_queues = [Queue("orders_eu", orders, routing_key="orders.eu.*")]
    client = _app(db_url, prefix)
    with start_worker(worker_app, pool="threads", concurrency=1, perform_ping_check=False):
        result = client.send_task(
            "inprocess.add", (20, 22), exchange="orders", routing_key="orders.eu.paris"
        )
        assert result.get(timeout=10) == 42
        assert result.result == 42
    worker_app.close()
    client.close()


def test_a_frozen_chord_applied_again_runs_its_body_again(db_url: str) -> None:
    # Each apply is a new run, though it keeps its group id and its header's task ids (Celery's
    # suite: test_reapplying_frozen_chord_dispatches_body_again); the parts the first apply
    # counted must not keep the second's from counting.
    prefix = unique_prefix()
    app = _app(db_url, prefix)
    add = app.tasks["inprocess.add"]
    runs: list[list[int]] = []

    @app.task(name="inprocess.collect", shared=False)
    def collect(values: list[int]) -> int:
        runs.append(sorted(values))
        return sum(values)

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        frozen = chord(group(add.s(1, 2), add.s(3, 4)), collect.s())
        frozen.freeze()
        first = frozen.apply_async()
        assert first.get(timeout=10) == 10
        # The body's result is stored before the last part deletes the first apply's group
        # and counter; applied again before that, the new group would go with them.
        backend, group_id = app.backend, first.parent.id
        keys = (backend.get_key_for_group(group_id), backend.get_key_for_chord(group_id))
        deadline = time.monotonic() + 10
        while any(backend.get(k) is not None for k in keys) and time.monotonic() < deadline:
            time.sleep(0.02)
        frozen.apply_async()
        deadline = time.monotonic() + 10
        while len(runs) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert runs == [[3, 7], [3, 7]]
    app.close()


def test_a_part_adds_tasks_and_a_chain_to_its_chord(db_url: str) -> None:
    # Celery's Task.add_to_chord, which only Redis's backend had: the chord waits for the added
    # parts and joins their results with the header's (Celery's suite: test_add_to_chord,
    # test_add_chord_to_chord).
    prefix = unique_prefix()
    app = _app(db_url, prefix)
    add = app.tasks["inprocess.add"]

    @app.task(name="inprocess.identity", shared=False)
    def identity(value: Any) -> Any:
        return value

    @app.task(name="inprocess.total", shared=False)
    def total(values: list[int]) -> int:
        return sum(values)

    @app.task(name="inprocess.adds_tasks", bind=True, shared=False)
    def adds_tasks(self: Any, numbers: list[int], value: int) -> int:
        for number in numbers:
            self.add_to_chord(add.s(number, value))
        return 0

    @app.task(name="inprocess.adds_a_chain", bind=True, shared=False)
    def adds_a_chain(self: Any, numbers: list[int], value: int) -> int:
        self.add_to_chord(group(add.s(n, value) for n in numbers) | total.s())
        return 0

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        tasks = (group([adds_tasks.s([1, 2, 3], 4)]) | identity.s())()
        assert tasks.get(timeout=20) == [0, 5, 6, 7]  # the header's, then the added ones
        chained = (group([adds_a_chain.s([1, 2, 3], 4)]) | identity.s())()
        assert sorted(chained.get(timeout=20)) == [0, 18]
    app.close()


def test_a_chords_header_is_read_once_by_its_last_part(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Celery's key/value base restores (decodes) the whole header in every part; read in each
    # of 1,000 parts, a 1,000-part chord took 40 s here. Only the part that completes the
    # chord reads it now; the others ask whether it exists.
    from celery.backends.base import KeyValueStoreBackend

    prefix = unique_prefix()
    app = _app(db_url, prefix)
    add = app.tasks["inprocess.add"]
    reads: list[str] = []
    restore = KeyValueStoreBackend._restore_group

    def counted(self: Any, group_id: str) -> Any:
        reads.append(group_id)
        return restore(self, group_id)

    monkeypatch.setattr(KeyValueStoreBackend, "_restore_group", counted)

    @app.task(name="inprocess.total", shared=False)
    def total(values: list[int]) -> int:
        return sum(values)

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        result = chord((add.s(i, i) for i in range(20)), total.s()).delay()
        assert result.get(timeout=20) == 380
    assert len(reads) == 1
    app.close()
