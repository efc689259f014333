"""When to look for work, and whether a look is worth a claim: the flags that the channels, the
fetcher and the wake-ups share, each changed only by a named transition here.

Two levels: ``LookState`` (one per transport) is the event loop's pass: more may be ready,
a claim found nothing (time to read when the next delayed message is due), the prefetch credit
ran out. ``ChannelLook`` (one per channel) is what one channel knows of its queues. The rules:

- No-ack queues (remote control, events) are looked at before any claim, and while they are
  quiet only every ``NOACK_INTERVAL`` (SQLite) or when a notification names them (PostgreSQL).
- PostgreSQL: after a claim came back short the channel's queues are *known empty*: until
  something can have changed that (a notification naming them, an ack in a run, a release, a
  due time, the safety poll), a look reads the next due time once instead of claiming.
- A handoff arrives because the queues were idle: they stay known empty, unless a notification
  read with it named them.
- A claim that carried acks never reports its queues known empty: it may not have seen the acks
  free a run's next message.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterable
from typing import Any, Protocol

#: SQLite: the longest a consumer that never acks (remote control, events) waits between looks
#: while its queues are empty. (PostgreSQL looks when a notification names one of its queues,
#: and at the safety poll.)
NOACK_INTERVAL = 0.01


class ChannelLook:
    """One channel's queues: which are no-ack, when to look at those next, whether the others
    are known empty and their due time read, whether a claim or take runs for them on the
    runner, whether the channel is closing. Read freely; changed only through these methods.

    (To *drain* is to deliver what is ready, as Kombu's ``drain_events``; a queue found with
    nothing ready is *known empty*.)"""

    __slots__ = (
        "claiming",
        "closing",
        "due_checked",
        "known_empty",
        "next_take",
        "noack_queues",
        "notices",
        "taking",
    )

    def __init__(self) -> None:
        self.noack_queues: set[str] = set()
        self.next_take = 0.0
        self.known_empty = False
        self.due_checked = False
        # A claim for this channel is under way on the transport's runner; how many takes.
        self.claiming = False
        self.taking = 0
        # Notifications that named its no-ack queues (a take's outcome knows whether one came
        # after it was sent).
        self.notices = 0
        self.closing = False

    def consume(self, queue: str, *, no_ack: bool) -> None:
        self.known_empty = False
        if no_ack:
            self.noack_queues.add(queue)
        else:
            self.noack_queues.discard(queue)

    def cancel(self, queue: str) -> None:
        """The last consumer of ``queue`` on this channel went away."""
        self.noack_queues.discard(queue)

    def close(self) -> None:
        self.closing = True

    def claim_started(self) -> None:
        self.claiming = True

    def claim_finished(self) -> None:
        self.claiming = False

    def take_started(self) -> int:
        """A take of the no-ack queues was sent: no other until its outcome or a notification
        naming them. Returns what its outcome hands to ``took_none``."""
        self.taking += 1
        self.next_take = math.inf
        return self.notices

    def take_finished(self) -> None:
        self.taking -= 1

    def may_take(self) -> bool:
        """Time to look at the no-ack queues."""
        return time.monotonic() >= self.next_take

    def took_some(self) -> None:
        """A look at the no-ack queues took messages: look again at the next fetch."""
        self.next_take = 0.0

    def took_none(self, *, notified: bool, notices: int) -> None:
        """A look at the no-ack queues found nothing. Remote control and event queues are
        quiet: while a worker drains a backlog, do not look at them on every fetch.
        Where publishes notify (PostgreSQL names the queue), it looks again when a notification
        names them (or at the safety poll); otherwise at most every NOACK_INTERVAL. A
        notification that came after the take was sent (``notices`` is what ``take_started``
        returned) still stands: the look it asks for is not this one."""
        if notices != self.notices:
            return
        if notified:
            self.next_take = math.inf
        else:
            self.next_take = time.monotonic() + NOACK_INTERVAL

    def notified(self, queues: set[str] | None, active: Iterable[str]) -> None:
        """Something was published to ``queues`` (None: to any): no-ack queues among them
        are looked at now, not after their throttle, and known empty ones claimed from again."""
        if queues is None or not queues.isdisjoint(self.noack_queues):
            self.next_take = 0.0
            self.notices += 1
        if queues is None or not queues.isdisjoint(active):
            self.known_empty = False

    def look_again(self) -> None:
        """Messages may have become ready (released, or a run's next after an ack)."""
        self.known_empty = False

    def handed_off(self, *, named: bool) -> None:
        """A handoff was delivered; ``named``: a notification read with it named the queues.
        The due time read with the offer it used still stands (a handoff moves no other
        message's): no look at it until something else changes. The offer after this task is
        its result's, or its ack's when that leaves the worker idle."""
        if not named:
            self.known_empty = True

    def due_read(self) -> None:
        """The next due time was read (with the acks that left the worker idle)."""
        if self.known_empty:
            self.due_checked = True


class LookState:
    """The event loop's pass over the channels (one per transport)."""

    __slots__ = ("found_nothing", "more", "starved")

    def __init__(self) -> None:
        # More may be ready: look in the next iteration rather than at the next poll.
        self.more = True
        # A claim ran and found nothing: read when the next delayed message is due.
        self.found_nothing = False
        # Work may wait but the prefetch credit is used up.
        self.starved = False

    def wake(self) -> None:
        """Look for work in the next iteration (a notification, an ack, a consumer, a poll)."""
        self.more = True

    def begin_pass(self) -> None:
        self.found_nothing = False

    def begin_round(self) -> None:
        """One round of the fair cycle over the channels starts."""
        self.more = False
        self.starved = False

    def round_found_nothing(self) -> None:
        """Nothing was delivered: if the credit ran out, look again as soon as an ack frees
        some (the event loop's next tick)."""
        if self.starved:
            self.more = True

    def should_claim(self, part: ChannelLook, qos: Any, *, notifications: bool) -> bool:
        """Whether a channel with consumed (acked) queues claims now. Not while its claim runs
        in the background (that delivers when it is done), nor without credit or while the
        refill waits for more (starved); and not from known empty queues (PostgreSQL), where the
        cheaper look at when the next delayed message is due is taken once instead."""
        if part.claiming:
            return False
        if not qos.can_consume() or qos.refill_later():
            self.starved = True
            return False
        if part.known_empty and notifications:
            if not part.due_checked:
                part.due_checked = True
                self.found_nothing = True
            return False
        return True

    def claimed(
        self, part: ChannelLook, count: int, limit: int, *, short: bool, again: bool = False
    ) -> None:
        """A claim of ``limit`` brought ``count``; ``short``: the store had fewer than asked
        (never reported for a claim that carried acks); ``again``: it stopped in front of a
        message the next claim judges (look again at once)."""
        part.known_empty = short
        part.due_checked = False
        if count == limit or again:
            self.more = True
        elif not count:
            self.found_nothing = True
            part.due_checked = True


class Consumer(Protocol):
    """A channel as the fetcher and the handoffs see it (sqlease.transport._channel)."""

    look: ChannelLook
    qos: Any
    closed: bool

    @property
    def consuming(self) -> bool: ...

    def active_queues(self) -> list[str]: ...

    def acked_queues(self) -> list[str]: ...

    def accepts_deliveries(self) -> bool: ...

    def consumes(self, queue: str) -> bool: ...

    def decode_body(self, body: Any, encoding: Any) -> Any: ...

    def holds_besides(self, acking: Collection[str]) -> bool: ...

    def held_besides(self, acking: Collection[str]) -> int: ...
