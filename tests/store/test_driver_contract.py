"""The driver contract, run against every dialect (as River's driver tests and huey's
StorageTests are): each operation of ``sqlease._db.driver.Driver``, called through the driver
itself, does what the lease core relies on, whatever the database.

Each test states one promise and checks it on a SQLite file and on PostgreSQL (the ``store``
fixture), through the op the driver returns and its ``execute`` (or ``run_on``).
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from sqlease._db.driver import Change, Claim, Driver, Lane, Offer, Op, ResultWrite
from sqlease._db.postgresql.lease_ops import FULL_SPELL, OutsideRuns
from sqlease._db.rows import held_ahead
from sqlease.errors import ConfigurationError
from sqlease.store import Fence, Message, NewMessage, Outcome, Store
from sqlease.testing import FakeClock

LEASE = 30_000


def _rows(store: Store, queue: str = "q") -> list[Any]:
    m = store.tables.messages
    with store.driver.reading() as conn:
        return list(conn.execute(select(m.c.id, m.c.payload).where(m.c.queue == queue)))


def _new(queue: str, payload: str, **extra: Any) -> dict[str, Any]:
    """A checked message row, as sqlease._core.messages hands it to ``message_publish``."""
    row = {
        "queue": queue,
        "payload": payload,
        "priority": 0,
        "delay_ms": 0,
        "run_id": None,
        "task_id": None,
        "max_attempts": 3,
        "record": True,
        "task_name": None,
        "gate_key": None,
        "gate_limit": None,
        "group_id": None,
        "unique_key": None,
        "unique_scope": None,
        "unique_for_ms": None,
    }
    row.update(extra)
    return row


def _claim(store: Store, queues: list[str], owner: str = "w", limit: int = 10) -> Any:
    """A claim on the store's (fake) clock, made again (as its callers do) while it stops in
    front of a message whose run, gate or rate it does not judge."""
    found: list[Any] = []
    while True:
        claim = Claim(queues, owner, LEASE, limit - len(found), store.now_ms())
        more = store.driver.execute(store.driver.message_claim(claim))
        found += more
        if not held_ahead(more) or len(found) >= limit:
            return found


# ---- running ops ------------------------------------------------------------------------


def test_an_op_says_what_it_is_built_from(store: Store) -> None:
    driver: Driver = store.driver
    assert driver.execute(Op.answer(42)) == 42
    for op in (
        driver.message_claim(Claim(["q"], "w", LEASE, 1, store.now_ms())),
        driver.message_ack([Fence(1, "w", 1)], store.now_ms()),
        driver.message_publish([_new("q", "a")], store.now_ms()),
    ):
        # Built without I/O; one statement an event loop can send, or a transaction.
        assert op.sendable == (op.statement is not None)
        assert op.sendable or op.body is not None
        # Where the driver can send without blocking, the per-task ops are one statement.
        if driver.nonblocking:
            assert op.sendable
    assert _rows(store) == []


def test_a_body_op_commits_its_transaction(store: Store) -> None:
    publish = store.driver.message_publish([_new("q", "one"), _new("q", "two")], store.now_ms())
    assert not publish.sendable  # two rows: one transaction
    ids = store.driver.execute(publish.then(lambda found: [i * 10 for i in found]))
    rows = _rows(store)
    assert [p for _, p in rows] == ["one", "two"]
    assert ids == [i * 10 for i, _ in rows]


def test_a_body_op_that_raises_writes_nothing(store: Store) -> None:
    inner = store.driver.message_publish([_new("q", "a"), _new("q", "b")], store.now_ms())

    def body(conn: Any) -> None:
        assert inner.body is not None
        inner.body(conn)
        raise RuntimeError("the caller's failure")

    with pytest.raises(RuntimeError, match="caller's failure"):
        store.driver.execute(Op(Lane.PUBLISH, body=body))
    assert _rows(store) == []


def test_run_on_joins_the_callers_transaction(store: Store) -> None:
    for handoff in (True, False):
        op = store.driver.message_publish([_new("q", "kept")], store.now_ms(), handoff=handoff)
        with store.driver.writing() as conn:
            [message_id] = store.driver.run_on(conn, op)
        assert message_id > 0
    with pytest.raises(RuntimeError), store.driver.writing() as conn:
        store.driver.run_on(conn, store.driver.message_publish([_new("q", "gone")], store.now_ms()))
        raise RuntimeError("rolled back")
    assert [p for _, p in _rows(store)] == ["kept", "kept"]


# ---- messages ---------------------------------------------------------------------------


def test_publish_writes_the_event_and_task_row(store: Store) -> None:
    op = store.driver.message_publish([_new("q", "a", task_id="t1", task_name="n")], store.now_ms())
    [message_id] = store.driver.execute(op)
    [event] = store.events(task_id="t1")
    assert (event.kind, event.message_id, event.attempt) == ("enqueued", message_id, 0)
    assert store.get_task("t1") is not None


def test_publish_admits_unique_rows_first(store: Store) -> None:
    seen: list[str] = []

    def admit(conn: Any, row: Any, now: int | None) -> int | None:
        seen.append(row["payload"])
        return 7 if row["payload"] == "dup" else None

    rows = [_new("q", "a"), _new("q", "dup", unique_key="k"), _new("q", "b", unique_key="j")]
    ids = store.driver.execute(store.driver.message_publish(rows, store.now_ms(), admit=admit))
    assert seen == ["dup", "b"]  # only rows with a key are admitted
    assert ids[1] == 7  # the duplicate's original stands in its place
    assert [p for _, p in _rows(store)] == ["a", "b"]


def test_take_deletes_what_it_returns(store: Store) -> None:
    for payload in ("a", "b", "c"):
        store.enqueue("q", payload)
    store.enqueue("other", "x")
    taken = store.driver.execute(store.driver.message_take(["q", "other"], 3, store.now_ms()))
    assert len(taken) == 3
    assert {m.payload for m in taken} <= {"a", "b", "c", "x"}
    assert len(_rows(store)) + len(_rows(store, "other")) == 1


def test_claim_leases_and_marks_exhausted_messages_dead(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "once", max_attempts=1)
    [first] = _claim(store, ["q"])
    assert (first.state, first.lease_owner, first.attempt) == ("ready", "w", 1)
    clock.advance(LEASE + 1)  # its lease runs out: the next claim finds its budget spent
    [again] = _claim(store, ["q"])
    assert (again.id, again.state, again.reason) == (first.id, "dead", "attempts_exhausted")
    assert _claim(store, ["q"]) == []


def test_ack_refuses_a_stale_fence_and_takes_several_owners(store: Store) -> None:
    for payload in ("a", "b", "c"):
        store.enqueue("q", payload)
    [a] = _claim(store, ["q"], "w1", 1)
    [b, c] = _claim(store, ["q"], "w2", 2)
    stale = Fence(c.id, "w2", c.attempt + 1)
    acked = store.driver.execute(
        store.driver.message_ack([a.fence, b.fence, stale], store.now_ms())
    )
    assert acked == {a.id, b.id}
    assert store.driver.execute(store.driver.message_ack([], store.now_ms())) == set()
    assert [p for _, p in _rows(store)] == ["c"]


def test_ack_claim_acks_and_claims_in_one_commit(store: Store) -> None:
    for payload in ("a", "b", "c"):
        store.enqueue("q", payload)
    [a] = _claim(store, ["q"], "w", 1)
    [b] = _claim(store, ["q"], "other", 1)
    driver = store.driver
    # The claimer's own fences, then another owner's with them: either way one op.
    acked, claimed = driver.execute(
        driver.message_ack_claim([a.fence], Claim(["q"], "w", LEASE, 1, store.now_ms()))
    )
    assert acked == {a.id} and [m.payload for m in claimed] == ["c"]
    [c] = claimed
    acked, claimed = driver.execute(
        driver.message_ack_claim([b.fence, c.fence], Claim(["q"], "w", LEASE, 5, store.now_ms()))
    )
    assert acked == {b.id, c.id} and claimed == []
    assert _rows(store) == []
    # Without fences it is the claim alone.
    store.enqueue("q", "d")
    acked, claimed = driver.execute(
        driver.message_ack_claim([], Claim(["q"], "w", LEASE, 5, store.now_ms()))
    )
    assert acked == set() and [m.payload for m in claimed] == ["d"]


def test_ack_claim_sees_a_runs_next_message_where_the_dialect_does(store: Store) -> None:
    store.enqueue("q", "first", run_id="r")
    store.enqueue("q", "second", run_id="r")
    [first] = _claim(store, ["q"])
    op = store.driver.message_ack_claim([first.fence], Claim(["q"], "w", LEASE, 5, store.now_ms()))
    acked, claimed = store.driver.execute(op)
    assert acked == {first.id}
    # SQLite's one transaction sees the ack free the run; PostgreSQL's one statement does
    # not (the next claim takes it): both are documented, neither loses the message.
    if not claimed:
        claimed = _claim(store, ["q"])
    assert [m.payload for m in claimed] == ["second"]


def test_a_claim_stops_in_front_of_what_it_does_not_judge_and_says_so(store: Store) -> None:
    """PostgreSQL claims plain messages (no run, key, limit or rate) with a statement whose
    plan holds none of those checks: it stops in front of the first message that has one
    and says so; the claims of those queues then judge everything for a while. SQLite's
    claim always judges everything. Either way nothing passes a held message."""
    ticks = [0.0]
    plans = getattr(store.driver, "plans", None)
    if plans is not None:
        plans._monotonic = lambda: ticks[0]
    store.enqueue("q", "a")
    store.enqueue("q", "r1", run_id="r")
    store.enqueue("q", "b")
    store.enqueue("q", "c")
    now = store.now_ms()
    first = store.driver.execute(store.driver.message_claim(Claim(["q"], "w", LEASE, 10, now)))
    if plans is None:
        assert [m.payload for m in first] == ["a", "r1", "b", "c"] and not held_ahead(first)
        return
    assert [m.payload for m in first] == ["a"] and held_ahead(first)
    assert not plans.plain(["q"]) and plans.plain(["other"])
    store.enqueue("q", "d")
    rest = store.driver.execute(store.driver.message_claim(Claim(["q"], "w", LEASE, 2, now)))
    assert [m.payload for m in rest] == ["r1", "b"] and not held_ahead(rest)
    # A spell later the plain statement is back; with nothing held in front it takes all.
    ticks[0] += FULL_SPELL
    assert plans.plain(["q"])
    acked, last = store.driver.execute(
        store.driver.message_ack_claim(
            [m.fence for m in rest], Claim(["q"], "w", LEASE, 10, store.now_ms())
        )
    )
    assert acked == {m.id for m in rest} and [m.payload for m in last] == ["c", "d"]
    assert not held_ahead(last)


def test_acks_that_go_with_a_plain_claim_make_their_runs_next_message_ready(
    store: Store,
) -> None:
    """The acks carried by a claim of plain messages are the full ack: a run's next message,
    parked behind the acked head, is ready when the statement commits (a crash before a
    second statement must not leave it parked)."""
    store.enqueue("q", "head", run_id="r")
    store.enqueue("q", "next", run_id="r")
    [head] = _claim(store, ["q"])
    plans = getattr(store.driver, "plans", None)
    if plans is not None:
        plans._full_until.clear()  # the plain statement, as a spell later
        assert plans.plain(["q"])
    acked, claimed = store.driver.execute(
        store.driver.message_ack_claim([head.fence], Claim(["q"], "w", LEASE, 5, store.now_ms()))
    )
    assert acked == {head.id} and not acked.owed_runs
    state = {m.payload: m.state for m in (store.get_message(r.id) for r in _rows(store)) if m}
    if claimed:  # SQLite's transaction sees the ack free the run
        assert [m.payload for m in claimed] == ["next"]
    else:
        assert state == {"next": "ready"}
        assert [m.payload for m in _claim(store, ["q"])] == ["next"]


def test_acks_outside_any_run_skip_the_runs_promotion_and_nothing_else(store: Store) -> None:
    """PostgreSQL acks deliveries its claims leased outside any run with a statement whose
    plan holds no run's promotion; an ack with one delivery of a run in it (or one it does
    not know: another attempt, another process's) takes the full ack, which makes the run's
    next message ready. What is acked, refused and promoted is the same on every dialect."""
    store.enqueue_many([NewMessage("q", "a"), NewMessage("q", "b")])
    store.enqueue("q", "head", run_id="r")
    store.enqueue("q", "next", run_id="r")
    a, b, head = _claim(store, ["q"])
    driver, sql = store.driver, store.sql
    pg = getattr(driver, "outside_runs", None) is not None
    lean = driver.message_ack([a.fence], store.now_ms())
    if pg:
        assert lean.statement is sql.ack_outside_runs
    assert driver.execute(lean) == {a.id}
    # Acked already: a second ack of it is refused, and is not known outside runs any more.
    again = driver.message_ack([a.fence], store.now_ms())
    if pg:
        assert again.statement is sql.ack
    assert driver.execute(again) == set()
    # Another attempt of b (a stale fence) is not known: the full ack, refused.
    stale = driver.message_ack([Fence(b.id, "w", b.attempt + 1)], store.now_ms())
    if pg:
        assert stale.statement is sql.ack
    assert driver.execute(stale) == set()
    # b (forgotten by the stale ack's look) with the run's head: the full ack; the run goes on.
    mixed = driver.message_ack([b.fence, head.fence], store.now_ms())
    if pg:
        assert mixed.statement is sql.ack
    acked = driver.execute(mixed)
    assert acked == {b.id, head.id} and not acked.owed_runs
    assert [m.payload for m in _claim(store, ["q"])] == ["next"]


def test_an_ack_outside_runs_with_a_claim_frees_the_gate_place_it_held(store: Store) -> None:
    """A delivery outside any run may hold a gate's place (a limit on its task): the ack
    that skips the runs' promotion still gives the place back and names the gate, and the
    gate's next message is claimed after it; with the full claim (held work in the queue)
    and with the plain one."""
    store.set_limits({"task:slow": 1})
    store.enqueue_many([NewMessage("q", f"s{i}", task_name="slow") for i in (1, 2, 3)])
    store.enqueue("q", "p")
    held = _claim(store, ["q"])
    assert [m.payload for m in held] == ["s1", "p"]
    plans = getattr(store.driver, "plans", None)
    for name in ("ack_outside_runs_claim_single", "ack_outside_runs_claim_plain_single"):
        if plans is not None and name.endswith("plain_single"):
            plans._full_until.clear()  # the plain claim's statement, as a spell later
        op = store.driver.message_ack_claim(
            [m.fence for m in held], Claim(["q"], "w", LEASE, 5, store.now_ms())
        )
        if plans is not None:
            assert op.statement is getattr(store.sql, name)
        acked, claimed = store.driver.execute(op)
        assert acked == {m.id for m in held}
        # PostgreSQL's one statement does not see the place freed: it names the gate, which
        # the caller promotes; SQLite's transaction sees it. Either way the next is claimed.
        store.promote_gates(acked.owed_gates)
        held = list(claimed) or _claim(store, ["q"])
        assert len(held) == 1 and held[0].payload in ("s2", "s3")
    assert held[0].payload == "s3"


def test_deliveries_that_leave_another_way_are_forgotten(store: Store) -> None:
    """PostgreSQL: a delivery acked with an offer, released, or acked beside another owner's
    is no longer kept as outside runs (what it keeps stays the deliveries still held)."""
    outside = getattr(store.driver, "outside_runs", None)
    if outside is None:
        pytest.skip("the acks outside runs are PostgreSQL's")
    driver = store.driver
    store.enqueue_many([NewMessage("q", p) for p in "abc"])
    a, b, c = _claim(store, ["q"])
    assert len(outside) == 3
    offer = Offer(["q"], [0], "w", LEASE, 12345, 10_000, store.now_ms())
    assert driver.execute(driver.offer_ack([a.fence], offer))[0] == {a.id}
    assert len(outside) == 2
    release = Change("ready", "released", refund=True)
    assert driver.execute(driver.message_transition([b.fence], release, store.now_ms())) == {b.id}
    assert len(outside) == 1
    other = Fence(c.id, "someone else", c.attempt)
    assert driver.execute(driver.message_ack([c.fence, other], store.now_ms())) == {c.id}
    assert len(outside) == 0


def test_the_ack_with_an_offer_outside_runs_skips_the_runs_promotion_only(store: Store) -> None:
    """PostgreSQL (offers are its own): the ack that leaves a worker idle, of deliveries
    outside any run, takes the statement without a run's promotion; of a run's delivery, the
    full one, which makes the run's next message ready."""
    if not store.driver.caps.offers:
        pytest.skip("handoff offers are PostgreSQL's")
    store.enqueue("q", "a")
    store.enqueue("q", "head", run_id="r")
    store.enqueue("q", "next", run_id="r")
    a, head = _claim(store, ["q"])
    driver = store.driver
    offer = Offer(["q"], [0], "w", LEASE, 12345, 10_000, store.now_ms())
    lean = driver.offer_ack([a.fence], offer)
    assert lean.statement is store.sql.ack_outside_runs_offer
    acked = driver.execute(lean)[0]
    assert acked == {a.id} and not acked.owed_runs
    full = driver.offer_ack([head.fence], offer)
    assert full.statement is store.sql.ack_offer
    acked = driver.execute(full)[0]
    assert acked == {head.id} and not acked.owed_runs
    assert [m.payload for m in _claim(store, ["q"])] == ["next"]


