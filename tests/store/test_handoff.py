"""Handoff (PostgreSQL): a publish leases its message to an idle worker's live offer and sends
the leased row in its notification, so the worker starts it without a claim round trip
(sqlease/handoff.py, docs/explanation/leases.md, "Handoff")."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from sqlalchemy import TextClause, select, text

from sqlease import Store
from sqlease._core.handoff import Handoff, lock_key_for, split
from sqlease._core.results import ResultStore
from sqlease._db.driver import Lane
from sqlease._db.postgresql.listener import PostgresListener
from sqlease.store import Fence
from sqlease.testing import FakeClock
from sqlease.types import NewMessage, Outcome

pytestmark = [pytest.mark.pg, pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)]

OWNER = "host:1:worker-a"
LEASE_MS = 5_000
TTL_MS = 3_000

STORED = Outcome.UPDATED  # what a result write answers when it wrote


@pytest.fixture
def listener(store: Store) -> Iterator[PostgresListener]:
    """The offering worker's listening connection, holding its advisory lock."""
    waker = PostgresListener(store.engine.url, store.notify_channel, lock_key=lock_key_for(OWNER))
    assert waker.fileno() is not None
    yield waker
    waker.close()


def offer(
    store: Store,
    queues: list[str] | None = None,
    owner: str = OWNER,
    seen: dict[str, int] | None = None,
) -> int | None:
    return store.offer(
        queues or ["q"],
        owner,
        lease_ms=LEASE_MS,
        lock_key=lock_key_for(owner),
        ttl_ms=TTL_MS,
        seen=seen,
    )


def _wait_until_unlocked(store: Store, key: int, timeout: float = 10.0) -> None:
    """The server ends a closed connection's session (and frees its advisory lock) a moment
    after the client has closed it."""
    deadline = time.monotonic() + timeout
    query = text(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
        "AND classid = CAST(:high AS oid) AND objid = CAST(:low AS oid)"
    )
    # pg_locks splits a bigint key into classid (high) and objid (low 32 bits).
    parts = {"high": (key >> 32) & 0xFFFFFFFF, "low": key & 0xFFFFFFFF}
    while True:
        with store.engine.connect() as conn:
            if not conn.execute(query, parts).scalar():
                return
        assert time.monotonic() < deadline, "the closed listener's lock was never freed"
        time.sleep(0.01)


def heard(listener: PostgresListener) -> list[str]:
    return listener.wait_payloads(0.5) or []


def test_a_publish_leases_its_message_to_a_live_offer_and_sends_the_row(
    store: Store, listener: PostgresListener, clock: FakeClock
) -> None:
    assert offer(store) is None  # nothing delayed: no due time
    heard(listener)
    message_id = store.enqueue("q", '{"n": 1}', task_id="t1", priority=3)
    row = store.get_message(message_id)
    assert row is not None
    assert (row.lease_owner, row.attempt, row.state) == (OWNER, 1, "ready")
    assert row.lease_expires_at_ms == clock() + LEASE_MS
    # The notification carries the leased row, addressed to the offering worker only.
    mine, queues = split(heard(listener), OWNER)
    assert queues == set()
    assert mine == [Handoff(message_id, 1, row, "q", mine[0].offer_seq)]
    assert mine[0].offer_seq > 0
    assert split([f"\x01{OWNER}\n{{}}"], "host:2:worker-b") == ([], set())
    # An ordinary lease: timeline, fenced ack.
    kinds = [(e.kind, e.attempt, e.data) for e in store.events(task_id="t1")]
    assert kinds == [("enqueued", 0, None), ("claimed", 1, {"owner": OWNER, "handoff": True})]
    assert store.claim(["q"], "other", lease_ms=LEASE_MS) == []
    assert store.ack([row.fence]) == {message_id}
    # One-shot: the next publish is an ordinary one (ready, its queue notified).
    second = store.enqueue("q", '{"n": 2}')
    assert split(heard(listener), OWNER) == ([], {"q"})
    got = store.get_message(second)
    assert got is not None and got.lease_owner is None and got.attempt == 0


