"""A worker cut off from PostgreSQL (or stopped) in the middle of a transaction keeps the rows
it locked until the server ends that transaction; every other worker's claim skips a locked
message, whatever its lease says. The sessions of sqlease's engines end a transaction left
idle for a lease (sqlease._db.postgresql.engine.session_options): the message is claimed
again then, not after PostgreSQL's own default (never) or a fixed minute. Real time, against
a real server: a second or two."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from sqlease import Store

from .test_store_processes import fresh_store

pytestmark = [pytest.mark.pg, pytest.mark.concurrency]

#: The store's lease: its sessions end a transaction left idle this long.
STORE_LEASE_MS = 2_000


@pytest.mark.timeout(60)
def test_a_transaction_cut_off_mid_way_frees_its_message_with_the_lease(
    pg_database_url: str,
) -> None:
    made = fresh_store(pg_database_url)
    store = Store(pg_database_url, table_prefix=made.tables.prefix, lease_ms=STORE_LEASE_MS)
    store.enqueue("q", "{}", task_id="t1")
    [message] = store.claim(["q"], "a", lease_ms=300)
    # A's checkpoint, as far as it got: the message's row locked (its lease renewed in the
    # first statement), then the network went; the commit never came.
    stalled = store.driver.engine.connect()
    stalled.begin()
    stalled.execute(
        text(f"SELECT id FROM {store.tables.messages.name} WHERE id = :id FOR UPDATE"),
        {"id": message.id},
    )
    locked_at = time.monotonic()
    time.sleep(0.5)
    # The lease has expired, but the row is locked: B's claim steps over it.
    assert store.claim(["q"], "b", lease_ms=60_000) == []
    deadline = locked_at + STORE_LEASE_MS / 1000 + 10
    while not (taken := store.claim(["q"], "b", lease_ms=60_000)):
        assert time.monotonic() < deadline, "the stalled transaction still holds the message"
        time.sleep(0.1)
    freed_after = time.monotonic() - locked_at
    assert [m.id for m in taken] == [message.id] and taken[0].attempt == 2
    # The server ended A's transaction after about the store's lease.
    assert STORE_LEASE_MS / 1000 <= freed_after < STORE_LEASE_MS / 1000 + 2, freed_after
    with pytest.raises(DBAPIError, match="idle-in-transaction timeout"):
        stalled.execute(text("SELECT 1"))
    stalled.invalidate()
    stalled.close()