def test_outside_runs_forgets_what_it_cannot_keep() -> None:
    """The deliveries known outside runs are bounded: past the bound they are all forgotten
    (their acks take the full statement); released ones are forgotten at once."""

    def row(i: int, run_id: str | None = None, owner: str | None = "w") -> Message:
        return Message(i, "q", "", 0, 0, 0, run_id, None, "ready", None, owner, 1, 1, 3)

    known = OutsideRuns(kept=3)
    known.leased([row(1), row(2), row(3, run_id="r"), row(4, owner=None)])
    assert len(known) == 2  # not the run's, nor the dead (unleased) one
    assert known.all_outside([Fence(1, "w", 1)]) and len(known) == 1
    assert not known.all_outside([Fence(2, "w", 1), Fence(5, "w", 1)]) and len(known) == 0
    known.leased([row(6), row(7)])
    known.forget([Fence(6, "w", 1)])
    assert not known.all_outside([Fence(6, "w", 1)])
    known.leased([row(i) for i in range(10, 14)])
    assert len(known) == 0


def test_a_plain_claim_judges_limits_on_the_task_the_queue_and_the_key(store: Store) -> None:
    """A limit or a rate on a message's task or queue, or a concurrency key, makes it one
    the plain claim stops in front of; a limit removed makes it plain again."""
    store.set_limits({"task:slow": 1})
    store.set_rate_limits({"queue:rated": "1/m"})
    store.enqueue_many(
        [
            NewMessage("q", "s1", task_name="slow"),
            NewMessage("q", "s2", task_name="slow"),
            NewMessage("q", "k1", concurrency_key="k", concurrency_limit=1),
            NewMessage("q", "k2", concurrency_key="k", concurrency_limit=1),
            NewMessage("q", "p", task_name="fast"),
            NewMessage("rated", "x1"),
            NewMessage("rated", "x2"),
        ]
    )
    # One at a time of each gate's messages, the plain one behind them too; one per minute
    # of the rated queue's.
    assert [m.payload for m in _claim(store, ["q"])] == ["s1", "k1", "p"]
    assert [m.payload for m in _claim(store, ["rated"])] == ["x1"]
    store.set_limits({}, replace=True)
    plans = getattr(store.driver, "plans", None)
    if plans is not None:
        plans._full_until.clear()  # the spell of full claims over
    store.enqueue("q", "s3", task_name="slow")
    assert [m.payload for m in _claim(store, ["q"])] == ["s2", "s3"]
    assert [m.payload for m in _claim(store, ["rated"])] == []


