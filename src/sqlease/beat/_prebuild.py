"""Fires built ahead of their slots: the message each entry's next slot sends, made by
Celery's own ``apply_async`` (routing, serializer, the task's options, the
``before_task_publish`` handlers' headers) into a channel that keeps it instead of writing it.

At the boundary the leader then writes the prebuilt messages of many entries together
(``sqlease._core.schedule_fires``), so a minute of 10,000 crontab entries costs the database's
time, not 10,000 ``apply_async`` calls. A prebuilt fire is used only for the entry's revision
and slot it was built for: an entry edited since (every edit bumps its revision) is built
again with its new definition when it fires.

What differs from a one-by-one send, on purpose: ``before_task_publish`` is sent when the
message is built (ahead of the slot; again if the entry changes and it is built again), and
``after_task_publish`` after the batch's transaction commits. ``expires`` given in seconds
counts from the slot (it counts from the send otherwise, which is the slot within the
lateness); a fire later than ``TIMED_LATE_MS`` is built again at once so that it counts from
then, as ``apply_async`` would.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from celery.utils.time import add_seconds_to_datetime, maybe_make_aware

from sqlease._core.schedule_fires import BatchFire, ScheduleFiring
from sqlease._core.schedules import EntryRow, ScheduleStore
from sqlease._db.dialects import same_database
from sqlease.beat._calls import iso, slot_task_id, task_call
from sqlease.transport import Transport
from sqlease.transport._codec import new_message

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger("sqlease.beat")

#: How far ahead of its slot a fire is built (more than a minute: a crontab() entry's next
#: slot is built while the tick after its boundary has time to spare).
AHEAD_MS = 90_000
#: Entries read per look ahead.
LOOK = 1000
#: A prebuilt fire whose message has a time counted from its slot (``expires`` in seconds) is
#: used up to this late; later, the message is built again at once.
TIMED_LATE_MS = 1000
#: Prebuilt fires kept at most (an entry removed before its slot leaves its fire here until
#: the slot is an hour old).
KEEP = 200_000


class _Captured(Exception):
    """What a publish on the capturing channel raises, carrying the message: so that
    ``apply_async`` stops there (no ``after_task_publish``, no result object)."""

    def __init__(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        super().__init__("captured")
        self.items = items


class _Unbatchable(Exception):
    """A publish the capturing channel cannot keep (a fanout exchange)."""


@dataclass(frozen=True, slots=True)
class Prebuilt:
    """One entry's fire of one slot, ready to be written."""

    name: str
    revision: int
    slot: int
    #: The entry's next slot after ``slot``.
    next_ms: int
    task_id: str
    #: The message's row as the store checked it (``ScheduleFiring.batchable``).
    row: dict[str, Any]
    #: The fire, encoded for the batch (``ScheduleFiring.prepare``).
    fire: BatchFire
    #: ``after_task_publish``'s arguments: sender, body, headers, exchange, routing key.
    after: tuple[str, Any, dict[str, Any], str, str]
    #: Its message has a time counted from ``base_ms`` (``expires`` in seconds).
    timed: bool
    base_ms: int
    #: The entry's catch-up policy and grace seconds (``Firing._policy``).
    policy: tuple[str, float]


