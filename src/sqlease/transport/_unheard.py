"""Claims the event loop sent whose answers never came, and the release of what they leased.

A claim that committed on PostgreSQL while its answer was lost (the connection dropped between
the commit and the reply, or the statement was given up after a lease without one) leased
messages that nobody in this worker knows of: they would wait out their lease and come back
with a delivery more spent. Before its next statement goes out, the loop releases them with
the attempt refunded (``Driver.release_lost_claims``), found by each claim's mark
(``Op.claim_mark``). A try that never ran left nothing to release."""

from __future__ import annotations

import logging
from typing import Any

from sqlease._db.driver import Driver, Op

logger = logging.getLogger(__name__)


class Unheard:
    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        #: ``(owner, mark)`` of each unheard claim, and when it was sent (monotonic).
        self._marks: list[tuple[tuple[str, str], float]] = []

    def __bool__(self) -> bool:
        return bool(self._marks)

    def add(self, op: Op[Any], sent_at: float) -> None:
        """``op`` was sent at ``sent_at`` and its answer did not come: it may have run."""
        if op.claim_mark is not None:
            self._marks.append((op.claim_mark, sent_at))

    def release(self) -> Op[Any] | None:
        """The release of what the unheard claims of one owner leased (None: the driver has
        no statement for it, nothing to send)."""
        owner = self._marks[0][0][0]
        mine = [(mark, since) for (o, mark), since in self._marks if o == owner]
        since = min(since for _, since in mine)
        op = self._driver.release_lost_claims(owner, [mark for mark, _ in mine], since)
        if not op.sendable:
            self._forget(owner)
            return None
        return op

    def _forget(self, owner: str) -> None:
        self._marks = [entry for entry in self._marks if entry[0][0] != owner]

    def released(self, op: Op[Any], rows: Any, error: BaseException | None) -> None:
        """The release ``op`` came back (``rows``), or failed for another reason than a lost
        connection: its claims are settled either way (a release the database refused is not
        sent again; those leases come back when they expire, as without it)."""
        self._forget(op.params["owner"])
        if error is not None:
            logger.warning("sqlease: releasing the leases of unheard claims failed: %s", error)
            return
        assert op.finish is not None
        released = op.finish(rows)
        if released:
            logger.info(
                "sqlease: %d message(s) leased by a claim whose answer was lost released "
                "(attempt refunded)",
                len(released),
            )
