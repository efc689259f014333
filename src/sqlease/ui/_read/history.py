"""A task's history as a person reads it, from what the store keeps: the Celery message's
name, arguments and family, one line per delivery (lease), checkpoint changes as diffs.
Pure functions over rows and events already read."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Payload:
    """What a stored Celery message says about its task (all None when unreadable)."""

    name: str | None = None
    args: Any = None
    kwargs: Any = None
    argsrepr: str | None = None
    kwargsrepr: str | None = None
    parent_id: str | None = None
    root_id: str | None = None
    group_id: str | None = None
    eta: str | None = None
    retries: int | None = None
    headers: dict[str, Any] = field(default_factory=dict)


def parse_payload(payload: str | None) -> Payload:
    """The task's name, arguments and family from a stored Kombu message (Celery protocol 2:
    headers carry the name and ids, the body is ``[args, kwargs, embed]``)."""
    if not payload:
        return Payload()
    try:
        message = json.loads(payload)
        headers = message.get("headers") or {}
    except (ValueError, AttributeError):
        return Payload()
    if not isinstance(headers, dict):
        return Payload()
    found = Payload(
        name=headers.get("task"),
        argsrepr=headers.get("argsrepr"),
        kwargsrepr=headers.get("kwargsrepr"),
        parent_id=headers.get("parent_id"),
        root_id=headers.get("root_id"),
        group_id=headers.get("group"),
        eta=headers.get("eta"),
        retries=headers.get("retries"),
        headers=headers,
    )
    try:
        body = message.get("body")
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        if message.get("content-type", "application/json") == "application/json":
            decoded = json.loads(body)
            if isinstance(decoded, list) and len(decoded) >= 2:
                found.args, found.kwargs = decoded[0], decoded[1]
    except (ValueError, TypeError, AttributeError):
        pass  # another serializer: the reprs in the headers still say what was sent
    return found


def host_of(owner: str | None) -> str | None:
    """The host in a worker's lease owner (``host:pid:nonce``)."""
    if not owner:
        return None
    return owner.split(":", 1)[0]


#: Events that end a delivery's hold on its lease.
_LEASE_ENDS = frozenset(
    {
        "acked",
        "released",
        "retried",
        "lease_lost",
        "failed",
        "paused",
        "cancelled",
        "waiting_input",
        "waiting_approval",
        "requeued",
        "purged",
        "completed_from_stored_outcome",
    }
)


def lease_history(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per delivery (attempt): who claimed it, when, and how the hold ended (the
    first ending event of that attempt; None while it is held or when it expired unseen)."""
    deliveries: dict[int, dict[str, Any]] = {}
    for event in events:
        attempt = event.get("attempt")
        if attempt is None:
            continue
        raw = event.get("data")
        data: dict[str, Any] = raw if isinstance(raw, dict) else {}
        if event["kind"] == "claimed":
            owner = data.get("owner")
            deliveries[attempt] = {
                "attempt": attempt,
                "owner": owner,
                "host": host_of(owner),
                "claimed_at_ms": event["at_ms"],
                "ended": None,
                "ended_at_ms": None,
            }
        elif event["kind"] in _LEASE_ENDS and attempt in deliveries:
            held = deliveries[attempt]
            if held["ended"] is None:
                held["ended"], held["ended_at_ms"] = event["kind"], event["at_ms"]
    return [deliveries[a] for a in sorted(deliveries)]


def checkpoint_diffs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ``checkpoint`` event as the keys it added, changed and removed against the one
    before it."""
    previous: dict[str, Any] = {}
    out = []
    for event in events:
        data = event.get("data")
        if event["kind"] != "checkpoint" or not isinstance(data, dict):
            continue
        current = data.get("checkpoint")
        if not isinstance(current, dict):
            continue
        changes = []
        for key in sorted(set(previous) | set(current)):
            if key not in current:
                changes.append({"key": key, "op": "removed", "old": previous[key], "new": None})
            elif key not in previous:
                changes.append({"key": key, "op": "added", "old": None, "new": current[key]})
            elif previous[key] != current[key]:
                changes.append(
                    {"key": key, "op": "changed", "old": previous[key], "new": current[key]}
                )
        out.append(
            {
                "at_ms": event["at_ms"],
                "attempt": event.get("attempt"),
                "revision": data.get("revision"),
                "changes": changes,
            }
        )
        previous = current
    return out
