"""The Kombu transport: Celery's broker on SQL leases.

``broker_url = "sqlease+postgresql://user@host/db"`` (or ``"sqlease+sqlite:///app.db"``, or
``"sqlease://"`` for ``./sqlease.db``).

Delivery is a lease: a consumer claims a batch of messages (up to its free prefetch credit) in
one statement that writes owner, expiry and ``attempt + 1``; the process's heartbeat renews every
lease it holds; ack, reject and restore are fenced SQL writes on ``(id, owner, attempt)``. A
crashed worker's messages come back when their leases expire, and its late acks change nothing.

Routing: direct, topic and fanout exchanges, with bindings persisted in SQL so that remote
control (``celery inspect``), events and topic routing work across processes and machines.
Consumers that never ack (pidbox, event receivers) delete on fetch.

Wake-ups: PostgreSQL LISTEN/NOTIFY in the worker's event loop; SQLite watches the file's
``data_version``; both keep a safety poll (``polling_interval``) and sleep exactly until the
next scheduled (``eta``/``countdown``) message is due.

Modules, by role (the model is Kombu's redis transport: QoS, poller, channel, transport):
``transport`` (``Transport``: options, owner, store, connect and close, publish), ``channel``
(``Channel``: publish, consume, fenced ack/reject/restore, queues and bindings), ``qos``
(unacked bookkeeping), ``codec`` (Kombu message <-> stored row), ``drain`` (when to look and
whether to claim), ``acks`` (ack batching), ``refill`` (claims while busy), ``runners`` (every
claim and ack call into the store, and the runner that sends them off the loop), ``handoff``
(offers and handoffs), ``loop`` (the event-loop glue), ``completion`` (final outcomes the
transport writes), ``control`` (revokes across processes).
"""

from __future__ import annotations

from sqlease._celery.registry import CONNECT_RETRY_SECONDS, store_for
from sqlease.delivery import ATTEMPT_KEY, ID_KEY, LEASE_KEY, OFFER_KEY, OWNER_KEY, fence_of
from sqlease.transport._channel import Channel
from sqlease.transport._transport import Transport

#: Read from this package when a transport picks its runner: ``False`` (the benchmarks, the
#: tests) puts a busy worker's statements on a thread even where the driver could send them
#: from the event loop.
NONBLOCKING = True

__all__ = [
    "ATTEMPT_KEY",
    "CONNECT_RETRY_SECONDS",
    "ID_KEY",
    "LEASE_KEY",
    "NONBLOCKING",
    "OFFER_KEY",
    "OWNER_KEY",
    "Channel",
    "Transport",
    "fence_of",
    "store_for",
]
