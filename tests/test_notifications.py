"""PostgreSQL wake-ups: what announces itself on the store's notification channel (workers
LISTEN on it, see docs/transport.md, "Wake-ups")."""

from __future__ import annotations

import psycopg
import pytest

from conftest import unique_prefix
from sqlease import Store

pytestmark = pytest.mark.pg


def test_a_publish_names_its_queue(pg_database_url: str) -> None:
    store = Store(pg_database_url, table_prefix=unique_prefix())
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{store.notify_channel}"')
        store.enqueue("a", "1")
        store.enqueue("b", "2", delay_ms=60_000)  # a delayed one too: its due time is looked up
        heard = [n.payload for n in listener.notifies(timeout=0.3, stop_after=5)]
    assert heard == ["a", "b"]


def test_a_release_to_claim_now_wakes_idle_workers(pg_database_url: str) -> None:
    """Released messages (warm shutdown, requeue) are announced like a publish, so an idle
    worker takes them at once instead of at its next safety poll; a delayed release, a park
    or a failure announce nothing."""
    store = Store(pg_database_url, table_prefix=unique_prefix())
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{store.notify_channel}"')

        def heard() -> list[str]:
            return [n.payload for n in listener.notifies(timeout=0.3, stop_after=5)]

        for n in range(4):
            store.enqueue("jobs", f"m{n}")
        assert heard() == ["jobs"] * 4
        first, second, third, fourth = store.claim(["jobs"], "w", lease_ms=60_000, limit=4)
        assert store.release([first.fence]) == {first.id}
        assert heard() == ["jobs"]
        assert store.release([second.fence], delay_ms=5_000) == {second.id}
        assert store.park(third.fence, "paused") and store.fail(fourth.fence, "rejected")
        assert heard() == []