def test_renew_extends_held_leases_only(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "a", run_id="r")
    store.enqueue("q", "b")
    a, b = _claim(store, ["q"])
    store.ack([b.fence])
    clock.advance(1000)
    op = store.driver.message_renew([a.fence, b.fence, Fence(a.id, "x", a.attempt)], LEASE, clock())
    assert store.driver.execute(op) == {a.id: clock() + LEASE}
    assert store.driver.execute(store.driver.message_renew([], LEASE, None)) == {}


def test_transition_releases_parks_and_fails_with_its_event(store: Store) -> None:
    for payload in ("a", "b", "c"):
        store.enqueue("q", payload, task_id=payload)
    a, b, c = _claim(store, ["q"])
    driver, also_ran = store.driver, []
    release = Change("ready", "released", refund=True)
    assert driver.execute(driver.message_transition([a.fence], release, store.now_ms())) == {a.id}
    park = Change("parked", "paused", reason="paused")
    op = driver.message_transition(
        [b.fence], park, store.now_ms(), also=lambda conn: also_ran.append(1)
    )
    assert driver.execute(op) == {b.id} and also_ran == [1]
    fail = Change("dead", "failed", reason="rejected", data='{"reason": "rejected"}')
    assert driver.execute(driver.message_transition([c.fence], fail, store.now_ms())) == {c.id}
    # A stale fence changes nothing, and ``also`` does not run.
    op = driver.message_transition(
        [c.fence], fail, store.now_ms(), also=lambda conn: also_ran.append(2)
    )
    assert driver.execute(op) == set() and also_ran == [1]
    states = {
        m.payload: (m.state, m.reason)
        for m in (store.get_message(i) for i in (a.id, b.id, c.id))
        if m
    }
    assert states == {"a": ("ready", None), "b": ("parked", "paused"), "c": ("dead", "rejected")}
    assert [e.kind for e in store.events(task_id="b")][-1] == "paused"


