"""The queues a transport declared, and the auto-delete ones it keeps alive while it consumes
them (sqlease.transport._transport).

A queue is written to the database once per process (in a caller's transaction, the
declaration joins it). An auto-delete queue with an idle expiry (Celery's reply, event and
remote-control queues) is touched every ``queue_touch_seconds`` while a channel of this
process consumes it, so that the maintenance pass never expires a queue with a live consumer;
one that expired all the same is declared and bound again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from kombu.transport.base import to_rabbitmq_queue_arguments

from sqlease.errors import ConfigurationError
from sqlease.options import TransportOptions
from sqlease.store import Store
from sqlease.transport._completion import SideCalls

logger = logging.getLogger(__name__)


class QueueChannel(Protocol):
    """A channel as the queues' keeping sees it (sqlease.transport._channel)."""

    @property
    def consuming(self) -> bool: ...

    def active_queues(self) -> list[str]: ...

    def bind_again(self, queue: str) -> None: ...


class DeclaredQueues:
    """A transport's declared queues and the idle expiry of its auto-delete ones.

    ``store()``: the transport's store; ``caller_transaction()``: the caller's transaction to
    declare in, if any; ``channels()``: the transport's channels; ``side``: the database work
    off the loop."""

    def __init__(
        self,
        *,
        store: Callable[[], Store],
        options: TransportOptions,
        caller_transaction: Callable[[], AbstractContextManager[Any]],
        channels: Callable[[], Sequence[QueueChannel]],
        side: SideCalls,
    ) -> None:
        self._store = store
        self._options = options
        self._caller_transaction = caller_transaction
        self._channels = channels
        self._side = side
        self._declared: set[str] = set()
        #: This process's auto-delete queues and their idle expiry (ms): consumed, they are
        #: touched every queue_touch_seconds (see keep_alive).
        self._expiring: dict[str, int] = {}
        self._next_touch = 0.0
        #: The queues declared here with an ``x-message-ttl``: their messages are not
        #: delivered once queued longer than it (ms), as RabbitMQ drops them.
        self._message_ttl: dict[str, int] = {}

    def declare(self, queue: str, *, auto_delete: bool = False, arguments: Any = None) -> None:
        ttl = message_ttl_of(queue, arguments)
        if ttl is not None:  # (a declaration without one, a producer's, keeps it)
            self._message_ttl[queue] = ttl
        expires_ms = self._options.queue_expiry_ms(auto_delete, arguments)
        if expires_ms is not None:
            self._expiring[queue] = expires_ms
        if queue not in self._declared or expires_ms is not None:
            # In a transactional enqueue the declaration joins the caller's transaction too:
            # on SQLite a second connection would wait for the caller's write lock.
            with self._caller_transaction() as connection:
                self._store().declare_queue(queue, expires_ms=expires_ms, connection=connection)
            if connection is None:
                self._declared.add(queue)

    def message_ttl(self, queue: str) -> int | None:
        return self._message_ttl.get(queue)

    def expires_when_idle(self, queue: str) -> bool:
        return queue in self._expiring

    def forget(self, queue: str) -> None:
        self._declared.discard(queue)
        self._expiring.pop(queue, None)
        self._message_ttl.pop(queue, None)

    def keep_alive(self) -> None:
        """Touch the auto-delete queues this process consumes, every queue_touch_seconds,
        so that the maintenance pass never expires a queue with a live consumer. One that
        expired all the same (this process stood still longer than its expiry) is declared
        and bound again, as Kombu would after a reconnect."""
        if not self._expiring:
            return
        clock = time.monotonic()
        if clock < self._next_touch:
            return
        self._next_touch = clock + self._options.queue_touch_seconds
        consumed = {
            queue
            for channel in self._channels()
            if channel.consuming
            for queue in channel.active_queues()
            if queue in self._expiring
        }
        if not consumed:
            return
        store = self._store()

        def touch() -> set[str]:
            return consumed - store.touch_queues(consumed)

        self._side.run(touch, self._declare_again)

    def _declare_again(self, gone: set[str]) -> None:
        for queue in sorted(gone):
            logger.warning(
                "sqlease: auto-delete queue %r had expired under its consumer; declaring it again",
                queue,
            )
            self._store().declare_queue(queue, expires_ms=self._expiring[queue])
            for channel in self._channels():
                channel.bind_again(queue)


def message_ttl_of(queue: str, arguments: Any) -> int | None:
    """A queue's ``x-message-ttl`` (Kombu's ``Queue(message_ttl=…)``, in ms), checked as
    RabbitMQ checks it: a whole number of milliseconds >= 0."""
    value = (arguments or {}).get("x-message-ttl")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ConfigurationError(
            f"queue {queue!r}: x-message-ttl {value!r} is not a whole number of milliseconds"
        )
    if value < 0:
        raise ConfigurationError(f"queue {queue!r}: x-message-ttl {value!r} is negative")
    return int(value)


def queue_arguments(arguments: Any, **declared: Any) -> Any:
    """A queue's arguments with Kombu's ``Queue(message_ttl=…, expires=…)`` as RabbitMQ's
    ``x-message-ttl`` and ``x-expires``: Kombu's virtual channels drop them."""
    return to_rabbitmq_queue_arguments(
        arguments, message_ttl=declared.get("message_ttl"), expires=declared.get("expires")
    )
