"""The local lease clock against a real database (SQLite and PostgreSQL), time injected: the
heartbeat counts each lease from the send time of its last confirmed renewal and publishes it;
a lease whose clock ran out is lost without a round trip (no renewal, its ack not sent); a
task's writes raise ``LeaseLost`` at once once its clock ran out (guarantees.md, invariant 14).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sqlease import LeaseLost, Store
from sqlease._core.clock_slots import ClockSlots, parse_ref, read
from sqlease._core.heartbeat import Heartbeat
from sqlease._core.lease_clock import LOST, DeliveryClock
from sqlease.task_context import TaskContext
from sqlease.testing import FakeClock
from sqlease.types import Message

LEASE_MS = 3_000
#: Far longer than a test: the heartbeat's own thread never beats during one.
QUIET = 3_600.0


@pytest.fixture
def monotonic(clock: FakeClock) -> Callable[[], float]:
    """The worker's monotonic clock, moving with the database's fake clock."""
    return lambda: clock() / 1000.0


@pytest.fixture
def beat(monotonic: Callable[[], float], tmp_path: Path) -> Iterator[Heartbeat]:
    slots = ClockSlots(folder=str(tmp_path))
    heartbeat = Heartbeat(monotonic=monotonic, slots=slots)
    yield heartbeat
    heartbeat.stop()
    slots.close()


def _claimed(store: Store, owner: str = "w1") -> Message:
    store.enqueue("q", "{}", task_id="t1")
    [message] = store.claim(["q"], owner, lease_ms=LEASE_MS)
    return message


def _published(beat: Heartbeat, message: Message) -> float:
    ref = beat.clock_ref(message.fence)
    assert ref is not None
    where = parse_ref(ref)
    assert where is not None
    return read(*where, message.fence)


def test_the_heartbeat_counts_from_the_send_time_of_each_confirmed_renewal(
    store: Store, beat: Heartbeat, clock: FakeClock, monotonic: Callable[[], float]
) -> None:
    message = _claimed(store)
    sent = monotonic()
    beat.hold(store, message.fence, lease_ms=LEASE_MS, interval=QUIET, sent_at=sent)
    assert beat.deadline_of(message.fence) == pytest.approx(sent + 2.72)
    assert _published(beat, message) == pytest.approx(sent + 2.72)
    clock.advance(1_000)
    beat.beat()
    assert beat.renewals == 1
    assert beat.deadline_of(message.fence) == pytest.approx(sent + 3.72)
    assert _published(beat, message) == pytest.approx(sent + 3.72)
    assert beat.holds(message.fence) and bool(beat.drop_all_for_ack([message.fence]))


def test_a_claims_batch_is_held_at_once_each_in_its_own_slot(
    store: Store, beat: Heartbeat, clock: FakeClock, monotonic: Callable[[], float]
) -> None:
    for n in range(3):
        store.enqueue("q", "{}", task_id=f"t{n}")
    sent = monotonic()
    messages = store.claim(["q"], "w1", lease_ms=LEASE_MS, limit=3)
    assert len(messages) == 3
    held = [(m.fence, m.task_id) for m in messages]
    # An empty claim holds nothing (and starts no heartbeat thread).
    assert beat.hold_all(store, [], lease_ms=LEASE_MS, interval=QUIET, sent_at=sent) == []
    assert beat._thread is None
    refs = beat.hold_all(store, held + held[:1], lease_ms=LEASE_MS, interval=QUIET, sent_at=sent)
    assert len(refs) == 4 and len(set(refs)) == 3 and refs[3] == refs[0]  # a repeat: its slot
    for message, ref in zip(messages, refs[:3], strict=True):
        assert beat.clock_ref(message.fence) == ref
        assert _published(beat, message) == pytest.approx(sent + 2.72)
    assert beat.alive_count() == 3
    # Held again (a later confirmation): the same slots, the new deadline.
    clock.advance(1_000)
    again = beat.hold_all(store, held[1:], lease_ms=LEASE_MS, interval=QUIET, sent_at=monotonic())
    assert again == refs[1:3]
    assert _published(beat, messages[1]) == pytest.approx(sent + 3.72)
    assert _published(beat, messages[0]) == pytest.approx(sent + 2.72)
    # Acked together: each leaves with its lease clock (an ack on its way still holds its
    # lease in the database, sqlease.transport._outage); one not held here, with none.
    stranger = messages[0].fence.__class__(10**9, "w1", 1)
    left = beat.drop_all_for_ack([m.fence for m in messages] + [stranger])
    assert [fence for fence, _ in left] == [m.fence for m in messages] + [stranger]
    assert [deadline for _, deadline in left] == [
        pytest.approx(sent + 2.72),
        pytest.approx(sent + 3.72),
        pytest.approx(sent + 3.72),
        None,
    ]
    assert beat.alive_count() == 0
    assert store.ack([m.fence for m in messages]) == {m.id for m in messages}


def test_a_lease_whose_clock_ran_out_is_lost_without_asking_the_database(
    store: Store, beat: Heartbeat, clock: FakeClock, monotonic: Callable[[], float]
) -> None:
    message = _claimed(store)
    beat.hold(
        store, message.fence, lease_ms=LEASE_MS, interval=QUIET, sent_at=monotonic(), task_id="t1"
    )
    clock.advance(2_921)  # no renewal got through: past the clock, before the database's lease
    beat.beat()
    assert beat.renewals == 0  # not renewed: lost for this worker
    assert beat.deadline_of(message.fence) == LOST and _published(beat, message) == LOST
    assert not beat.holds(message.fence)
    # The database still holds the lease (it ends at 3 s), yet the ack is not sent.
    assert store.is_held(message.fence)
    assert bool(beat.drop_all_for_ack([message.fence])) is False
    [lost] = [e for e in store.events(task_id="t1") if e.kind == "lease_lost"]
    assert lost.attempt == 1 and "clock ran out" in lost.data["why"]


def test_a_renewal_the_database_refuses_loses_the_lease_and_leaves_the_ack_to_it(
    store: Store, beat: Heartbeat, clock: FakeClock, monotonic: Callable[[], float]
) -> None:
    message = _claimed(store)
    beat.hold(store, message.fence, lease_ms=LEASE_MS, interval=QUIET, sent_at=monotonic())
    store.release([message.fence])  # e.g. paused or taken over meanwhile
    beat.beat()
    assert beat.deadline_of(message.fence) == LOST and _published(beat, message) == LOST
    assert bool(beat.drop_all_for_ack([message.fence])) is True  # the database refuses it itself


def test_a_renewal_confirmed_after_the_clock_ran_out_does_not_revive_it(
    store: Store,
    beat: Heartbeat,
    clock: FakeClock,
    monotonic: Callable[[], float],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    message = _claimed(store)
    beat.hold(store, message.fence, lease_ms=LEASE_MS, interval=QUIET, sent_at=monotonic())
    clock.advance(2_000)
    renew = store.renew

    def slow_renew(*args: Any, **kwargs: Any) -> dict[int, int]:
        done = renew(*args, **kwargs)
        clock.advance(1_000)  # the answer came back after the deadline
        return done

    monkeypatch.setattr(store, "renew", slow_renew)
    beat.beat()
    assert beat.deadline_of(message.fence) == LOST
    assert bool(beat.drop_all_for_ack([message.fence])) is False


def test_a_forgotten_delivery_is_the_databases_to_judge(
    store: Store, beat: Heartbeat, monotonic: Callable[[], float]
) -> None:
    message = _claimed(store)
    beat.hold(store, message.fence, lease_ms=LEASE_MS, interval=QUIET, sent_at=monotonic())
    ref = beat.clock_ref(message.fence)
    beat.drop([message.fence])
    assert beat.clock_ref(message.fence) is None and bool(beat.drop_all_for_ack([message.fence]))
    assert ref is not None and read(*(parse_ref(ref) or ("", 0)), message.fence) == LOST


# ---- the task's side ---------------------------------------------------------------------


def _context(store: Store, message: Message, monotonic: Callable[[], float]) -> TaskContext:
    clock = DeliveryClock(LEASE_MS / 1000.0, monotonic=monotonic)
    ctx = TaskContext(store, message.fence, task_id="t1", lease_ms=LEASE_MS, clock=clock)
    ctx.ensure_lease()  # as sqlease.context() does: the clock starts with it
    return ctx


def _no_round_trip(monkeypatch: pytest.MonkeyPatch, store: Store) -> None:
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a write past the lease clock reached the database")

    for name in ("compare_and_set", "renew", "append_event", "is_held", "get_task"):
        monkeypatch.setattr(store, name, refuse)


def test_a_tasks_writes_move_its_clock(
    store: Store, clock: FakeClock, monotonic: Callable[[], float]
) -> None:
    message = _claimed(store)
    ctx = _context(store, message, monotonic)
    start = monotonic()
    assert ctx.deadline == pytest.approx(start + 2.72)
    clock.advance(2_000)
    ctx.checkpoint({"page": 1})  # renews the lease: the clock counts from it
    assert ctx.deadline == pytest.approx(start + 4.72)
    assert ctx.remaining() == pytest.approx(2.72)
    assert not ctx.lease_lost


def test_past_its_clock_every_write_raises_lease_lost_at_once(
    store: Store, clock: FakeClock, monotonic: Callable[[], float], monkeypatch: pytest.MonkeyPatch
) -> None:
    message = _claimed(store)
    ctx = _context(store, message, monotonic)
    ctx.checkpoint({"page": 1})
    clock.advance(2_921)
    _no_round_trip(monkeypatch, store)
    called: list[str] = []
    for write in (
        lambda: ctx.checkpoint({"page": 2}),
        lambda: ctx.event("uploaded"),
        ctx.ensure_lease,
        lambda: ctx.step("charge", called.append, "charged"),
    ):
        with pytest.raises(LeaseLost, match="lease clock ran out"):
            write()
    assert called == []  # the step's function never ran
    assert ctx.lease_lost and ctx.remaining() == 0.0 and ctx.deadline == LOST
    assert ctx.lease_lost_event.is_set()
    monkeypatch.undo()
    # The database still held the lease: nothing the stale delivery tried reached it.
    assert store.get_task("t1").checkpoint == {"page": 1}


def test_a_refused_write_makes_every_later_one_fail_at_once(
    store: Store, clock: FakeClock, monotonic: Callable[[], float], monkeypatch: pytest.MonkeyPatch
) -> None:
    message = _claimed(store)
    ctx = _context(store, message, monotonic)
    store.release([message.fence])  # paused, say: the clock still runs
    with pytest.raises(LeaseLost, match="refused by the database"):
        ctx.checkpoint({"page": 9})
    _no_round_trip(monkeypatch, store)
    assert ctx.lease_lost
    with pytest.raises(LeaseLost, match="lease clock ran out"):
        ctx.event("late")
