"""The lease store's invariants (guarantees.md, invariants 1-6 and 11) on SQLite and
PostgreSQL, fake clock."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sqlease import ConfigurationError, Fence, NewMessage, Outcome, PayloadTooLarge, Store
from sqlease.testing import FakeClock

LEASE = 10_000


def kinds(store: Store, task_id: str) -> list[str]:
    return [e.kind for e in store.events(task_id=task_id)]


# ---- invariant 1: atomic claim ------------------------------------------------------------


def test_claim_leases_with_owner_expiry_and_attempt(store: Store, clock: FakeClock) -> None:
    mid = store.enqueue("q", "p1", task_id="t1")
    [msg] = store.claim(["q"], "w1", lease_ms=LEASE)
    assert msg.id == mid
    assert (msg.lease_owner, msg.attempt) == ("w1", 1)
    assert msg.lease_expires_at_ms == clock() + LEASE
    assert msg.payload == "p1" and msg.task_id == "t1"


def test_a_leased_message_is_not_claimed_again_until_it_expires(
    store: Store, clock: FakeClock
) -> None:
    store.enqueue("q", "p")
    [first] = store.claim(["q"], "w1", lease_ms=LEASE)
    assert store.claim(["q"], "w2", lease_ms=LEASE) == []
    clock.advance(LEASE - 1)
    assert store.claim(["q"], "w2", lease_ms=LEASE) == []
    clock.advance(1)
    [again] = store.claim(["q"], "w2", lease_ms=LEASE)
    assert again.id == first.id
    assert (again.lease_owner, again.attempt) == ("w2", 2)


def test_claim_order_priority_then_available_at_then_enqueue_order(store: Store) -> None:
    low = store.enqueue("q", "low", priority=0)
    high = store.enqueue("q", "high", priority=9)
    later = store.enqueue("q", "later", priority=9, delay_ms=5)  # due later than `high2`
    high2 = store.enqueue("q", "high2", priority=9)
    mid = store.enqueue("q", "mid", priority=5)
    got = store.claim(["q"], "w", lease_ms=LEASE, limit=10, now=store.now_ms() + 10)
    assert [m.id for m in got] == [high, high2, later, mid, low]


def test_a_claim_past_delayed_rows_of_every_priority_takes_only_the_due_ones(
    store: Store, clock: FakeClock
) -> None:
    # Each priority is read up to its first row not yet due: the due rows behind delayed
    # rows of a higher priority, and those of a priority whose delayed rows come first in the
    # index, are all found, in delivery order.
    delayed = [
        store.enqueue("q", f"later{p}-{i}", priority=p, delay_ms=60_000 + i)
        for p in (0, 3, 7)
        for i in range(40)
    ]
    low = store.enqueue("q", "low", priority=0)
    top = store.enqueue("q", "top", priority=9)
    mid = store.enqueue("q", "mid", priority=3)
    got = store.claim(["q"], "w", lease_ms=10 * 60_000, limit=10)
    assert [m.id for m in got] == [top, mid, low]
    clock.advance(60_000)
    due = store.claim(["q"], "w", lease_ms=LEASE, limit=2)
    assert [m.id for m in due] == [delayed[80], delayed[40]]  # priority 7, then 3


def test_a_claim_over_many_queues_orders_them_all(store: Store) -> None:
    # More queues than the claim reads one by one (SQLite reads its first four in scans of
    # their own and the rest in one): the best rows may be in any of them.
    queues = [f"q{i}" for i in range(7)]
    ids = {q: store.enqueue(q, q, priority=i) for i, q in enumerate(queues)}
    later = store.enqueue("q6", "q6-later", priority=6)
    got = store.claim(list(reversed(queues)), "w", lease_ms=LEASE, limit=4)
    assert [m.id for m in got] == [ids["q6"], later, ids["q5"], ids["q4"]]
    rest = store.claim([*queues, "q0", "q6"], "w", lease_ms=LEASE, limit=10)
    assert [m.id for m in rest] == [ids["q3"], ids["q2"], ids["q1"], ids["q0"]]


def test_claim_respects_limit_and_queues(store: Store) -> None:
    for i in range(5):
        store.enqueue("a", f"a{i}")
    store.enqueue("b", "b0")
    store.enqueue("c", "c0")
    got = store.claim(["a", "b"], "w", lease_ms=LEASE, limit=3)
    assert len(got) == 3
    rest = store.claim(["a", "b"], "w", lease_ms=LEASE, limit=10)
    assert sorted(m.payload for m in got + rest) == ["a0", "a1", "a2", "a3", "a4", "b0"]
    assert store.size("c") == 1


def test_claim_over_several_queues_takes_the_best_of_all_in_order(store: Store) -> None:
    # Each queue is read on its own (its first `limit`), then the best `limit` of those:
    # the result must be the same as one ordered scan of all of them.
    a_low = [store.enqueue("a", f"a-low{i}", priority=0) for i in range(3)]
    b_high = store.enqueue("b", "b-high", priority=9)
    c_mid = store.enqueue("c", "c-mid", priority=5)
    a_high = store.enqueue("a", "a-high", priority=9)
    store.enqueue("d", "d-high", priority=9)  # not asked for
    got = store.claim(["a", "b", "c", "a"], "w", lease_ms=LEASE, limit=4)
    assert [m.id for m in got] == [b_high, a_high, c_mid, a_low[0]]
    # A queue named twice is read once: nothing is delivered twice.
    rest = store.claim(["a", "a", "b", "c"], "w", lease_ms=LEASE, limit=10)
    assert [m.id for m in rest] == a_low[1:]
    assert store.claim(["a", "b", "c"], "w", lease_ms=LEASE, limit=10) == []
    assert store.size("d") == 1


def test_delayed_message_is_not_claimed_before_it_is_due(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "later", delay_ms=5_000)
    assert store.claim(["q"], "w", lease_ms=LEASE) == []
    assert store.size("q") == 0
    clock.advance(5_000)
    assert store.size("q") == 1
    assert [m.payload for m in store.claim(["q"], "w", lease_ms=LEASE)] == ["later"]


def test_run_tasks_are_serialized_and_in_order(store: Store, clock: FakeClock) -> None:
    a1 = store.enqueue("q", "a1", run_id="A")
    a2 = store.enqueue("q", "a2", run_id="A")
    b1 = store.enqueue("q", "b1", run_id="B")
    free = store.enqueue("q", "free")
    got = store.claim(["q"], "w", lease_ms=LEASE, limit=10)
    assert sorted(m.id for m in got) == sorted([a1, b1, free])  # a2 waits behind a1
    by_id = {m.id: m for m in got}
    assert store.claim(["q"], "w2", lease_ms=LEASE, limit=10) == []
    assert store.ack([by_id[a1].fence]) == {a1}
    [next_a] = store.claim(["q"], "w2", lease_ms=LEASE, limit=10)
    assert next_a.id == a2


def test_a_run_waits_for_its_head_even_when_the_head_is_delayed(
    store: Store, clock: FakeClock
) -> None:
    store.enqueue("q", "a1", run_id="A")
    store.enqueue("q", "a2", run_id="A")
    [a1] = store.claim(["q"], "w", lease_ms=LEASE)
    assert store.release([a1.fence], delay_ms=1_000) == {a1.id}
    assert store.claim(["q"], "w", lease_ms=LEASE) == []  # a2 must not overtake a1
    clock.advance(1_000)
    assert [m.payload for m in store.claim(["q"], "w", lease_ms=LEASE)] == ["a1"]


def test_run_lock_blocks_a_later_committed_earlier_message(store: Store, clock: FakeClock) -> None:
    # The run's lock, not only head-of-line, keeps two of its tasks from being leased at
    # once: a message of the run that is not the head can never be claimed while the run
    # row is held by another message. Simulate the head leaving while its lease is alive by
    # parking it: the run's next message becomes the head, but parking released the run.
    store.enqueue("q", "a1", run_id="A")
    store.enqueue("q", "a2", run_id="A")
    [a1] = store.claim(["q"], "w", lease_ms=LEASE)
    assert store.claim(["q"], "w2", lease_ms=LEASE) == []
    clock.advance(LEASE)  # a1's lease (and its run lock) expired: a1 itself is taken over
    [again] = store.claim(["q"], "w2", lease_ms=LEASE)
    assert again.id == a1.id and again.attempt == 2
    assert store.claim(["q"], "w3", lease_ms=LEASE) == []


# ---- invariant 2: fencing ------------------------------------------------------------------


def test_stale_worker_cannot_ack_renew_release_or_write(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "p", task_id="t")
    [old] = store.claim(["q"], "w1", lease_ms=LEASE)
    clock.advance(LEASE)
    [new] = store.claim(["q"], "w2", lease_ms=LEASE)
    assert new.attempt == old.attempt + 1
    assert store.ack([old.fence]) == set()
    assert store.renew([old.fence], lease_ms=LEASE) == {}
    assert store.release([old.fence]) == set()
    assert store.compare_and_set(old.fence, "t", 0, checkpoint={"x": 1}).outcome is (
        Outcome.LEASE_LOST
    )
    assert store.append_event(old.fence, "note") is False
    assert store.park(old.fence, "paused") is False
    assert store.fail(old.fence, "boom") is False
    # The holder's lease is untouched by all of that.
    msg = store.get_message(new.id)
    assert msg is not None
    assert (msg.lease_owner, msg.attempt, msg.lease_expires_at_ms) == (
        "w2",
        new.attempt,
        new.lease_expires_at_ms,
    )
    assert store.ack([new.fence]) == {new.id}


def test_same_owner_old_attempt_is_stale(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "p")
    [old] = store.claim(["q"], "w", lease_ms=LEASE)
    clock.advance(LEASE)
    [new] = store.claim(["q"], "w", lease_ms=LEASE)
    assert store.ack([old.fence]) == set()
    assert store.ack([new.fence]) == {new.id}


def test_wrong_owner_is_refused(store: Store) -> None:
    store.enqueue("q", "p")
    [msg] = store.claim(["q"], "w1", lease_ms=LEASE)
    assert store.ack([Fence(msg.id, "intruder", msg.attempt)]) == set()
    assert store.get_message(msg.id) is not None


def test_ack_after_expiry_is_refused_even_before_takeover(store: Store, clock: FakeClock) -> None:
    # An expired lease is lost: acking it could drop a task whose result write was refused.
    store.enqueue("q", "p")
    [msg] = store.claim(["q"], "w1", lease_ms=LEASE)
    clock.advance(LEASE)
    assert store.ack([msg.fence]) == set()
    assert store.get_message(msg.id) is not None


def test_ack_removes_the_row_and_is_not_delivered_again(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "p", task_id="t")
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    assert store.ack([msg.fence]) == {msg.id}
    assert store.ack([msg.fence]) == set()  # a second ack changes nothing
    clock.advance(10 * LEASE)
    assert store.claim(["q"], "w", lease_ms=LEASE) == []
    assert store.get_message(msg.id) is None


def test_batch_ack_reports_only_the_held(store: Store, clock: FakeClock) -> None:
    ids = [store.enqueue("q", f"p{i}") for i in range(4)]
    msgs = store.claim(["q"], "w", lease_ms=LEASE, limit=4)
    assert sorted(m.id for m in msgs) == ids
    stale = Fence(msgs[0].id, "w", msgs[0].attempt + 5)
    assert store.ack([stale, *[m.fence for m in msgs[1:]]]) == {m.id for m in msgs[1:]}


def test_ack_and_claim_acks_the_held_and_claims_the_next(store: Store, clock: FakeClock) -> None:
    """A busy worker's acks and refill claim together (one statement on PostgreSQL): the acked
    rows leave, a stale fence is refused, and the next messages are leased."""
    ids = [store.enqueue("q", f"p{i}", task_id=f"t{i}") for i in range(5)]
    first = store.claim(["q"], "w", lease_ms=LEASE, limit=2)
    stale = Fence(ids[4], "w", 1)  # never claimed: nothing to ack
    acked, claimed = store.ack_and_claim(
        [m.fence for m in first] + [stale], ["q"], "w", lease_ms=LEASE, limit=2
    )
    assert acked == {ids[0], ids[1]}
    assert [(m.id, m.attempt, m.lease_owner) for m in claimed] == [
        (ids[2], 1, "w"),
        (ids[3], 1, "w"),
    ]
    assert all(m.lease_expires_at_ms == clock() + LEASE for m in claimed)
    assert store.get_message(ids[0]) is None and store.get_message(ids[1]) is None
    assert kinds(store, "t0") == ["enqueued", "claimed", "acked"]
    assert kinds(store, "t2") == ["enqueued", "claimed"]
    # Nothing left to claim but the last: the acks still come back.
    acked, claimed = store.ack_and_claim(
        [m.fence for m in claimed], ["q", "other"], "w", lease_ms=LEASE, limit=8
    )
    assert acked == {ids[2], ids[3]} and [m.id for m in claimed] == [ids[4]]
    acked, claimed = store.ack_and_claim([claimed[0].fence], ["q"], "w", lease_ms=LEASE, limit=8)
    assert (acked, claimed) == ({ids[4]}, [])
    assert store.size("q") == 0


def test_ack_and_claim_keeps_a_run_serialized(store: Store, clock: FakeClock) -> None:
    """The claim that goes with an ack may not see it (one snapshot on PostgreSQL), so the
    run's next message comes with it or with the next claim, never while the head is held."""
    a1 = store.enqueue("q", "a1", run_id="A")
    a2 = store.enqueue("q", "a2", run_id="A")
    [head] = store.claim(["q"], "w", lease_ms=LEASE)
    assert head.id == a1
    # Another worker's combined ack+claim cannot take a2 while a1 is held.
    other = store.enqueue("q", "free")
    held = store.claim(["q"], "w2", lease_ms=LEASE)
    assert [m.id for m in held] == [other]
    acked, claimed = store.ack_and_claim([held[0].fence], ["q"], "w2", lease_ms=LEASE, limit=5)
    assert acked == {other} and claimed == []
    acked, claimed = store.ack_and_claim([head.fence], ["q"], "w", lease_ms=LEASE, limit=5)
    assert acked == {a1}
    if not claimed:
        claimed = store.claim(["q"], "w", lease_ms=LEASE, limit=5)
    assert [m.id for m in claimed] == [a2]


