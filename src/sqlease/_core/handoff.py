"""Handoff: a publish gives its message straight to an idle worker (PostgreSQL).

An idle worker's claim round trip after each notification (the notification wakes it, then it
claims) was the largest part of the time between a publish and the task's start. Instead, an
idle worker leaves an *offer* for its queues (``Store.offer``), and a publish that finds a live
offer leases the message to that worker in its own statement, with attempt 1, fenced like any
claim, and sends the leased row in its notification. The worker delivers it on receipt.

Liveness: an offer counts only while the worker's listening connection holds an advisory lock
named by ``lock_key_for(owner)``. A killed worker's connections close, the lock goes with
them, and publishes no longer choose its offer. An offer also expires (``ttl_ms``), and is
one-shot: the publish that uses it deletes it. A message handed to a worker that then never
takes it (it stalled, or closed in between) is still an ordinary lease: released at close,
or taken over when it expires.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from sqlease.types import Message

logger = logging.getLogger(__name__)

#: First character of a handoff notification (a queue-name notification never starts so).
MARK = "\x01"


def lock_key_for(owner: str) -> int:
    """The advisory-lock key (signed 64-bit) a worker holds while its offers are live."""
    digest = hashlib.blake2b(f"sqlease-offer:{owner}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


@dataclass(frozen=True)
class Handoff:
    """One message handed to this worker: the leased row, or only its id and attempt when the
    row was too long for a notification (then read back with ``Store.get_message``)."""

    message_id: int
    attempt: int
    message: Message | None
    #: The queue whose offer the publish used, and that offer's number: the worker shows it
    #: (``Store.offer(seen=…)``) before that offer may stand again.
    queue: str
    offer_seq: int


def split(payloads: Iterable[str], owner: str) -> tuple[list[Handoff], set[str]]:
    """Notification payloads: the handoffs addressed to ``owner``, and the queue names the
    others notified (handoffs to other workers name nothing to look at)."""
    mine: list[Handoff] = []
    queues: set[str] = set()
    for payload in payloads:
        if not payload.startswith(MARK):
            queues.add(payload)
            continue
        to, _, body = payload[1:].partition("\n")
        if to != owner:
            continue
        try:
            mine.append(_decode(body, owner))
        except (ValueError, KeyError, TypeError) as exc:
            # Not expected from our own SQL; the lease expires and the message is taken over.
            logger.error("sqlease: unreadable handoff notification (%s): %.200r", exc, body)
    return mine, queues


def _decode(body: str, owner: str) -> Handoff:
    data = json.loads(body)
    message_id, attempt = int(data["id"]), int(data["attempt"])
    queue, offer_seq = str(data["queue"]), int(data["offer_seq"])
    if "payload" not in data:
        return Handoff(message_id, attempt, None, queue, offer_seq)
    message = Message(
        id=message_id,
        queue=queue,
        payload=str(data["payload"]),
        priority=int(data["priority"]),
        available_at_ms=int(data["available_at_ms"]),
        created_at_ms=int(data["created_at_ms"]),
        run_id=data["run_id"],
        task_id=data["task_id"],
        state="ready",
        reason=None,
        lease_owner=owner,
        lease_expires_at_ms=int(data["lease_expires_at_ms"]),
        attempt=attempt,
        max_attempts=int(data["max_attempts"]),
    )
    return Handoff(message_id, attempt, message, queue, offer_seq)
