"""Unique tasks on both databases: each scope's lifetime, duplicates enqueue nothing and are
recorded on the original, a retry of the same task is never a duplicate, bad keys are
refused, and retention takes keys that no longer hold."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from sqlease import Admin, ConfigurationError, NewMessage, Store
from sqlease.testing import FakeClock

LEASE = 10_000


def _put(store: Store, task_id: str, key: str = "report:7", scope: str | None = None, **kw) -> int:
    [got] = store.enqueue_many(
        [NewMessage("q", task_id, task_id=task_id, unique_key=key, unique_scope=scope, **kw)]
    )
    return got


def _ready(store: Store) -> list[str]:
    """The task ids of the queue's live (ready or running) messages."""
    m = store.tables.messages
    with store.engine.connect() as conn:
        rows = conn.execute(select(m.c.task_id).where(m.c.state == "ready")).scalars().all()
    return sorted(rows)


def test_active_holds_while_queued_and_running_and_is_released_by_the_ack(
    store: Store,
) -> None:
    first = _put(store, "a")
    assert _put(store, "b") == first  # the original's message
    assert _ready(store) == ["a"]
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    assert _put(store, "c") == first  # running: still held
    assert store.ack([msg.fence]) == {msg.id}
    fresh = _put(store, "d")
    assert fresh != first and _ready(store) == ["d"]
    assert store.originals_of(["b", "c", "d", "zzz"]) == {"b": "a", "c": "a"}
    [dup1, dup2] = [e for e in store.events(task_id="a") if e.kind == "duplicate"]
    assert dup1.data == {"unique_key": "report:7", "scope": "active", "duplicate_id": "b"}
    assert dup2.data["duplicate_id"] == "c"
    assert dup1.message_id == first


def test_queued_lets_a_new_task_queue_behind_a_running_one(store: Store, clock: FakeClock) -> None:
    _put(store, "a", scope="queued")
    assert _put(store, "b", scope="queued") != 0
    assert _ready(store) == ["a"]
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    _put(store, "c", scope="queued")  # a is running: c queues
    assert _ready(store) == ["a", "c"]
    _put(store, "d", scope="queued")  # c is queued: d is its duplicate
    assert store.originals_of(["b", "d"]) == {"b": "a", "d": "c"}
    assert store.ack([msg.fence]) == {msg.id}


def test_queued_holds_again_when_a_crashed_delivery_is_back_in_the_queue(
    store: Store, clock: FakeClock
) -> None:
    _put(store, "a", scope="queued")
    store.claim(["q"], "crashed", lease_ms=LEASE)
    clock.advance(LEASE + 1)  # the lease expired: a waits to be taken over
    _put(store, "b", scope="queued")
    assert store.originals_of(["b"]) == {"b": "a"}
    assert _ready(store) == ["a"]


def test_period_holds_after_the_task_ends_until_the_period_is_over(
    store: Store, clock: FakeClock
) -> None:
    _put(store, "a", scope="period", unique_for_ms=60_000)
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    assert store.ack([msg.fence]) == {msg.id}
    assert _put(store, "b", unique_for_ms=60_000) == 0  # no message of a is left
    assert store.originals_of(["b"]) == {"b": "a"}
    clock.advance(60_000)
    _put(store, "c", unique_for_ms=60_000)
    assert _ready(store) == ["c"]


def test_a_dead_original_no_longer_holds(store: Store) -> None:
    _put(store, "a")
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    assert store.fail(msg.fence, "boom")
    _put(store, "b")
    assert _ready(store) == ["b"]
    assert store.originals_of(["b"]) == {}


def test_a_retry_of_the_same_task_is_not_a_duplicate(store: Store) -> None:
    """Celery's retry republishes the task id before acking the running delivery."""
    _put(store, "a")
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    _put(store, "a")  # the retry, same id
    assert store.ack([msg.fence]) == {msg.id}
    assert _ready(store) == ["a"]
    assert store.originals_of(["a"]) == {}


def test_keys_are_independent_and_a_batch_decides_each(store: Store) -> None:
    ids = store.enqueue_many(
        [
            NewMessage("q", "a", task_id="a", unique_key="k1"),
            NewMessage("q", "b", task_id="b", unique_key="k1"),
            NewMessage("q", "c", task_id="c", unique_key="k2"),
            NewMessage("q", "d", task_id="d"),
        ]
    )
    assert ids[1] == ids[0] and len(set(ids)) == 3
    assert _ready(store) == ["a", "c", "d"]


def test_admin_shows_the_key_its_holder_and_duplicates(store: Store, clock: FakeClock) -> None:
    admin = Admin(store.engine.url, store=store)
    assert admin.unique("nope") is None
    _put(store, "a", key="k", scope="period", unique_for_ms=5_000)
    _put(store, "b", key="k")
    _put(store, "c", key="k")
    state = admin.unique("k")
    assert state is not None
    assert (state.task_id, state.scope, state.holding, state.duplicates) == ("a", "period", True, 2)
    assert state.until_ms == state.created_at_ms + 5_000
    assert admin.original_of("c") == "a" and admin.original_of("a") is None
    clock.advance(5_000)
    state = admin.unique("k")
    assert state is not None and not state.holding


