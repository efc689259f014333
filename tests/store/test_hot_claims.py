"""Claims and renewals are HOT updates on PostgreSQL (migration 14): no index of the messages
names a column they write (the lease's owner and expiry, the attempt), not even in its WHERE,
so PostgreSQL rewrites the row on its own page and adds no entry to any index. With such an
index every claim and every renewal added one entry to each index of the messages (the
store's claim-then-ack loop ran 18% slower, benchmarks/store.py)."""

from __future__ import annotations

import re
import time

import pytest
from sqlalchemy import create_engine, inspect, text, update
from sqlalchemy.pool import NullPool

from conftest import unique_prefix
from sqlease import Store
from sqlease._db.migrations import CURRENT_VERSION, read_version
from sqlease.store import NewMessage

pytestmark = pytest.mark.pg

#: What a claim or a renewal writes on a ready message without limits.
WRITTEN = ("lease_owner", "lease_expires_at_ms", "attempt")


def index_definitions(store: Store) -> dict[str, str]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = :t"),
            {"t": store.tables.messages.name},
        )
        return {name: definition for name, definition in rows}


def test_no_index_of_the_messages_names_what_a_claim_writes(pg_database_url: str) -> None:
    store = Store(pg_database_url, table_prefix=unique_prefix())
    found = index_definitions(store)
    assert f"{store.tables.messages.name}_claim_ix" in found
    for name, definition in found.items():
        for column in WRITTEN:
            assert not re.search(rf"\b{column}\b", definition), (name, definition)


def test_claims_and_renewals_are_hot_updates(pg_database_url: str) -> None:
    # Each statement on a connection of its own (NullPool): the server process reports its
    # statistics as it exits.
    engine = create_engine(pg_database_url, poolclass=NullPool)
    store = Store(engine, table_prefix=unique_prefix())
    store.enqueue_many(
        [NewMessage("q", "x" * 200, task_id=f"t{i}", task_name="t.noop") for i in range(200)]
    )
    # As a worker prefetching 8 does: claimed, renewed, acked 8 at a time. (One statement
    # that rewrites every row of a page at once, or a table of a few pages, may find no
    # room left on a page, HOT or not.)
    for _ in range(25):
        claimed = store.claim(["q"], "w", lease_ms=60_000, limit=8)
        assert len(store.renew([m.fence for m in claimed], lease_ms=60_000)) == 8
        assert len(store.ack([m.fence for m in claimed])) == 8
    query = text("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = :t")
    deadline = time.monotonic() + 20
    with create_engine(pg_database_url, poolclass=NullPool).connect() as conn:
        while True:
            updated, hot = conn.execute(query, {"t": store.tables.messages.name}).one()
            if updated >= 400 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    # All of them on a quiet server (400 of 400); with other sessions busy a page may be
    # pruned late and an update go to another page (333 of 400 seen beside the suite).
    # With an index naming the lease, none is HOT.
    assert updated == 400 and hot >= updated // 2
    engine.dispose()


def test_a_version_13_database_gets_its_lease_indexes_dropped(pg_database_url: str) -> None:
    """Version 14 drops the indexes that named the lease (the leftover-lease index and the
    gate index with the expiry), clears the leases left on rows that are not ready (their
    index is gone with it), and indexes a gate's ready rows instead."""
    prefix = unique_prefix()
    old = Store(pg_database_url, table_prefix=prefix)
    m = old.tables.messages.name
    old.enqueue("q", "x", task_id="stray")
    old.enqueue("q", "y", task_id="ready")
    with old.engine.begin() as conn:  # as version 13 left it, with a lease left on a parked row
        conn.execute(text(f"DROP INDEX {m}_gate_ready_ix"))
        conn.execute(
            text(
                f"CREATE INDEX {m}_gate_ix ON {m} (gate, lease_expires_at_ms) "
                "WHERE gate IS NOT NULL"
            )
        )
        conn.execute(
            text(
                f"CREATE INDEX {m}_stray_ix ON {m} (id) "
                "WHERE state != 'ready' AND lease_owner IS NOT NULL"
            )
        )
        conn.execute(
            text(
                f"UPDATE {m} SET state = 'parked', reason = 'paused', lease_owner = 'gone', "
                "lease_expires_at_ms = 1 WHERE task_id = 'stray'"
            )
        )
        conn.execute(update(old.tables.schema_version).values(version=13))
    new = Store(pg_database_url, table_prefix=prefix)
    with new.driver.reading() as conn:
        assert read_version(conn, new.tables) == CURRENT_VERSION
        indexes = {i["name"] for i in inspect(conn).get_indexes(m)}
        assert f"{m}_gate_ready_ix" in indexes
        assert not {f"{m}_gate_ix", f"{m}_stray_ix"} & indexes
        leases = conn.execute(text(f"SELECT task_id, lease_owner FROM {m} ORDER BY id")).all()
    assert [tuple(r) for r in leases] == [("stray", None), ("ready", None)]
    [message] = new.claim(["q"], "w", lease_ms=1000)
    assert message.task_id == "ready"
