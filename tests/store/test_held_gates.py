"""Messages at a full concurrency gate are parked by a worker's sweep, outside the claim
index, and every way a place of the gate frees makes the next ones ready, best first
(docs/explanation/held-work.md), on both databases."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update

from sqlease import Admin, NewMessage, Store
from sqlease._core.maintenance import run_pass
from sqlease._db.rows import held_ahead
from sqlease.testing import FakeClock

LEASE = 10_000
AT_GATE = ("parked", "gate")


def keyed(store: Store, n: int, *, key: str = "k", limit: int = 2, priority: int = 0) -> list[int]:
    return store.enqueue_many(
        [
            NewMessage(
                "q",
                f"{key}{i}",
                task_id=f"{key}{priority}-{i}",
                priority=priority,
                concurrency_key=key,
                concurrency_limit=limit,
            )
            for i in range(n)
        ]
    )


def rows(store: Store) -> dict[int, tuple[str, str | None]]:
    m = store.tables.messages
    with store.driver.reading() as conn:
        found = conn.execute(select(m.c.id, m.c.state, m.c.reason).order_by(m.c.id)).all()
    return {r.id: (r.state, r.reason) for r in found}


def parked(store: Store) -> list[int]:
    return [i for i, sr in rows(store).items() if sr == AT_GATE]


def claim(store: Store, limit: int = 50) -> list[int]:
    return [m.id for m in store.claim(["q"], "w", lease_ms=LEASE, limit=limit)]


def test_a_sweep_parks_the_messages_of_a_full_gate_and_an_ack_makes_the_next_ready(
    store: Store,
) -> None:
    ids = keyed(store, 6)
    plain = store.enqueue("q", "plain", task_id="plain")
    assert store.park_held(["q"]) == []  # nothing runs yet: the gate has room
    first = store.claim(["q"], "w", lease_ms=LEASE, limit=10)
    assert [m.id for m in first] == [*ids[:2], plain]
    assert sorted(store.park_held(["q"])) == ids[2:]
    assert parked(store) == ids[2:]
    assert claim(store) == []  # nothing parked is claimable, and nothing else waits
    assert store.park_held(["q"]) == []  # a second sweep finds nothing more
    # An ack frees one place: the first parked message, and only it, is ready again.
    assert store.ack([first[0].fence]) == {first[0].id}
    assert parked(store) == ids[3:]
    assert claim(store) == [ids[2]]


def test_promotion_takes_the_best_first_priority_then_order(store: Store) -> None:
    low = keyed(store, 3, limit=1)
    [running] = store.claim(["q"], "w", lease_ms=LEASE, limit=1)
    assert running.id == low[0]
    high = keyed(store, 2, limit=1, priority=5)
    assert sorted(store.park_held(["q"])) == sorted([*low[1:], *high])
    store.ack([running.fence])
    assert claim(store) == [high[0]]
    assert parked(store) == sorted([*low[1:], high[1]])


def test_a_failure_and_a_release_free_their_place(store: Store) -> None:
    ids = keyed(store, 4, limit=1)
    [head] = store.claim(["q"], "w", lease_ms=LEASE, limit=5)
    store.park_held(["q"])
    assert parked(store) == ids[1:]
    assert store.fail(head.fence, "boom")
    assert parked(store) == ids[2:]
    [second] = store.claim(["q"], "w", lease_ms=LEASE)
    assert second.id == ids[1]
    assert store.release([second.fence], delay_ms=60_000)  # a retry later: the place frees
    assert parked(store) == ids[3:]
    assert claim(store) == [ids[2]]


def test_a_message_exhausted_at_its_claim_frees_its_place(store: Store, clock: FakeClock) -> None:
    ids = store.enqueue_many(
        [
            NewMessage(
                "q",
                f"e{i}",
                task_id=f"e{i}",
                concurrency_key="k",
                concurrency_limit=1,
                max_attempts=1,
            )
            for i in range(3)
        ]
    )
    [head] = store.claim(["q"], "w", lease_ms=LEASE, limit=5)
    store.park_held(["q"])
    assert parked(store) == ids[1:]
    clock.advance(LEASE + 1)  # its worker died: the lease ran out with its one attempt
    # The claim that finds it exhausted marks it dead; its place goes to the next at once.
    assert claim(store) == [ids[1]]
    assert rows(store)[head.id] == ("dead", "attempts_exhausted")
    assert parked(store) == ids[2:]
    # The transport's pipeline claims by op and promotes off its loop, as here.
    clock.advance(LEASE + 1)
    found = store.driver.execute(store.claim_op(["q"], "w", LEASE, 5, None))
    if held_ahead(found):  # PostgreSQL's plain claim stopped in front of it: the full one
        found = store.driver.execute(store.claim_op(["q"], "w", LEASE, 5, None))
    assert [(m.id, m.state) for m in found] == [(ids[1], "dead")]
    assert parked(store) == ids[2:]
    assert store.promote_gates_of([m.id for m in found]) == [ids[2]]
    assert claim(store) == [ids[2]]
    assert store.promote_gates_of([]) == []


def test_a_limit_raised_or_removed_promotes_at_once(store: Store) -> None:
    store.set_limits({"task:t": 1})
    ids = store.enqueue_many(
        [NewMessage("q", f"t{i}", task_id=f"t{i}", task_name="t") for i in range(6)]
    )
    [running] = store.claim(["q"], "w", lease_ms=LEASE, limit=10)
    assert running.id == ids[0]
    assert sorted(store.park_held(["q"])) == ids[1:]
    store.set_limits({"task:t": 3})
    assert parked(store) == ids[3:]
    # (PostgreSQL lets the new limit in once the places taken under the old one are free.)
    store.ack([running.fence])
    assert parked(store) == ids[4:]
    assert claim(store) == ids[1:4]
    store.remove_limit("task:t")
    assert parked(store) == []
    assert claim(store) == ids[4:]


def test_cancel_and_pause_of_gated_messages(store: Store) -> None:
    ids = keyed(store, 4, limit=1)
    admin = Admin("unused", store=store)
    assert claim(store) == ids[:1]
    store.park_held(["q"])
    # A paused parked message is paused; resumed, it is ready (a sweep parks it again).
    admin.pause(f"k0-{1}")
    assert rows(store)[ids[1]] == ("parked", "paused")
    admin.resume(f"k0-{1}")
    assert rows(store)[ids[1]][0] == "ready"
    # Cancelling the running one frees its place: the best waiting one is ready.
    admin.cancel("k0-0")
    assert claim(store) == [ids[1]]
    assert parked(store) == ids[2:]


def test_admin_and_stats_show_parked_messages_as_queued_with_their_reason(store: Store) -> None:
    keyed(store, 5, limit=2)
    claim(store)
    store.park_held(["q"])
    admin = Admin("unused", store=store)
    stats = admin.stats()["q"]
    assert stats["queued"] == 3 and stats["held_by_gate"] == 3 and stats["paused"] == 0
    assert stats["running"] == 2
    queued = admin.tasks(state="queued")
    assert len(queued) == 3 and {t.state for t in queued} == {"queued"}
    assert store.size("q") == 3  # a broker's ready count: the parked ones are queued


def test_the_maintenance_pass_promotes_a_gate_that_has_room(store: Store) -> None:
    ids = keyed(store, 3, limit=2)
    m = store.tables.messages
    # A promotion lost (a worker died between an ack and its promotion): parked, room free.
    with store.driver.writing() as conn:
        conn.execute(
            update(m).where(m.c.id.in_(ids)).values(state="parked", reason="gate", gate="key:k")
        )
    summary = run_pass(store, event_retention_ms=60_000)
    assert summary["gates_promoted"] == 2
    assert parked(store) == ids[2:]
    assert run_pass(store, event_retention_ms=60_000)["gates_promoted"] == 0


def test_a_sweep_looks_only_at_the_front_and_leaves_gates_with_room(store: Store) -> None:
    full = keyed(store, 3, key="a", limit=1)
    roomy = keyed(store, 2, key="b", limit=5)
    assert claim(store, limit=1) == full[:1]
    assert sorted(store.park_held(["q"], scan=2)) == full[1:]
    assert store.park_held(["q"], scan=2) == []
    assert [rows(store)[i] for i in roomy] == [("ready", None)] * 2
    assert claim(store) == roomy


def due(store: Store) -> dict[int, tuple[int, str | None]]:
    m = store.tables.messages
    with store.driver.reading() as conn:
        found = conn.execute(select(m.c.id, m.c.available_at_ms, m.c.reason)).all()
    return {r.id: (r.available_at_ms, r.reason) for r in found}


def test_a_sweep_gives_rate_held_messages_their_turn_as_due_time(store: Store) -> None:
    store.set_rate_limits({"queue:q": "1/s"})
    ids = store.enqueue_many([NewMessage("q", f"r{i}", task_id=f"r{i}") for i in range(6)])
    now = store.now_ms()
    assert claim(store) == ids[:1]  # the one the rate lets through now
    timed = store.park_held(["q"])
    # The next two turns (1 s and 2 s away) are within the horizon: they stay due; the rest
    # get their turns, one interval apart, in order.
    assert timed == ids[3:]
    assert [due(store)[i] for i in ids[3:]] == [
        (now + 3000, "rate"),
        (now + 4000, "rate"),
        (now + 5000, "rate"),
    ]
    assert store.park_held(["q"]) == []
    # A message published now queues behind the last turn given, not before it.
    [late] = store.enqueue_many([NewMessage("q", "late", task_id="late")])
    assert store.park_held(["q"]) == [late]
    assert due(store)[late] == (now + 6000, "rate")
    admin = Admin("unused", store=store)
    stats = admin.stats()["q"]
    assert stats["held_by_rate"] == 4 and stats["queued"] == 6 and stats["scheduled"] == 0
    assert admin.task("r3").state == "queued"
    assert store.size("q") == 6  # timed by the rate, they are still queued
    # Each claims in its turn; a claim clears the reason.
    [m3] = store.claim(["q"], "w", lease_ms=LEASE, now=now + 3000) or [None]
    assert m3 is not None and m3.id == ids[1]  # the earlier, still due, go first
    # A rate changed at runtime makes them all due again, in their order.
    store.set_rate_limits({"queue:q": "100/s"})
    assert [due(store)[i][1] for i in [*ids[3:], late]] == [None] * 4
    assert claim(store) == [ids[2]]  # a changed rate starts afresh: one now


def test_a_rate_removed_makes_its_timed_messages_due_on_the_stores_clock(store: Store) -> None:
    # The store's clock here is a fake one, far from the database's: the release must use
    # the clock the sweep gave the turns by (the store model found the mismatch).
    store.set_rate_limits({"queue:q": "1/s"})
    ids = store.enqueue_many([NewMessage("q", f"r{i}", task_id=f"r{i}") for i in range(5)])
    assert claim(store) == ids[:1]
    assert store.park_held(["q"]) == ids[3:]
    assert store.remove_limit("queue:q")
    assert [due(store)[i] for i in ids[3:]] == [(store.now_ms(), None)] * 2
    assert claim(store) == ids[1:]


def test_the_claim_stays_the_final_word_for_rates(store: Store) -> None:
    store.set_rate_limits({"queue:q": "1/m"})
    ids = store.enqueue_many([NewMessage("q", f"r{i}", task_id=f"r{i}") for i in range(3)])
    assert claim(store) == ids[:1]
    store.park_held(["q"])
    m = store.tables.messages
    with store.driver.writing() as conn:  # a wrong due time: due now
        conn.execute(update(m).where(m.c.id == ids[2]).values(available_at_ms=0))
    assert claim(store) == []  # the rate is closed: nothing goes


def test_one_hot_key_never_holds_back_the_cold_ones(store: Store) -> None:
    """Fairness: a hot tenant with a deep backlog at its limit, published first, and many
    cold tenants behind it. Every cold task runs within the first claims, the hot key never
    runs more than its limit, and its backlog waits parked (not read by the claims)."""
    hot = keyed(store, 300, key="hot", limit=2)
    cold = [i for n in range(40) for i in keyed(store, 2, key=f"cold{n}", limit=1)]
    m = store.tables.messages
    ran: list[int] = []
    running: dict[int, Any] = {}
    for step in range(200):
        got = store.claim(["q"], f"w{step % 3}", lease_ms=LEASE, limit=8)
        if step == 0:
            store.park_held(["q"])  # a worker's first sweep
        for msg in got:
            running[msg.id] = msg
            ran.append(msg.id)
        with store.driver.reading() as conn:
            live_hot = conn.execute(
                select(m.c.id).where(
                    m.c.id.in_(hot), m.c.lease_owner.isnot(None), m.c.state == "ready"
                )
            ).all()
        assert len(live_hot) <= 2
        if running:  # what ran finishes
            store.ack([running.pop(i).fence for i in sorted(running)])
        if set(cold) <= set(ran):
            break
    assert set(cold) <= set(ran), "a cold tenant's task never ran"
    # The cold tasks all ran while the hot key had run only a few of its 300.
    hot_ran = [i for i in ran if i in set(hot)]
    assert len(hot_ran) < 60, len(hot_ran)
    assert len(parked(store)) > 200  # the hot backlog waits parked, out of the claims' way