def test_a_publish_in_the_callers_transaction_decides_there(store: Store) -> None:
    with store.engine.begin() as conn:
        store.enqueue_many([NewMessage("q", "a", task_id="a", unique_key="k")], connection=conn)
        store.enqueue_many([NewMessage("q", "b", task_id="b", unique_key="k")], connection=conn)
    assert _ready(store) == ["a"]
    with pytest.raises(RuntimeError), store.engine.begin() as conn:
        store.enqueue_many([NewMessage("q", "x", task_id="x", unique_key="k2")], connection=conn)
        raise RuntimeError("rolled back")
    _put(store, "y", key="k2")  # the rolled-back publish took nothing
    assert _ready(store) == ["a", "y"]


@pytest.mark.parametrize(
    ("key", "scope", "for_ms", "said"),
    [
        ("", None, None, "unique_key must be a non-empty string"),
        (7, None, None, "unique_key must be a non-empty string"),
        ("k" * 201, None, None, "at most 200"),
        ("k", "forever", None, "unique_scope of key 'k' must be one of queued, active, period"),
        ("k", "period", None, "needs unique_for"),
        ("k", "period", 0, "needs unique_for"),
        ("k", "active", 1000, "unique_for is only for scope 'period'"),
        (None, "active", None, "without a unique_key"),
    ],
)
def test_bad_unique_terms_are_refused_and_nothing_is_enqueued(
    store: Store, key, scope, for_ms, said: str
) -> None:
    with pytest.raises(ConfigurationError, match=said):
        store.enqueue_many(
            [
                NewMessage("q", "ok", task_id="ok"),
                NewMessage(
                    "q", "x", task_id="x", unique_key=key, unique_scope=scope, unique_for_ms=for_ms
                ),
            ]
        )
    assert _ready(store) == []


def test_retention_takes_keys_that_no_longer_hold_and_old_duplicates(
    make_store, clock: FakeClock
) -> None:
    from sqlease._core.retention import prune

    store = make_store()
    _put(store, "a", key="done")
    _put(store, "b", key="done")
    _put(store, "c", key="queued-long")
    _put(store, "p", key="period", scope="period", unique_for_ms=10 * 86_400_000)
    for msg in store.claim(["q"], "w", lease_ms=LEASE, limit=10):
        if msg.task_id in ("a", "p"):
            assert store.ack([msg.fence]) == {msg.id}
        else:
            store.release([msg.fence])
    clock.advance(2 * 86_400_000)
    done = prune(store, store.now_ms(), event_retention_ms=86_400_000, dead_retention_ms=0)
    assert done["uniques_expired"] == 2  # "done" and its duplicate
    admin = Admin(store.engine.url, store=store)
    assert admin.unique("done") is None and admin.original_of("b") is None
    assert admin.unique("queued-long") is not None  # its task is still queued
    assert admin.unique("period") is not None  # its period is not over


def test_the_unique_verb(make_store, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sqlease.cli import main

    store = make_store(clock=None)  # the command reads the database's clock
    base = ["--url", db_url, "--table-prefix", store.tables.prefix]
    assert main([*base, "limits", "unique", "k"]) == 0
    assert "no task has taken the unique key 'k'" in capsys.readouterr().out
    _put(store, "a", key="k", scope="period", unique_for_ms=3_600_000)
    _put(store, "b", key="k")
    assert main([*base, "limits", "unique", "k"]) == 0
    text = capsys.readouterr().out
    assert "k: holds (scope period)" in text and "task: a" in text
    assert "duplicates turned away: 1" in text and "(in 59 min" in text
    assert main([*base, "--json", "limits", "unique", "k"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["task_id"] == "a" and shown["holding"] and shown["duplicates"] == 1


def test_a_duplicates_result_reads_as_its_originals_in_one_statement(
    store: Store, clock: FakeClock
) -> None:
    """The result backend's reads (``mget_or_originals``): a duplicate publish never runs, so
    its task id reads as the original's result; a result of its own stands over it, and an
    expired original reads as nothing."""
    from sqlease._core.results import ResultStore

    results = ResultStore(store)
    prefix = "celery-task-meta-"
    _put(store, "a")
    _put(store, "b")  # a duplicate of a
    _put(store, "c")  # another, with a value of its own (written by hand)
    results.put(prefix + "a", b"A", expires_ms=1_000)
    results.put(prefix + "c", b"C")
    results.put("other", b"O")
    keys = [prefix + "a", prefix + "b", prefix + "c", prefix + "zzz", "other", prefix]
    assert results.mget_or_originals(keys, prefix) == [b"A", b"A", b"C", None, b"O", None]
    assert results.get_or_original(prefix + "b", prefix) == b"A"
    clock.advance(1_000)
    assert results.mget_or_originals(keys[:2], prefix) == [None, None]
    assert results.mget_or_originals([], prefix) == []


def test_a_join_of_any_size_reads_in_statements_sqlite_allows(store: Store) -> None:
    """Each key of ``mget_or_originals`` is up to two parameters: 20,000 keys are read in
    statements of 1,000 (SQLite takes at most 32,766 parameters in one), in order."""
    from sqlease._core.results import ResultStore

    results = ResultStore(store)
    prefix = "celery-task-meta-"
    _put(store, "a")
    _put(store, "b")  # a duplicate of a
    results.put(prefix + "a", b"A")
    results.put(prefix + "k19999", b"last")
    keys = [prefix + f"k{i}" for i in range(20_000)] + [prefix + "b"]
    got = results.mget_or_originals(keys, prefix)
    assert len(got) == 20_001
    assert got[-2:] == [b"last", b"A"] and got[:-2] == [None] * 19_999