def test_no_handoff_to_a_worker_whose_listening_connection_is_gone(
    store: Store, listener: PostgresListener
) -> None:
    offer(store)
    listener.close()  # as when the worker is killed: its connections close, the lock goes
    _wait_until_unlocked(store, lock_key_for(OWNER))
    message_id = store.enqueue("q", "{}")
    row = store.get_message(message_id)
    assert row is not None and row.lease_owner is None
    assert store.claim(["q"], "other", lease_ms=LEASE_MS)[0].id == message_id


def test_an_expired_offer_is_not_used(
    store: Store, listener: PostgresListener, clock: FakeClock
) -> None:
    offer(store)
    clock.advance(TTL_MS)
    message_id = store.enqueue("q", "{}")
    row = store.get_message(message_id)
    assert row is not None and row.lease_owner is None


def test_run_and_delayed_messages_are_never_handed_off(
    store: Store, listener: PostgresListener
) -> None:
    """A run's message needs the claim's per-run lock; a delayed one is not due. Both wait
    for an ordinary claim, and the offer stays for the next plain message (once the run's
    message, ready before it, is claimed: a handoff never passes a message waiting)."""
    offer(store)
    in_run = store.enqueue("q", "{}", run_id="R")
    delayed = store.enqueue("q", "{}", delay_ms=60_000)
    [head] = store.claim(["q"], "other", lease_ms=LEASE_MS)
    assert head.id == in_run
    plain = store.enqueue("q", "{}")
    owners = {
        i: getattr(store.get_message(i), "lease_owner", "?") for i in (in_run, delayed, plain)
    }
    assert owners == {in_run: "other", delayed: None, plain: OWNER}


def test_a_handoff_never_passes_a_message_waiting_in_its_queue(
    store: Store, listener: PostgresListener
) -> None:
    """An offer can stand a moment after a message it missed went to the table (the publish
    raced the worker's look). A publish behind that message is not handed over: it waits
    its turn, and a claim takes both in order. A message already leased (running) is not
    waiting."""
    first = store.enqueue("q", "{}")  # before the offer: in the table, ready
    offer(store)
    second = store.enqueue("q", "{}")
    assert [store.get_message(i).lease_owner for i in (first, second)] == [None, None]  # type: ignore[union-attr]
    claimed = store.claim(["q"], "other", lease_ms=LEASE_MS, limit=2)
    assert [m.id for m in claimed] == [first, second]
    third = store.enqueue("q", "{}")  # the others are leased: nothing waits
    assert getattr(store.get_message(third), "lease_owner", None) == OWNER


