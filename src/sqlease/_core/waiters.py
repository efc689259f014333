"""Who waits for results: the advisory locks that decide whether a result's write notifies
(PostgreSQL).

A notification costs the database server about 130 us of CPU per write (PostgreSQL signals
every listening session of the database, whatever its channel): about a seventh of a drain
whose results nobody waits for. So a write notifies only while some client waits.

- A waiting client's LISTEN connection, once it listens, takes a shared advisory lock on each
  of the ``WAITER_KEYS`` keys (``waiter_keys``) and holds them while it lives. Only then does
  its waiter read whether the result is there.
- A result's write tries an exclusive lock on one of those keys (``waiter_key``, by the
  result's key) in its own statement, and notifies if that try fails. If it succeeds, no
  client was waiting, and the write holds the lock until its commit: a client that starts to
  wait meanwhile blocks on its shared lock until the write is committed, and its read then
  finds the result. Either the write sees the waiter or the waiter's read sees the write.
- Two writes at once that try the same key: one fails and notifies for nothing. With
  several keys, a write's key is usually free (taken by another write with a chance of about
  one in sixteen per write under way).
- A result's write must be a statement of its own in autocommit (``result_put``): in a
  longer transaction it would hold its key, and keep new waiters blocked, until that ends.
- A waiter that finds every result it wants at its first read need not listen at all
  (sqlease.backend._waits reads before it listens), so that a join of results already
  stored, such as a chord's last part, does not turn the notifications on.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence

#: The keys a waiting client holds, shared; a write tries one of them (a power of two).
WAITER_KEYS = 16
assert WAITER_KEYS & (WAITER_KEYS - 1) == 0


def waiter_keys(channel: str) -> list[int]:
    """The advisory-lock keys (signed 64-bit) of the clients waiting on ``channel``."""
    digest = hashlib.blake2b(f"sqlease-result-waiters:{channel}".encode(), digest_size=8)
    base = int.from_bytes(digest.digest(), "big", signed=True) & ~(WAITER_KEYS - 1)
    return [base | i for i in range(WAITER_KEYS)]


def waiter_key(keys: Sequence[int], result_key: str) -> int:
    """The one of ``keys`` the write of ``result_key`` tries."""
    return keys[zlib.crc32(result_key.encode("utf-8")) % len(keys)]
