"""Batches: every task sent inside ``with sqlease.batch():`` is published when the block ends,
in one transaction, all or nothing.

``delay()`` and ``apply_async()`` inside the block return their results (the task ids are
Celery's, chosen before the publish) at once; the messages are written, and seen by workers,
only when the block ends without an error. Several messages in one transaction go in
statements of many rows (``Driver.message_publish_batch``), so a group of a thousand costs
about one commit and a few statements instead of a thousand of each.

A Celery ``group`` (and so a chord's header, ``chunks``) whose app's broker is sqlease is
published as one batch by itself (``sqlease._celery.groups``).

The rules:

- An exception leaving the block (or any batch block nested in it) publishes nothing; so
  does a message refused when it was sent (a bad header, a payload over
  ``max_payload_bytes``): its error names the message, and the block raises it again at its
  end if the caller caught it, so that a batch is never published without one of its members.
- A unique task whose key holds is a duplicate as in a single publish: it enqueues nothing
  and the rest of the batch is published (``sqlease._core.uniques``).
- Inside ``sqlease.transaction()`` or a transaction a framework adapter joins (Django's
  ``atomic()``) the batch is written in that transaction when the block ends, and commits or
  rolls back with it. The batch must be opened inside the transaction: a transaction opened
  or closed inside the block would be escaped, and is refused.
- A batch writes to one database; blocks nest (the outermost one publishes).
- Broadcasts (remote control, Celery's events) are not held: they are not tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from sqlease.errors import ConfigurationError
from sqlease.transactions import open_transactions
from sqlease.types import NewMessage

__all__ = ["Batch", "batch", "open_batch"]

#: Writes a batch's messages (``Transport.publish_batch``), in the caller's transaction if one
#: is open.
Flush = Callable[[Sequence[NewMessage]], Any]


class Batch:
    """The messages of an open ``batch()`` block, by the database they go to."""

    def __init__(self) -> None:
        #: The transactions open when the block began (the publish must join the same).
        self.transactions = open_transactions()
        #: The database's key, its messages and how to write them (one database).
        self._key: object = None
        self._flush: Flush | None = None
        self.messages: list[NewMessage] = []
        #: The first error that refused the batch (raised again at the end if caught).
        self.refused: BaseException | None = None

    def add(
        self,
        key: object,
        messages: Sequence[NewMessage],
        flush: Flush,
        check: Callable[[NewMessage, int], Any],
    ) -> None:
        """Hold ``messages`` for the database ``key``, each first checked by
        ``check(message, index)`` (its error refuses the batch)."""
        try:
            if open_transactions() != self.transactions:
                raise ConfigurationError(
                    "a transaction (sqlease.transaction() or one a framework joins, such as "
                    "Django's atomic()) was opened or closed inside sqlease.batch(): the "
                    "batch would escape it. Open the batch inside the transaction; nothing "
                    "of the batch was published"
                )
            if self._flush is not None and key != self._key:
                raise ConfigurationError(
                    "a sqlease.batch() publishes to one database; this message goes to "
                    "another broker's: nothing of the batch was published"
                )
            for message in messages:
                check(message, len(self.messages))
                self.messages.append(message)
        except BaseException as exc:
            self.refused = self.refused or exc
            raise
        if self._flush is None:
            self._key, self._flush = key, flush

    def publish(self) -> None:
        """Write the held messages (one transaction), unless the batch was refused."""
        if self.refused is not None:
            raise self.refused
        if self._flush is not None and self.messages:
            messages, self.messages = self.messages, []
            self._flush(messages)


_current: ContextVar[Batch | None] = ContextVar("sqlease_batch", default=None)


def open_batch() -> Batch | None:
    """The batch open in this thread (or task), if any."""
    return _current.get()


@contextmanager
def batch() -> Iterator[Batch]:
    """Publish every sqlease task sent inside the block in one transaction when it ends, all
    or nothing (see the module's docstring). Nested blocks join the outermost."""
    outer = _current.get()
    if outer is not None:
        try:
            yield outer
        except BaseException as exc:
            outer.refused = outer.refused or exc
            raise
        return
    scope = Batch()
    token = _current.set(scope)
    try:
        yield scope
    finally:
        # Whatever happens next, a publish after the block is not held.
        _current.reset(token)
    scope.publish()