# ---- results ----------------------------------------------------------------------------


def _result(
    key: str, value: bytes, fence: Fence | None, now: int, *, keep: bool = False
) -> ResultWrite:
    row = {
        "key": key,
        "value": value,
        "state": "SUCCESS",
        "task_id": key,
        "message_id": None if fence is None else fence.message_id,
        "attempt": None if fence is None else fence.attempt,
        "expires_at_ms": None,
        "updated_at_ms": 1,
    }
    return ResultWrite(row, fence, keep, None, now, "unused")


def test_result_put_is_fenced_and_keeps_a_success(store: Store, clock: FakeClock) -> None:
    store.enqueue("q", "a", task_id="t")
    [m] = _claim(store, ["q"])
    driver = store.driver
    assert (
        driver.execute(driver.result_put(_result("t", b"1", m.fence, store.now_ms())))
        is Outcome.UPDATED
    )
    stale = Fence(m.id, m.lease_owner or "", m.attempt + 1)
    assert (
        driver.execute(driver.result_put(_result("t", b"2", stale, store.now_ms())))
        is Outcome.LEASE_LOST
    )
    kept = driver.execute(driver.result_put(_result("t", b"3", None, store.now_ms(), keep=True)))
    assert kept is Outcome.KEPT_SUCCESS
    assert (
        driver.execute(driver.result_put(_result("u", b"4", None, store.now_ms())))
        is Outcome.UPDATED
    )