class Prebuilder:
    """The leader's prebuilt fires, by entry name."""

    def __init__(
        self,
        app: Celery,
        entries: ScheduleStore,
        producer: Callable[[], Any],
        next_slot: Callable[[EntryRow, int], int],
        policy: Callable[[EntryRow], tuple[str, float]],
    ) -> None:
        self.app = app
        self.entries = entries
        self.batch = ScheduleFiring(entries, "schedule:")
        self._producer = producer
        self._next_slot = next_slot
        self._policy = policy
        self.prefix = entries.store.tables.prefix
        self.built: dict[str, Prebuilt] = {}
        #: (revision, slot) of entries whose fire cannot be prebuilt: the one-by-one send
        #: fires them, and they are not built (nor their before_task_publish sent) again.
        self.refused: dict[str, tuple[int, int]] = {}
        #: The last (slot, name) looked ahead at: the next look starts after it.
        self._mark: tuple[int, str] = (0, "")
        self._capture: Any = None
        self._usable: bool | None = None

    # ---- whether this beat can batch at all ------------------------------------------------

    def usable(self) -> bool:
        """The beat's producer writes to the entries' own database and tables (a sqlease
        broker; not Redis or RabbitMQ beside sqlease_beat_url), and Celery sends no
        ``task-sent`` event (the batch does not publish it)."""
        if self._usable is None:
            transport = self._producer().connection.transport
            store = self.entries.store
            self._usable = (
                isinstance(transport, Transport)
                and same_database(transport.url, store.engine.url)
                and transport.store.tables.prefix == store.tables.prefix
                and not self.app.conf.task_send_sent_event
            )
        return self._usable

    # ---- building --------------------------------------------------------------------------

    def build(self, entry: EntryRow, slot: int, base_ms: int) -> Prebuilt | None:
        """The fire of ``entry``'s ``slot`` as ``apply_async`` would send it at ``base_ms``;
        None when it cannot go in a batch (the one-by-one send then fires it, and reports
        what is wrong with it, if anything)."""
        if entry.next_run_at_ms is None:
            return None
        task_id = slot_task_id(self.prefix, entry.name, slot)
        producer, calls = self._capturing()
        task, args, kwargs, options = task_call(self.app, entry, task_id, slot)
        expires = options.get("expires")
        timed = isinstance(expires, numbers.Real) and not isinstance(expires, bool)
        if timed:
            # As as_task_v2 counts it from app.now(), counted from base_ms instead.
            tz = self.app.timezone
            now = datetime.fromtimestamp(base_ms / 1000, tz=UTC).astimezone(tz)
            options["expires"] = maybe_make_aware(add_seconds_to_datetime(now, expires), tz=tz)
        calls.clear()
        try:
            if task is not None:
                task.apply_async(args, kwargs, producer=producer, **options)
            else:
                self.app.send_task(entry.task, args, kwargs, producer=producer, **options)
        except _Captured as captured:
            items = captured.items
        except Exception:
            logger.debug("sqlease beat: %s cannot be prebuilt", entry.name, exc_info=True)
            return None
        else:
            return None  # nothing was published (a task that does not send)
        if len(items) != 1 or not calls:
            return None
        try:
            row = self.batch.batchable(new_message(*items[0]))
        except Exception:
            return None
        if row is None:
            return None
        body, exchange, routing_key, headers = calls[-1]
        after = (headers.get("task", entry.task), body, headers, exchange, routing_key)
        following = self._next_slot(entry, slot)
        fired = {"slot": iso(slot), "task_id": task_id, "next_run_at": iso(following)}
        fire = self.batch.prepare(entry.name, entry.revision, slot, following, task_id, row, fired)
        return Prebuilt(
            entry.name,
            entry.revision,
            slot,
            following,
            task_id,
            row,
            fire,
            after,
            timed,
            base_ms,
            self._policy(entry),
        )

    def _capturing(self) -> tuple[Any, list[tuple[Any, str, str, dict[str, Any]]]]:
        """A producer on a channel of the beat's connection whose publishes are kept, not
        written, and the calls made to it."""
        if self._capture is None:
            connection = self._producer().connection
            channel = connection.channel()
            kept: list[tuple[str, dict[str, Any]]] = []
            original = channel.basic_publish

            def put(queue: str, message: dict[str, Any], **kwargs: Any) -> None:
                kept.append((queue, message))

            def fanout(*args: Any, **kwargs: Any) -> None:
                raise _Unbatchable("a fanout exchange")

            def basic_publish(message: Any, exchange: str, routing_key: str, **kw: Any) -> Any:
                kept.clear()
                original(message, exchange, routing_key, **kw)
                raise _Captured(list(kept))

            channel._put = put
            channel._put_fanout = fanout
            channel.basic_publish = basic_publish
            producer = self.app.amqp.Producer(channel, auto_declare=False)
            calls: list[tuple[Any, str, str, dict[str, Any]]] = []
            publish = producer.publish

            def recording(body: Any, **kwargs: Any) -> Any:
                calls.append(
                    (
                        body,
                        kwargs.get("exchange") or "",
                        kwargs.get("routing_key") or "",
                        kwargs.get("headers") or {},
                    )
                )
                return publish(body, **kwargs)

            producer.publish = recording
            self._capture = (producer, calls)
        return self._capture  # type: ignore[no-any-return]

    # ---- the cache -------------------------------------------------------------------------

    def take(self, entry: EntryRow, slot: int, now: int) -> Prebuilt | None:
        """The fire of ``entry``'s ``slot``: the prebuilt one if it was built for this
        revision and slot (and, if timed, the fire is not late), else built now."""
        if self.refused.get(entry.name) == (entry.revision, slot):
            return None
        built = self.built.pop(entry.name, None)
        if (
            built is not None
            and built.revision == entry.revision
            and built.slot == slot
            and not (built.timed and now - slot > TIMED_LATE_MS)
        ):
            return built
        return self.build(entry, slot, max(now, slot))

    def came(self, now: int) -> list[Prebuilt]:
        """Take the prebuilt fires whose slot came by ``now`` (timed ones only while not
        late), oldest slot first."""
        came = [
            b
            for b in self.built.values()
            if b.slot <= now and not (b.timed and now - b.slot > TIMED_LATE_MS)
        ]
        for b in came:
            del self.built[b.name]
        came.sort(key=lambda b: (b.slot, b.name))
        return came

    def next_of(self, entry: EntryRow) -> int | None:
        """The entry's next slot after its due one, if a fire of it was prebuilt."""
        built = self.built.get(entry.name)
        if built is None or built.revision != entry.revision:
            return None
        if built.slot != entry.next_run_at_ms:
            return None
        return built.next_ms

    def fill(self, now: int, seconds: float) -> bool:
        """Build the fires of the entries whose slot comes within AHEAD_MS, for up to
        ``seconds``; whether some are left to build. Entries are looked at once each, in
        slot order after the last one looked at (an entry moved before that by an edit is
        built when it fires)."""
        if not self.usable():
            return False
        deadline = time.monotonic() + seconds
        if self._mark[0] < now:
            self._mark = (now, "")
        if len(self.built) + len(self.refused) > KEEP:
            self.built = {n: b for n, b in self.built.items() if b.slot > now - 3_600_000}
            self.refused.clear()
        while time.monotonic() < deadline:
            found = self.entries.upcoming(self._mark, now + AHEAD_MS, LOOK)
            for entry in found:
                assert entry.next_run_at_ms is not None
                self._mark = (entry.next_run_at_ms, entry.name)
                done = self.built.get(entry.name)
                if done is None or (done.revision, done.slot) != (
                    entry.revision,
                    entry.next_run_at_ms,
                ):
                    slot = entry.next_run_at_ms
                    built = self.build(entry, slot, slot)
                    if built is not None:
                        self.built[entry.name] = built
                    else:
                        self.refused[entry.name] = (entry.revision, slot)
                if time.monotonic() >= deadline:
                    return True
            if len(found) < LOOK:
                return False
        return True
