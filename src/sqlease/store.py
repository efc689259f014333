"""The lease store: durable messages held by fenced SQL leases.

Every operation is one statement or one short transaction that commits at once; nothing is
held open across client-side work. Every write to a leased message carries its fence
``(message_id, owner, attempt)`` and is refused (reported, not raised) when the fence no longer
matches a live lease, so a stale worker can never ack, renew or overwrite work that another
worker now holds. Each state change appends an event in the same transaction.

``now`` (epoch milliseconds) may be passed to any operation; by default the store asks its
``clock`` and, without one, the database's clock.
"""

from __future__ import annotations

from sqlease._core.store import Store
from sqlease._db.rows import expand_event_rows
from sqlease.types import CasResult, Event, Fence, Message, NewMessage, Outcome, TaskRecord

__all__ = [
    "CasResult",
    "Event",
    "Fence",
    "Message",
    "NewMessage",
    "Outcome",
    "Store",
    "TaskRecord",
    "expand_event_rows",
]

# The class is documented and shown under its public path.
Store.__module__ = __name__
