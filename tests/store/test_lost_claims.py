"""A claim that committed on PostgreSQL but whose answer was lost (the connection dropped
between the commit and the reply) leased messages its worker never learnt of. Before the
claim is sent again, what it leased is released with the attempt refunded, found by the
claim's mark in its batch event: the messages are delivered at once, with no delivery of
the budget spent, instead of waiting out a lease and coming back one attempt closer to
``attempts_exhausted``.

The blocking path (the store's retry) is tested here through a TCP proxy that drops the
claim's answer; the event loop's (sqlease.transport._loop_calls) in
tests/transport/test_loop_calls.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from e2e.tcp_proxy import StallingProxy
from sqlease import Store
from sqlease._db.driver import Claim
from sqlease.types import NewMessage

pytestmark = [pytest.mark.pg, pytest.mark.timeout(60)]

#: A marker of every claim statement's text (its leasing CTE).
CLAIM_SQL = b"claimed AS (UPDATE"


@pytest.fixture
def prefix() -> str:
    return f"lostclaim{uuid.uuid4().hex[:8]}_"


@pytest.fixture
def direct(pg_database_url: str, prefix: str) -> Iterator[Store]:
    store = Store(pg_database_url, table_prefix=prefix)
    yield store
    store.engine.dispose()


@pytest.fixture
def proxy(pg_database_url: str) -> Iterator[StallingProxy]:
    proxy = StallingProxy.to(pg_database_url)
    yield proxy
    proxy.close()


@pytest.fixture
def through(pg_database_url: str, proxy: StallingProxy, prefix: str) -> Iterator[Store]:
    """A store on the same tables that reaches the server through ``proxy``."""
    store = Store(proxy.through(pg_database_url), table_prefix=prefix)
    yield store
    store.engine.dispose()


def _kinds(store: Store, task_id: str) -> list[tuple[str, int | None, object]]:
    return [(e.kind, e.attempt, e.data) for e in store.events(task_id=task_id)]


def _budget(store: Store, message_id: int) -> int:
    with store.engine.connect() as conn:
        found = conn.execute(
            text(f"SELECT max_attempts FROM {store.tables.messages.name} WHERE id = :id"),
            {"id": message_id},
        )
        return int(found.scalar_one())


def test_a_claim_whose_answer_was_lost_gives_its_messages_to_its_retry(
    proxy: StallingProxy, direct: Store, through: Store
) -> None:
    [message_id] = direct.enqueue_many([NewMessage(queue="q", payload="p", task_id="t1")])
    proxy.lose_answer(CLAIM_SQL)
    started = time.monotonic()
    delivered = through.claim(["q"], "w1", lease_ms=60_000, limit=5)
    assert proxy.answers_lost == 1  # the first try's answer really was dropped
    # The retry has it at once (not after the 60 s lease), its budget intact.
    assert [m.id for m in delivered] == [message_id]
    assert time.monotonic() - started < 10
    assert delivered[0].attempt == 2
    assert _budget(direct, message_id) == 3 + 1
    kinds = _kinds(direct, "t1")
    assert [(k, a) for k, a, _ in kinds] == [
        ("enqueued", 0),
        ("claimed", 1),
        ("released", 1),
        ("claimed", 2),
    ]
    assert kinds[2][2] == {"refund": True}
    assert kinds[1][2]["owner"] == "w1" and kinds[1][2]["claim"]  # type: ignore[index]
    assert not through.driver.lost_claims.owed


def test_the_release_takes_only_what_the_lost_claim_leased_and_its_owner_holds(
    direct: Store,
) -> None:
    # The statements read the server's clock (the machine's); a minute ago, a lease of 1 ms
    # taken then has run out now, without waiting.
    minute_ago = int(time.time() * 1000) - 60_000
    messages = [NewMessage(queue="q", payload=str(i)) for i in range(4)]
    ids = direct.enqueue_many(messages, now=minute_ago - 1_000)
    driver = direct.driver

    def claim(owner: str, lease_ms: int = 60_000, now: int | None = None) -> tuple[str, list[int]]:
        op = driver.message_claim(Claim(["q"], owner, lease_ms, 1, now))
        assert op.claim_mark is not None and op.claim_mark[0] == owner
        return op.claim_mark[1], [m.id for m in driver.execute(op)]

    lost, first = claim("w1")
    _kept, second = claim("w1")  # answered: w1 knows this one
    other, third = claim("w2")  # another owner's, marked alike
    short, fourth = claim("w1", lease_ms=1, now=minute_ago)  # w1's lease that ran out
    assert [first, second, third, fourth] == [[i] for i in ids]
    since = time.monotonic()
    released = driver.execute(driver.release_lost_claims("w1", [lost, other, short], since))
    assert released == set(first)
    # Another owner's mark, or a mark none of w1's claims carried, releases nothing.
    assert driver.execute(driver.release_lost_claims("w2", [lost, "nomark"], since)) == set()
    again = direct.claim(["q"], "w3", lease_ms=60_000, limit=4)
    assert sorted(m.id for m in again) == sorted(first + fourth)
    assert _budget(direct, first[0]) == 4 and _budget(direct, fourth[0]) == 3


def test_a_claim_that_failed_before_it_ran_leaves_nothing_to_release(
    proxy: StallingProxy, direct: Store, through: Store
) -> None:
    [message_id] = direct.enqueue_many([NewMessage(queue="q", payload="p", task_id="t2")])
    through.claim(["other"], "w1", lease_ms=60_000)  # connected, tables known
    proxy.down()  # every connection dropped, none made until it is up
    proxy.up()
    delivered = through.claim(["q"], "w1", lease_ms=60_000)
    assert [(m.id, m.attempt) for m in delivered] == [(message_id, 1)]
    assert [k for k, _, _ in _kinds(direct, "t2")] == ["enqueued", "claimed"]
