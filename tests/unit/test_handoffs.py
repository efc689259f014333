"""The bookkeeping of a worker's offers (no database: what stands, what a withdraw covers)."""

from __future__ import annotations

from sqlease._core.handoff import Handoff
from sqlease.transport._handoff import Handoffs
from sqlease.transport._looks import ChannelLook, LookState


def _handoffs() -> Handoffs:
    return Handoffs(
        enabled=True,
        owner="w1",
        lock_key=7,
        lease_ms=30_000,
        polling_interval=1.0,
        channels=lambda: [],
        waker=lambda: None,
        in_loop=lambda: True,
        closing=lambda: False,
    )


def _handoff(queue: str, seq: int) -> Handoff:
    return Handoff(message_id=1, attempt=1, message=None, queue=queue, offer_seq=seq)


def test_an_offer_written_stands_until_its_handoff_is_heard() -> None:
    h = _handoffs()
    assert not h.worth_an_offer([])
    h.stood(["a", "b"], dict(h.heard))
    assert h.offered
    assert h.worth_an_offer([])  # an idle look must withdraw what stands
    h.heard_of(_handoff("a", 3))
    assert h.heard == {"a": 3}
    assert h.terms()["seen"] == {"a": 3}
    h.heard_of(_handoff("b", 1))
    assert not h.worth_an_offer([])  # both were used: nothing left to withdraw


def test_an_offer_used_while_its_statement_was_on_its_way_does_not_stand() -> None:
    # The offer is sent knowing of no handoff; before its answer comes back a publish uses it
    # and the handoff is heard. The answer must not make the used offer stand again (that
    # would cost a needless withdraw at the next idle look).
    h = _handoffs()
    sent_with = dict(h.heard)
    h.heard_of(_handoff("a", 1))
    h.stood(["a", "b"], sent_with)
    assert h.withdrawn()  # "b" still stands
    h.stood(["a"], sent_with)
    assert not h.worth_an_offer([])


def test_withdraw_listening_again_and_closing_clear_what_stands() -> None:
    h = _handoffs()
    h.stood(["a"], {})
    assert h.withdrawn()
    assert not h.withdrawn()
    h.stood(["a"], {})
    assert not h.listening_again(1)  # the first connection: nothing from before
    assert h.listening_again(2)
    assert not h.worth_an_offer([])
    h.stood(["a"], {})
    assert h.closing()
    assert not h.closing()
    assert not h.worth_an_offer([])


class _Credit:
    def can_consume(self) -> bool:
        return True

    def refill_later(self) -> bool:
        return False


def test_a_handoff_keeps_the_due_time_read_with_the_offer_it_used() -> None:
    # An idle worker's claim found nothing: it reads the due time once (with its offer). A
    # handoff leaves its queues known empty, and the due time stands: the looks that follow
    # (an ack's wake) neither claim nor read it again.
    looks, part = LookState(), ChannelLook()
    looks.claimed(part, 0, 4, short=True)
    assert part.known_empty and part.due_checked and looks.found_nothing
    part.handed_off(named=False)
    looks.begin_pass()
    assert not looks.should_claim(part, _Credit(), notifications=True)
    assert not looks.found_nothing  # no look ahead: nothing to read
    part.handed_off(named=True)  # a notification named the queues meanwhile: claim
    part.notified({"celery"}, ["celery"])
    assert looks.should_claim(part, _Credit(), notifications=True)


class _Look:
    claiming = False


class _Channel:
    """A channel holding deliveries with the tags ``held``."""

    def __init__(self, *held: str) -> None:
        self.look = _Look()
        self.held = set(held)

    def holds_besides(self, acking: object) -> bool:
        return bool(self.held - set(acking))  # type: ignore[call-overload]

    def held_besides(self, acking: object) -> int:
        return len(self.held - set(acking))  # type: ignore[call-overload]


def _with_channels(*channels: _Channel) -> Handoffs:
    return Handoffs(
        enabled=True,
        owner="w1",
        lock_key=7,
        lease_ms=30_000,
        polling_interval=1.0,
        channels=lambda: list(channels),  # type: ignore[arg-type,list-item]
        waker=lambda: None,
        in_loop=lambda: True,
        closing=lambda: False,
    )


def test_a_celery_worker_has_room_while_a_pool_process_is_free(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from sqlease._celery import pool_room
    from sqlease.store import Fence

    load: list[tuple[int, int] | None] = [(2, 1)]
    monkeypatch.setattr(pool_room, "load", lambda: load[0])
    channel = _Channel("5.1")
    h = _with_channels(channel)
    assert h.has_room()  # one task running (held and received), one process free
    load[0] = (2, 2)
    assert not h.has_room()  # both busy
    channel.held = {"5.1", "6.1"}
    load[0] = (2, 0)  # delivered, not yet received by Celery: the deliveries count
    assert not h.has_room()
    # The acks being written do not count: they leave room with their offer.
    assert h.has_room(besides=[Fence(6, "w1", 1)])
    assert h.acks_leave_idle([Fence(6, "w1", 1)], ["celery"]) is False  # no listener: no offer
    channel.look.claiming = True
    load[0] = (4, 0)
    assert not h.has_room()  # a claim under way: what it brings is not known yet
    channel.look.claiming = False
    assert h.has_room()


def test_elsewhere_only_a_worker_holding_nothing_has_room(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from sqlease._celery import pool_room

    monkeypatch.setattr(pool_room, "load", lambda: None)
    channel = _Channel("5.1")
    h = _with_channels(channel)
    assert not h.has_room()
    channel.held = set()
    assert h.has_room() == h.holds_nothing()