def test_ack_and_claim_is_one_commit_and_sqlite_claims_past_its_own_ack(
    store: Store, clock: FakeClock
) -> None:
    """One statement on PostgreSQL (its claim reads the snapshot before the ack), one
    transaction on SQLite, whose claim sees the ack free the run's next message."""
    from sqlalchemy import event

    a1 = store.enqueue("q", "a1", run_id="A")
    a2 = store.enqueue("q", "a2", run_id="A")
    [head] = store.claim(["q"], "w", lease_ms=LEASE)
    commits: list[int] = []
    listener = lambda conn: commits.append(1)  # noqa: E731
    event.listen(store.engine, "commit", listener)
    # SQLite's per-task transactions bypass SQLAlchemy's events.
    fast = getattr(store.driver, "direct", None)
    if fast is not None:
        begin = fast.begin
        fast.begin = lambda: commits.append(1) or begin()  # type: ignore[method-assign]
    try:
        acked, claimed = store.ack_and_claim([head.fence], ["q"], "w", lease_ms=LEASE, limit=5)
    finally:
        event.remove(store.engine, "commit", listener)
        if fast is not None:
            del fast.begin
    assert acked == {head.id} and head.id == a1
    if store.is_postgresql:
        assert commits == []  # autocommit, on the lease statements' own engine
        assert claimed == []
        claimed = store.claim(["q"], "w", lease_ms=LEASE, limit=5)
    else:
        assert commits == [1]
    assert [m.id for m in claimed] == [a2]