# ---- offers -----------------------------------------------------------------------------


def test_offers_where_the_dialect_has_them(store: Store) -> None:
    driver = store.driver
    offer = Offer(["q"], [0], "w", LEASE, 12345, 10_000, store.now_ms())
    if not driver.caps.offers:
        with pytest.raises(ConfigurationError, match="PostgreSQL"):
            driver.offer_put(offer)
        assert driver.execute(driver.offer_withdraw("w")) is None
        return
    store.enqueue("q", "now")
    [m] = _claim(store, ["q"])
    store.enqueue("q", "later", delay_ms=5_000)
    acked, due, db_now = driver.execute(driver.offer_ack([m.fence], offer))
    # The database's time comes back with it (a handoff's lease clock counts from it).
    assert acked == {m.id} and due == 5_000 and db_now == offer.now
    assert driver.execute(driver.offer_put(offer)) == (5_000, offer.now)  # stands again
    assert driver.execute(driver.offer_withdraw("w", handed_too=True)) is None


# ---- what the drivers share -------------------------------------------------------------


def test_the_timeline_is_the_same_on_every_dialect(store: Store, clock: FakeClock) -> None:
    """PostgreSQL writes run locks and events inside its statements, SQLite beside them: the
    store reads back the same timeline."""
    store.enqueue("q", "a", task_id="t1", run_id="r1")
    store.enqueue("q", "b", task_id="t2", run_id="r1")
    [first] = store.claim(["q"], "w", lease_ms=LEASE, limit=5)
    assert first.task_id == "t1"  # its run's next message waits behind it
    assert store.claim(["q"], "w", lease_ms=LEASE, limit=5) == []
    assert store.renew([first.fence], lease_ms=LEASE) == {first.id: clock() + LEASE}
    assert store.ack([first.fence]) == {first.id}
    [second] = store.claim(["q"], "w", lease_ms=LEASE, limit=5)
    assert second.task_id == "t2"
    kinds = [(e.kind, e.attempt) for e in store.events(task_id="t1")]
    assert kinds == [("enqueued", 0), ("claimed", 1), ("acked", 1)]
    [claimed] = [e for e in store.events(task_id="t2") if e.kind == "claimed"]
    assert claimed.data["owner"] == "w"


