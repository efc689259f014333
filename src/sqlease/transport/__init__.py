"""The Kombu transport: Celery's broker on SQL leases.

``broker_url = "sqlease+postgresql://user@host/db"`` (or ``"sqlease+sqlite:///app.db"``, or
``"sqlease://"`` for ``./sqlease.db``).

Delivery is a lease: a consumer claims a batch of messages (up to its free prefetch credit) in
one statement that writes owner, expiry and ``attempt + 1``; the process's heartbeat renews every
lease it holds; ack, reject and restore are fenced SQL writes on ``(id, owner, attempt)``. A
crashed worker's messages come back when their leases expire, and its late acks change nothing.

Routing: direct, topic and fanout exchanges, with bindings and exchange types persisted in SQL
so that remote control (``celery inspect``), events, topic routing and publishes to an exchange
declared elsewhere work across processes and machines.
Consumers that never ack (pidbox, event receivers) delete on fetch.

Wake-ups: PostgreSQL LISTEN/NOTIFY in the worker's event loop; SQLite watches the file's
``data_version``; both keep a safety poll (``polling_interval``) and sleep exactly until the
next scheduled (``eta``/``countdown``) message is due.

Modules, by role (the model is Kombu's redis transport: QoS, poller, channel, transport),
each given what it needs and no more; their imports form a tree, rooted here:
``transport`` (``Transport``: options, owner, store, connect and the one close sequence,
publish; it builds the parts), ``channel`` (``Channel``: publish, consume, fenced
ack/reject/restore, queues and bindings; it asks the fetcher for messages), ``qos`` (unacked
bookkeeping), ``codec`` (Kombu message <-> stored row), ``fetcher`` (the one thing a channel
calls for messages: it owns the runner and builds its parts: ``claims``, claims, takes and
sweeps; ``deliveries``, what they bring to the consumer; ``acking``, how acks and rejects are
written; ``idle``, offers and due times; ``handed``, handoffs accepted; ``outcomes``, the
runner's outcomes to the part that made the job), ``drain`` (when to look and whether to
claim), ``acks`` (ack batching), ``runners``, ``loop_calls`` and ``background`` (the database
jobs of the event loop, sent by the loop itself or done on a thread), ``completion`` (what
follows a claim: exhausted, already completed, redelivered), ``handoff`` (the offers' state),
``queues`` (the queues declared, auto-delete ones kept alive while consumed), ``wakeups``
(what the event loop's events mean), ``loop`` (the event-loop mechanics), ``control``
(revokes across processes).
"""

from __future__ import annotations

from sqlease._celery.registry import CONNECT_RETRY_SECONDS, store_for
from sqlease.delivery import ATTEMPT_KEY, ID_KEY, LEASE_KEY, OFFER_KEY, OWNER_KEY, fence_of
from sqlease.transport._channel import Channel
from sqlease.transport._transport import Transport

__all__ = [
    "ATTEMPT_KEY",
    "CONNECT_RETRY_SECONDS",
    "ID_KEY",
    "LEASE_KEY",
    "OFFER_KEY",
    "OWNER_KEY",
    "Channel",
    "Transport",
    "fence_of",
    "store_for",
]