def test_ack_and_claim_marks_exhausted_messages_and_delivers_past_them(
    store: Store, clock: FakeClock
) -> None:
    poison = store.enqueue("q", "poison", max_attempts=1, priority=9, task_id="poison")
    good = store.enqueue("q", "good")
    extra = store.enqueue("q", "extra", priority=5)
    [p] = store.claim(["q"], "w", lease_ms=LEASE)
    assert p.id == poison
    [e] = store.claim(["q"], "w", lease_ms=LEASE)
    assert e.id == extra
    clock.advance(LEASE - 1)
    renewed = store.renew([e.fence], lease_ms=LEASE)
    assert set(renewed) == {extra}
    clock.advance(1)  # the poison's lease has expired, the other's is held
    dead: list[int] = []
    acked, claimed = store.ack_and_claim(
        [e.fence],
        ["q"],
        "w",
        lease_ms=LEASE,
        limit=1,
        on_exhausted=lambda ms: dead.extend(m.id for m in ms),
    )
    assert acked == {extra} and [m.id for m in claimed] == [good] and dead == [poison]
    assert kinds(store, "poison")[-1] == "attempts_exhausted"


def test_ack_and_claim_with_fences_of_another_owner(store: Store) -> None:
    """Fences of another owner are checked as ack() checks them (here: refused)."""
    mid = store.enqueue("q", "p")
    [m] = store.claim(["q"], "w1", lease_ms=LEASE)
    store.enqueue("q", "next")
    acked, claimed = store.ack_and_claim([m.fence], ["q"], "w2", lease_ms=LEASE, limit=1)
    assert acked == {mid}  # the fence is w1's own, valid
    assert [c.lease_owner for c in claimed] == ["w2"]
    wrong = Fence(claimed[0].id, "w1", claimed[0].attempt)
    acked, _ = store.ack_and_claim([wrong], ["q"], "w2", lease_ms=LEASE, limit=1)
    assert acked == set()