def test_a_message_no_offer_could_take_is_published_without_the_offer_lookup(
    store: Store, listener: PostgresListener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's, a delayed and a gated message skip the lookup (and its cost) altogether; a
    plain message still looks, and takes the offer."""
    sent: list[str] = []
    lane = store.driver.lane(Lane.PUBLISH)
    assert lane is not None
    rows = lane.rows

    def recording(statement: TextClause, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        sent.append(str(statement))
        return rows(statement, params)

    monkeypatch.setattr(lane, "rows", recording)
    offer(store)
    store.enqueue("q", "{}", run_id="R")
    store.enqueue("q", "{}", delay_ms=60_000)
    store.enqueue_many([NewMessage("q", "{}", concurrency_key="k", concurrency_limit=2)])
    store.claim(["q"], "other", lease_ms=LEASE_MS, limit=10)  # none left waiting ahead
    plain = store.enqueue("q", "{}")
    looked = [store.tables.offers.name in sql for sql in sent]
    assert looked == [False, False, False, True]
    assert getattr(store.get_message(plain), "lease_owner", None) == OWNER


def test_an_offer_covers_its_queues_only_and_is_replaced_by_the_next(
    store: Store, listener: PostgresListener
) -> None:
    offer(store, ["a", "b"])
    offer(store, ["b"])  # no longer consuming "a"
    on_a = store.enqueue("a", "{}")
    on_b = store.enqueue("b", "{}")
    assert getattr(store.get_message(on_a), "lease_owner", "?") is None
    assert getattr(store.get_message(on_b), "lease_owner", "?") == OWNER
    offer(store, ["b"])
    store.withdraw_offers(OWNER)
    after = store.enqueue("b", "{}")
    assert getattr(store.get_message(after), "lease_owner", "?") is None


def test_the_offer_reports_when_the_next_delayed_message_is_due(
    store: Store, listener: PostgresListener
) -> None:
    store.enqueue("q", "{}", delay_ms=2_500)
    assert offer(store) == 2_500


def test_a_long_message_is_handed_by_id_and_read_back(
    store: Store, listener: PostgresListener
) -> None:
    offer(store)
    heard(listener)
    payload = json.dumps({"pad": 'x"y' * 4_000})  # over NOTIFY's 8000 bytes once escaped
    message_id = store.enqueue("q", payload)
    [handoff], _ = split(heard(listener), OWNER)
    assert handoff == Handoff(message_id, 1, None, "q", handoff.offer_seq)
    assert handoff.offer_seq > 0
    row = store.get_message(message_id)
    assert row is not None and row.payload == payload and row.lease_owner == OWNER


def test_concurrent_publishes_never_share_one_offer(
    make_store: Callable[..., Store], store: Store, listener: PostgresListener
) -> None:
    offer(store)
    stores = [make_store() for _ in range(8)]
    start = threading.Barrier(len(stores))
    ids: list[int] = []

    def publish(s: Store) -> None:
        start.wait()
        ids.append(s.enqueue("q", "{}"))

    threads = [threading.Thread(target=publish, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    owners = [getattr(store.get_message(i), "lease_owner", "?") for i in ids]
    assert sorted(owners, key=str) == [None] * 7 + [OWNER]


def test_a_handed_message_is_taken_over_after_its_lease_like_any_other(
    store: Store, listener: PostgresListener, clock: FakeClock
) -> None:
    offer(store)
    message_id = store.enqueue("q", "{}", task_id="t")
    row = store.get_message(message_id)
    assert row is not None
    clock.advance(LEASE_MS)
    [taken] = store.claim(["q"], "other", lease_ms=LEASE_MS)
    assert (taken.id, taken.attempt) == (message_id, 2)
    assert store.ack([row.fence]) == set()  # the first holder's late ack changes nothing
    assert store.ack([taken.fence]) == {message_id}


def test_each_queue_of_an_offer_is_used_once(store: Store, listener: PostgresListener) -> None:
    offer(store, ["a", "b"])
    first_a, first_b, second_a = (store.enqueue(q, "{}") for q in ("a", "b", "a"))
    owners = [getattr(store.get_message(i), "lease_owner", "?") for i in (first_a, first_b)]
    assert owners == [OWNER, OWNER]
    assert getattr(store.get_message(second_a), "lease_owner", "?") is None


def offers_of(store: Store) -> dict[tuple[str, str], int]:
    """The offers a publish could use (live: not handed), with their expiry."""
    t = store.tables.offers
    with store.engine.connect() as conn:
        rows = conn.execute(
            select(t.c.owner, t.c.queue, t.c.expires_at_ms).where(t.c.handed.is_(False))
        ).all()
    return {(r.owner, r.queue): int(r.expires_at_ms) for r in rows}


def handed_seq(listener: PostgresListener, message_id: int) -> int:
    """The offer number the handoff of ``message_id`` carried (as the worker hears it)."""
    mine, _ = split(heard(listener), OWNER)
    [handoff] = [h for h in mine if h.message_id == message_id]
    return handoff.offer_seq


def owner_of(store: Store, message_id: int) -> str | None:
    row = store.get_message(message_id)
    assert row is not None
    return row.lease_owner


def test_a_used_offer_stands_again_only_once_its_worker_has_heard_of_the_handoff(
    store: Store, listener: PostgresListener
) -> None:
    """The refresh an idle worker sends before it has read a handoff's notification must not
    offer it again: it is no longer idle, and a second publish would be handed to it past its
    prefetch limit (a CI run saw exactly this)."""
    offer(store, ["a", "b"])
    heard(listener)
    first = store.enqueue("a", "{}")
    assert owner_of(store, first) == OWNER
    offer(store, ["a", "b"])  # the idle look's refresh, sent before the notification is read
    second = store.enqueue("a", "{}")
    assert owner_of(store, second) is None  # not handed: the worker has not heard of the first
    seq = handed_seq(listener, first)
    offer(store, ["a", "b"], seen={"a": seq - 1})  # an older handoff heard: still not this one
    assert owner_of(store, store.enqueue("a", "{}")) is None
    on_b = store.enqueue("b", "{}")  # the other queue's offer was refreshed all along
    assert owner_of(store, on_b) == OWNER
    heard(listener)
    store.claim(["a"], "other", lease_ms=LEASE_MS, limit=10)  # those not handed: claimed
    offer(store, ["a", "b"], seen={"a": seq})
    third = store.enqueue("a", "{}")
    assert owner_of(store, third) == OWNER
    # That offer stood again under a new number: the first handoff's does not revive it.
    fourth_seq = handed_seq(listener, third)
    assert fourth_seq > seq
    offer(store, ["a"], seen={"a": seq})
    assert owner_of(store, store.enqueue("a", "{}")) is None


def test_withdrawing_keeps_used_offers_until_the_worker_closes(
    store: Store, listener: PostgresListener
) -> None:
    """A worker that turns busy withdraws its offers; a used one must still wait for its
    handoff to be heard (deleting it would let the next idle look make a fresh one). At
    close everything goes."""
    offer(store)
    heard(listener)
    used = store.enqueue("q", "{}")
    store.withdraw_offers(OWNER)
    offer(store)  # idle again, the handoff still unread
    assert owner_of(store, store.enqueue("q", "{}")) is None
    store.withdraw_offers(OWNER, handed_too=True)
    t = store.tables.offers
    with store.engine.connect() as conn:
        assert conn.execute(select(t.c.queue).where(t.c.owner == OWNER)).all() == []
    store.claim(["q"], "other", lease_ms=LEASE_MS)  # the one not handed: claimed
    offer(store)
    assert owner_of(store, store.enqueue("q", "{}")) == OWNER
    assert owner_of(store, used) == OWNER


STAMP = {"queues": ["q"], "lease_ms": LEASE_MS, "lock_key": lock_key_for(OWNER), "ttl_ms": TTL_MS}


def test_a_final_result_puts_back_its_workers_offer_only_under_its_lease(
    store: Store, listener: PostgresListener, clock: FakeClock
) -> None:
    """A delivery an idle worker took carries its next offer (``OFFER_KEY``); the task's
    result writes it in its own statement, so it stands before the client wakes. A result
    refused for a lost lease writes none, and a malformed stamp only drops the offer."""
    results = ResultStore(store)
    offer(store)
    heard(listener)
    held = store.get_message(store.enqueue("q", "{}", task_id="t1"))
    assert held is not None and held.lease_owner == OWNER  # handed over: the offer is used up
    assert offers_of(store) == {}
    # A stamp made before the worker heard of that handoff leaves the used offer alone.
    assert results.put("k0", b"{}", state="SUCCESS", fence=held.fence, offer=STAMP) is STORED
    assert offers_of(store) == {}
    stamp = {**STAMP, "seen": {"q": handed_seq(listener, held.id)}}
    assert results.put("k1", b"{}", state="SUCCESS", fence=held.fence, offer=stamp) is STORED
    assert offers_of(store) == {(OWNER, "q"): clock() + TTL_MS}
    following = store.get_message(store.enqueue("q", "{}"))
    assert following is not None and following.lease_owner == OWNER  # the next is handed over
    assert offers_of(store) == {}
    stale = Fence(held.id, OWNER, held.attempt + 1)
    assert results.put("k2", b"{}", state="SUCCESS", fence=stale, offer=stamp) is Outcome.LEASE_LOST
    assert offers_of(store) == {}
    bad = {"queues": "q", "lease_ms": "soon"}
    assert results.put("k3", b"{}", state="SUCCESS", fence=held.fence, offer=bad) is STORED
    bad_seen = {**STAMP, "seen": ["q"]}
    assert (
        results.put("k4", b"{}", state="SUCCESS", fence=held.fence, offer=bad_seen)
        is Outcome.UPDATED
    )
    assert offers_of(store) == {}


def test_the_ack_keeps_an_offer_that_stands(
    store: Store, listener: PostgresListener, clock: FakeClock
) -> None:
    """The ack that leaves a worker idle offers only if no offer stands: updating one would
    lock its row just when the client's next publish looks for it (and skips locked ones)."""
    offer(store)
    heard(listener)
    message_id = store.enqueue("q", "{}")
    row = store.get_message(message_id)
    assert row is not None
    seen = {"q": handed_seq(listener, message_id)}
    offer(store, seen=seen)  # as the task's result does
    before = offers_of(store)
    assert before
    clock.advance(1_000)
    terms = {"lease_ms": LEASE_MS, "lock_key": lock_key_for(OWNER), "ttl_ms": TTL_MS}
    acked, due = store.ack_and_offer([row.fence], ["q"], OWNER, seen=seen, **terms)
    assert acked == {message_id} and due is None
    assert offers_of(store) == before  # kept, not rewritten
    # A publish uses it before the ack of the next task: unheard, the ack does not revive it.
    handed = store.enqueue("q", "{}")
    handed_row = store.get_message(handed)
    assert handed_row is not None and handed_row.lease_owner == OWNER
    heard_seq = handed_seq(listener, handed)
    store.enqueue("other", "{}")
    [held] = store.claim(["other"], OWNER, lease_ms=LEASE_MS)
    store.ack_and_offer([handed_row.fence], ["q"], OWNER, seen=seen, **terms)
    assert offers_of(store) == {}
    # Heard, the same combined statement makes it stand again.
    store.ack_and_offer([held.fence], ["q"], OWNER, seen={"q": heard_seq}, **terms)
    assert offers_of(store) == {(OWNER, "q"): clock() + TTL_MS}
    store.withdraw_offers(OWNER)
    other = store.enqueue("q", "{}")
    [claimed] = store.claim(["q"], OWNER, lease_ms=LEASE_MS)
    assert claimed.id == other
    store.ack_and_offer([claimed.fence], ["q"], OWNER, **terms)
    assert offers_of(store) == {(OWNER, "q"): clock() + TTL_MS}  # none stood: made


def test_the_ack_of_a_handed_delivery_with_the_next_offer_skips_the_runs_promotion(
    store: Store, listener: PostgresListener
) -> None:
    """A handed message is never in a run (a run's message is not handed over): once its
    worker has noted the delivery (``offers.handed``), the ack that leaves the worker idle
    takes the statement without a run's promotion. It acks, offers again and records the
    ack as the full statement does."""
    offer(store)
    message_id = store.enqueue("q", '{"n": 1}', task_id="t1")
    row = store.get_message(message_id)
    assert row is not None and row.lease_owner == OWNER
    store.offers.handed([row])
    terms = {"lease_ms": LEASE_MS, "lock_key": lock_key_for(OWNER), "ttl_ms": TTL_MS}
    seen = {"q": handed_seq(listener, message_id)}
    op = store.offer_op([row.fence], ["q"], OWNER, seen=seen, **terms)
    assert op.statement is store.sql.ack_outside_runs_offer
    acked, due, db_now = store.driver.execute(op)
    assert acked == {message_id} and due is None and db_now is not None
    assert [e.kind for e in store.events(task_id="t1")] == ["enqueued", "claimed", "acked"]
    assert set(offers_of(store)) == {(OWNER, "q")}  # standing again
    # Not noted (another process's delivery, or forgotten): the full statement, same effect.
    second = store.enqueue("q", '{"n": 2}', task_id="t2")
    row2 = store.get_message(second)
    assert row2 is not None and row2.lease_owner == OWNER
    seen = {"q": handed_seq(listener, second)}
    op = store.offer_op([row2.fence], ["q"], OWNER, seen=seen, **terms)
    assert op.statement is store.sql.ack_offer
    assert store.driver.execute(op)[0] == {second}
    assert [e.kind for e in store.events(task_id="t2")] == ["enqueued", "claimed", "acked"]