def test_insert_upserts_on_every_dialect(store: Store) -> None:
    locks = store.tables.locks
    for owner in ("a", "b"):
        stmt = store.driver.insert(locks).values(name="x", owner=owner, expires_at_ms=1)
        upsert = stmt.on_conflict_do_update(
            index_elements=[locks.c.name], set_={"owner": stmt.excluded.owner}
        )
        with store.driver.writing() as conn:
            conn.execute(upsert)
    with store.driver.reading() as conn:
        assert conn.execute(select(locks.c.owner).where(locks.c.name == "x")).scalar() == "b"


@pytest.mark.timeout(30)
def test_a_commit_wakes_the_driver_s_waker(store: Store) -> None:
    """After a write that notifies ``channel`` commits, a waker of that channel wakes
    (LISTEN/NOTIFY on PostgreSQL; the file's data_version on SQLite)."""
    channel = f"{store.tables.prefix}contract"
    waker = store.driver.waker(channel)
    try:
        waker.ready()  # connect (PostgreSQL: LISTEN) and take what is pending
        with store.driver.writing() as conn:
            store.driver.run_on(
                conn, store.driver.message_publish([_new("q", "wake")], store.now_ms())
            )
            store.driver.notify(conn, channel, "hello")
        assert waker.wait(10.0)
    finally:
        waker.close()


def test_a_fork_section_is_a_context_manager(store: Store) -> None:
    with store.driver.fork_section():
        store.enqueue("q", "inside")
    assert [p for _, p in _rows(store)] == ["inside"]


def test_every_operation_is_implemented_by_every_driver(store: Store) -> None:
    abstract = getattr(Driver, "__abstractmethods__", frozenset())
    assert {"message_claim", "message_ack", "message_publish", "result_put"} <= abstract
    assert not getattr(type(store.driver), "__abstractmethods__", frozenset())