def test_ids_are_never_reused(store: Store) -> None:
    first = store.enqueue("q", "p")
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    store.ack([msg.fence])
    assert store.enqueue("q", "p") > first


# ---- invariant 3: renewal ------------------------------------------------------------------


def test_renew_is_based_on_now_and_never_shortens(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "p")
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    clock.advance(1_000)
    held = store.renew([msg.fence], lease_ms=LEASE)
    assert held == {msg.id: clock() + LEASE}
    # A shorter renewal keeps the later expiry.
    assert store.renew([msg.fence], lease_ms=10) == {msg.id: clock() + LEASE}
    # Renewing does not stack on the old expiry.
    assert store.renew([msg.fence], lease_ms=LEASE) == {msg.id: clock() + LEASE}


def test_expired_lease_cannot_be_renewed(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "p")
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    clock.advance(LEASE)
    assert store.renew([msg.fence], lease_ms=LEASE) == {}


def test_renew_many_in_one_call(store: Store, clock: FakeClock) -> None:
    for i in range(5):
        store.enqueue("q", f"p{i}", run_id=f"r{i % 2}" if i < 2 else None)
    msgs = store.claim(["q"], "w", lease_ms=LEASE, limit=5)
    clock.advance(LEASE // 2)
    held = store.renew([m.fence for m in msgs], lease_ms=LEASE)
    assert held == {m.id: clock() + LEASE for m in msgs}
    # The run locks were renewed too: nothing of those runs is claimable before the new expiry.
    clock.advance(LEASE - 1)
    assert store.claim(["q"], "x", lease_ms=LEASE, limit=5) == []


def test_renewed_lease_is_not_taken_over(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "p")
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    for _ in range(5):
        clock.advance(LEASE // 2)
        assert msg.id in store.renew([msg.fence], lease_ms=LEASE)
        assert store.claim(["q"], "thief", lease_ms=LEASE) == []


# ---- invariant 5: DB-arbitrated writes -----------------------------------------------------


def test_compare_and_set_outcomes(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "p", task_id="t")
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    first = store.compare_and_set(msg.fence, "t", 0, checkpoint={"page": 1})
    assert first.outcome is Outcome.UPDATED and first.revision == 1
    conflict = store.compare_and_set(msg.fence, "t", 0, checkpoint={"page": 99})
    assert conflict.outcome is Outcome.REVISION_CONFLICT
    second = store.compare_and_set(msg.fence, "t", 1, checkpoint={"page": 2}, state="running")
    assert second.outcome is Outcome.UPDATED and second.revision == 2
    record = store.get_task("t")
    assert record is not None
    assert (record.checkpoint, record.revision, record.state) == ({"page": 2}, 2, "running")
    clock.advance(LEASE)
    lost = store.compare_and_set(msg.fence, "t", 2, checkpoint={"page": 3})
    assert lost.outcome is Outcome.LEASE_LOST
    after = store.get_task("t")
    assert after is not None and after.checkpoint == {"page": 2}


def test_compare_and_set_renews_the_lease(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "p", task_id="t")
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    clock.advance(LEASE - 1)
    result = store.compare_and_set(msg.fence, "t", 0, checkpoint={"a": 1}, lease_ms=LEASE)
    assert result.lease_expires_at_ms == clock() + LEASE
    clock.advance(LEASE - 1)
    assert store.claim(["q"], "thief", lease_ms=LEASE) == []


def test_checkpoint_survives_takeover(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "p", task_id="t")
    [first] = store.claim(["q"], "w1", lease_ms=LEASE)
    store.compare_and_set(first.fence, "t", 0, checkpoint={"page": 4})
    clock.advance(LEASE)  # w1 dies
    [second] = store.claim(["q"], "w2", lease_ms=LEASE)
    assert second.attempt == 2
    record = store.get_task("t")
    assert record is not None and record.checkpoint == {"page": 4}


# ---- invariant 6: max attempts ---------------------------------------------------------------


def test_the_claim_that_would_exceed_max_attempts_marks_it_dead(
    store: Store, clock: FakeClock
) -> None:
    mid = store.enqueue("q", "poison", task_id="t")
    for attempt in (1, 2, 3):
        [msg] = store.claim(["q"], "w", lease_ms=LEASE)
        assert msg.attempt == attempt
        clock.advance(LEASE)  # the worker died each time
    assert store.claim(["q"], "w", lease_ms=LEASE) == []
    dead = store.get_message(mid)
    assert dead is not None
    assert (dead.state, dead.reason, dead.attempt) == ("dead", "attempts_exhausted", 3)
    assert kinds(store, "t").count("claimed") == 3
    assert kinds(store, "t")[-1] == "attempts_exhausted"
    assert store.size("q") == 0
    # Requeue: a fresh budget, history kept, the attempt number keeps growing (it fences).
    assert store.requeue(mid) is True
    [again] = store.claim(["q"], "w", lease_ms=LEASE)
    assert again.attempt == 4
    assert "requeued" in kinds(store, "t")
    assert store.requeue(mid) is False  # only parked or dead messages


def test_exhausted_message_does_not_block_others(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "poison", max_attempts=1, priority=9)
    store.enqueue("q", "good")
    [p] = store.claim(["q"], "w", lease_ms=LEASE)
    assert p.payload == "poison"
    clock.advance(LEASE)
    [g] = store.claim(["q"], "w", lease_ms=LEASE)
    assert g.payload == "good"


def test_exhausted_head_lets_its_run_move_on(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "a1", run_id="A", max_attempts=1)
    store.enqueue("q", "a2", run_id="A")
    store.claim(["q"], "w", lease_ms=LEASE)
    clock.advance(LEASE)
    [nxt] = store.claim(["q"], "w", lease_ms=LEASE)
    assert nxt.payload == "a2"


def test_refunded_release_does_not_spend_the_budget(store: Store) -> None:
    mid = store.enqueue("q", "p", max_attempts=2)
    for _ in range(5):  # e.g. five warm shutdowns before the task ever started
        [msg] = store.claim(["q"], "w", lease_ms=LEASE)
        assert store.release([msg.fence], refund=True) == {mid}
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    assert msg.attempt == 6


def test_release_with_delay_and_error(store: Store, clock: FakeClock) -> None:
    mid = store.enqueue("q", "p", task_id="t")
    [msg] = store.claim(["q"], "w", lease_ms=LEASE)
    assert store.release([msg.fence], delay_ms=2_000, error="Timeout") == {mid}
    assert store.claim(["q"], "w", lease_ms=LEASE) == []
    clock.advance(2_000)
    [again] = store.claim(["q"], "w", lease_ms=LEASE)
    assert again.attempt == 2
    stored = store.get_message(mid)
    assert stored is not None and stored.last_error == "Timeout"


def test_park_and_fail_keep_the_message(store: Store, clock: FakeClock) -> None:
    parked_id = store.enqueue("q", "p1", task_id="t1", run_id="R")
    store.enqueue("q", "p2", task_id="t2", run_id="R")
    failed_id = store.enqueue("q", "p3", task_id="t3")
    msgs = {m.task_id: m for m in store.claim(["q"], "w", lease_ms=LEASE, limit=5)}
    assert store.park(msgs["t1"].fence, "waiting_input", data={"prompt": "?"})
    assert store.fail(msgs["t3"].fence, "rejected", error="ValueError: bad")
    clock.advance(10 * LEASE)
    # Parked: nothing of its run runs meanwhile (order kept); failed: not delivered again.
    assert store.claim(["q"], "w", lease_ms=LEASE, limit=5) == []
    parked = store.get_message(parked_id)
    failed = store.get_message(failed_id)
    assert parked is not None and (parked.state, parked.reason) == ("parked", "waiting_input")
    assert failed is not None and (failed.state, failed.reason) == ("dead", "rejected")
    assert failed.last_error == "ValueError: bad"
    assert kinds(store, "t1")[-1] == "waiting_input"
    assert kinds(store, "t3")[-1] == "failed"
    assert store.requeue(parked_id)
    [resumed] = store.claim(["q"], "w", lease_ms=LEASE)
    assert resumed.id == parked_id


# ---- invariant 11: timeline -------------------------------------------------------------------


def test_every_state_change_writes_an_event(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "p", task_id="t")
    [m1] = store.claim(["q"], "w1", lease_ms=LEASE)
    store.compare_and_set(m1.fence, "t", 0, checkpoint={"n": 1})
    store.append_event(m1.fence, "note", {"hello": "world"}, task_id="t")
    store.release([m1.fence])
    [m2] = store.claim(["q"], "w2", lease_ms=LEASE)
    store.ack([m2.fence])
    events = store.events(task_id="t")
    assert [e.kind for e in events] == [
        "enqueued",
        "claimed",
        "checkpoint",
        "note",
        "released",
        "claimed",
        "acked",
    ]
    assert [e.attempt for e in events] == [0, 1, 1, 1, 1, 2, 2]
    assert events[1].data["owner"] == "w1"
    assert set(events[1].data) <= {"owner", "claim"}  # PostgreSQL marks its claims
    assert events[3].data == {"hello": "world"}
    assert all(e.at_ms == clock() for e in events)
    assert [e.id for e in events] == sorted(e.id for e in events)


def test_each_message_of_a_batch_has_its_own_claimed_and_acked_events(
    store: Store, clock: FakeClock
) -> None:
    """One claim and one ack of several messages: every task's timeline shows its own
    delivery (its message, attempt and owner), whether the database wrote a row per message
    (SQLite) or one row per statement (PostgreSQL); an exhausted message in the same claim
    keeps its own event."""
    from sqlalchemy import func, select

    ids = [store.enqueue("q", f"p{i}", task_id=f"t{i}") for i in range(5)]
    spent = store.enqueue("q", "spent", task_id="spent", max_attempts=1)
    [first] = store.claim(["q"], "w0", lease_ms=LEASE, limit=1)  # t0, delivery 1
    store.release([first.fence])
    [spent_msg] = [m for m in store.claim(["q"], "w0", lease_ms=LEASE, limit=6) if m.id == spent]
    clock.advance(LEASE)  # every lease expires: the next claim takes all, spent is exhausted
    exhausted: list[int] = []
    batch = store.claim(
        ["q"],
        "w1",
        lease_ms=LEASE,
        limit=10,
        on_exhausted=lambda ms: exhausted.extend(m.id for m in ms),
    )
    assert exhausted == [spent]
    assert sorted(m.id for m in batch) == ids
    assert store.ack([m.fence for m in batch]) == set(ids)
    for i, mid in enumerate(ids):
        events = [
            (e.kind, e.message_id, e.attempt, e.task_id) for e in store.events(task_id=f"t{i}")
        ]
        attempt = 3 if i == 0 else 2
        assert events[-2:] == [("claimed", mid, attempt, f"t{i}"), ("acked", mid, attempt, f"t{i}")]
        claimed = store.events(task_id=f"t{i}")[-2]
        assert claimed.data["owner"] == "w1" and claimed.at_ms == clock()
        by_message = [(e.kind, e.attempt) for e in store.events(message_id=mid)][-2:]
        assert by_message == [("claimed", attempt), ("acked", attempt)]
    assert kinds(store, "spent")[-1] == "attempts_exhausted"
    assert spent_msg.attempt == 1
    events = store.tables.events
    with store.driver.reading() as conn:
        rows = conn.execute(
            select(func.count()).where(events.c.kind.in_(["claimed", "acked"]))
        ).scalar()
    # Three claims (t0; all six; the five) and one ack: a row per message on SQLite, a row
    # per statement on PostgreSQL.
    assert rows == (1 + 6 + 5 + 5 if not store.is_postgresql else 4)


def test_refused_writes_leave_no_event(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "p", task_id="t")
    [m1] = store.claim(["q"], "w1", lease_ms=LEASE)
    clock.advance(LEASE)
    before = kinds(store, "t")
    store.ack([m1.fence])
    store.release([m1.fence])
    store.append_event(m1.fence, "note", task_id="t")
    store.compare_and_set(m1.fence, "t", 0, checkpoint={"n": 1})
    assert kinds(store, "t") == before


# ---- queues, purge, no-ack, bindings ---------------------------------------------------------


def test_size_and_purge_count_ready_messages_only(store: Store, clock: FakeClock) -> None:
    for i in range(3):
        store.enqueue("q", f"p{i}")
    store.enqueue("q", "later", delay_ms=60_000)
    [leased] = store.claim(["q"], "w", lease_ms=LEASE)
    assert store.size("q") == 2
    assert store.purge("q") == 2  # the ready ones; the scheduled and the leased one stay
    assert store.size("q") == 0
    assert store.ack([leased.fence]) == {leased.id}
    clock.advance(60_000)
    assert store.size("q") == 1  # the scheduled one, now due


def test_take_deletes_on_fetch(store: Store) -> None:
    store.enqueue("pidbox", "ping", record=False)
    store.enqueue("pidbox", "ping2", record=False)
    got = store.take(["pidbox"], limit=1)
    assert [m.payload for m in got] == ["ping"]
    assert [m.payload for m in store.take(["pidbox"], limit=5)] == ["ping2"]
    assert store.take(["pidbox"]) == []


def test_take_over_several_queues_takes_the_best_of_all_in_order(store: Store) -> None:
    events = [store.enqueue("ev", f"e{i}", record=False) for i in range(4)]
    ping = store.enqueue("pidbox", "ping", priority=5, record=False)
    store.enqueue("other", "not asked", record=False)
    got = store.take(["ev", "pidbox", "ev"], limit=3)
    assert [m.id for m in got] == [ping, events[0], events[1]]
    assert [m.id for m in store.take(["pidbox", "ev"], limit=10)] == events[2:]
    assert store.take(["pidbox", "ev"], limit=10) == []
    assert store.size("other") == 1


def test_bindings_are_persisted_per_exchange(make_store: Callable[..., Store]) -> None:
    a = make_store()
    b = make_store()  # another process's view of the same tables
    a.bind("celery.pidbox", "w1.celery.pidbox", "", "")
    a.bind("topic_x", "q1", "a.*", "a.*")
    a.bind("topic_x", "q1", "a.*", "a.*")  # idempotent
    assert b.bindings("celery.pidbox") == [("", "", "w1.celery.pidbox")]
    assert b.bindings("topic_x") == [("a.*", "a.*", "q1")]
    b.unbind("topic_x", "q1", "a.*", "a.*")
    assert a.bindings("topic_x") == []
    a.declare_queue("q1")
    assert b.has_queue("q1") and not b.has_queue("nope")
    a.bind("ex", "q1", "k")
    a.enqueue("q1", "x")
    b.delete_queue("q1")
    assert not a.has_queue("q1") and a.bindings("ex") == [] and a.size("q1") == 0


# ---- bad input ----------------------------------------------------------------------------


def test_payload_over_the_limit_is_refused_and_nothing_is_written(
    make_store: Callable[..., Store],
) -> None:
    store = make_store(max_payload_bytes=100)
    with pytest.raises(PayloadTooLarge, match="max_payload_bytes=100"):
        store.enqueue_many([NewMessage("q", "ok"), NewMessage("q", "x" * 101)])
    assert store.size("q") == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"queue": ""}, "queue name"),
        ({"priority": "high"}, "priority"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_bad_enqueue_arguments_are_named(
    store: Store, kwargs: dict[str, object], match: str
) -> None:
    args: dict[str, object] = {"queue": "q", "payload": "p"}
    args.update(kwargs)
    with pytest.raises(ConfigurationError, match=match):
        store.enqueue(**args)  # type: ignore[arg-type]


def test_odd_names_are_just_data(store: Store) -> None:
    names = ["q'; DROP TABLE x; --", "ünïcödé ☃", 'quo"te', "a\\b"]
    for name in names:
        store.enqueue(name, name, run_id=name, task_id=name)
    for name in names:
        [msg] = store.claim([name], "w", lease_ms=LEASE)
        assert (msg.queue, msg.payload, msg.run_id, msg.task_id) == (name, name, name, name)
        assert store.ack([msg.fence]) == {msg.id}


def test_transactional_enqueue_joins_the_callers_transaction(store: Store) -> None:
    with store.engine.connect() as conn:
        trans = conn.begin()
        store.enqueue("q", "rolled back", connection=conn)
        trans.rollback()
    assert store.size("q") == 0
    with store.engine.begin() as conn:
        store.enqueue("q", "committed", connection=conn)
    assert store.size("q") == 1


def test_an_exchanges_type_is_kept_until_it_is_deleted_with_its_bindings(store: Store) -> None:
    assert store.exchange_type("orders") is None
    store.declare_exchange("orders", "topic")
    store.declare_exchange("orders", "topic")  # again: unchanged
    store.bind("orders", "eu", "orders.eu.*", r"^orders\.eu\.[^.]+$")
    store.bind("other", "eu", "x", "")
    assert store.exchange_type("orders") == "topic"
    store.declare_exchange("orders", "fanout")  # the latest declaration stands
    assert store.exchange_type("orders") == "fanout"
    store.delete_exchange("orders")
    assert store.exchange_type("orders") is None
    assert store.bindings("orders") == []
    assert store.bindings("other") == [("x", "", "eu")]  # another exchange's are kept
