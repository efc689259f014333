"""The delivery-info protocol: what a sqlease delivery carries about its lease.

The transport adds these keys to ``properties['delivery_info']``; Celery passes them to the
task as ``self.request.properties['delivery_info']`` and to the result backend, which read the
lease back with :func:`fence_of`. Kept apart from the transport so that the backend and the
task context need not import the Kombu adapter.
"""

from __future__ import annotations

from typing import Any

from sqlease.types import Fence

ID_KEY = "sqlease_id"
ATTEMPT_KEY = "sqlease_attempt"
OWNER_KEY = "sqlease_owner"
LEASE_KEY = "sqlease_lease_ms"
#: Where the worker publishes the delivery's lease clock: ``file#slot`` of its shared clock
#: table (sqlease._core.clock_slots), read by the task's context and the result backend.
CLOCK_KEY = "sqlease_clock"
#: On a delivery its worker took while holding nothing else: the handoff offer the task's final
#: result writes (sqlease.backend), so the worker's next offer stands before the client wakes.
OFFER_KEY = "sqlease_offer"


def fence_of(delivery_info: dict[str, Any] | None) -> Fence | None:
    """The lease a delivery was made under, from its ``delivery_info`` (None if unleased)."""
    if not delivery_info or ID_KEY not in delivery_info:
        return None
    return Fence(
        int(delivery_info[ID_KEY]), str(delivery_info[OWNER_KEY]), int(delivery_info[ATTEMPT_KEY])
    )
