"""Recognising a Celery chord part in a stored Kombu message.

Lost-ack completion (guarantees.md, invariant 9) acks a redelivered message whose final
result is already stored instead of running it again. Celery stores a chord part's result
*before* it counts the part towards its chord, so a worker killed between the two leaves a
stored result and no count: completing that message would leave the chord waiting forever.
Such a part runs again instead; its count is idempotent (``ResultStore.incr(part=…)``), so it
is counted exactly once. So does the chord's last part when its worker died between the
count and the callback (``ResultStore.parts_settled``).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

#: Celery's key for a chord's counter (``KeyValueStoreBackend.chord_keyprefix``).
CHORD_KEY_PREFIX = "chord-unlock-"


def chord_count_of(payload: str) -> tuple[str, str] | None:
    """For a Celery task message (protocol 2, JSON body) that is part of a chord: its chord's
    counter key and its task id. None for anything else, or a body it cannot read (which
    then keeps the ordinary completion)."""
    try:
        envelope = json.loads(payload)
        headers = envelope.get("headers") or {}
        group, task_id = headers.get("group"), headers.get("id")
        if not group or not task_id or envelope.get("content-type") != "application/json":
            return None
        body: Any = envelope.get("body")
        if (envelope.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        decoded = json.loads(body)
    except (ValueError, TypeError, AttributeError, binascii.Error):
        return None
    if not isinstance(decoded, list) or len(decoded) != 3 or not isinstance(decoded[2], dict):
        return None
    if not decoded[2].get("chord"):
        return None
    return f"{CHORD_KEY_PREFIX}{group}", str(task_id)
