"""PostgreSQL: claims and acks commit without waiting for the WAL flush (unless
``lease_sync_commit``); publishes and results always wait. A claim or ack lost with the server
only redelivers its message; a publish or result lost would lose work."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from conftest import unique_prefix
from sqlease._core.results import ResultStore
from sqlease._db.driver import Lane, Op
from sqlease._db.engine import get_engine
from sqlease._db.postgresql.direct import DirectLane
from sqlease._db.postgresql.engine import (
    GENERIC_PLANS_OPTION,
    NO_FLUSH_WAIT_OPTION,
    SESSION_OPTIONS,
)
from sqlease._db.postgresql.engine import connect_args as postgresql_connect_args
from sqlease._db.postgresql.lanes import NoFlushLane
from sqlease.errors import ConfigurationError
from sqlease.options import TransportOptions
from sqlease.store import NewMessage, Store
from sqlease.types import Outcome

SHOW = text("SELECT current_setting('synchronous_commit') AS sync")


def _sync(fast: DirectLane | NoFlushLane) -> str:
    fast._engine.dispose()  # process-wide engines: an earlier test may have killed their pool
    [row] = fast.rows(SHOW, {})
    return str(row["sync"])


def _commit_levels_of_publishes(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ``synchronous_commit`` each publish that is a transaction runs under, as it runs
    (a single publish's, and a batch's: several rows)."""
    seen: list[str] = []

    def spy(real: Any) -> Any:
        def publish(rows: Any, now: Any, **kw: Any) -> Op[Any]:
            op = real(rows, now, **kw)
            body = op.body
            if body is None:
                return op

            def spied(conn: Any) -> Any:
                seen.append(str(conn.execute(SHOW).scalar()))
                return body(conn)

            return dataclasses.replace(op, body=spied)

        return publish

    for name in ("message_publish", "message_publish_batch"):
        monkeypatch.setattr(store.driver, name, spy(getattr(store.driver, name)))
    return seen


def test_the_lease_engine_turns_the_flush_wait_off_and_the_urls_options_still_win() -> None:
    url = make_url("postgresql+psycopg://u@h/db")
    leases = postgresql_connect_args(url, generic_plans=True, wait_for_flush=False)
    assert leases["options"] == f"{SESSION_OPTIONS} {GENERIC_PLANS_OPTION} {NO_FLUSH_WAIT_OPTION}"
    assert NO_FLUSH_WAIT_OPTION not in postgresql_connect_args(url, generic_plans=True)["options"]
    own = postgresql_connect_args(
        make_url("postgresql+psycopg://u@h/db?options=-csynchronous_commit%3Dremote_apply"),
        generic_plans=True,
        wait_for_flush=False,
    )
    # A URL that asks for its own commit level gets it: its options come last.
    assert own["options"].endswith(f"{NO_FLUSH_WAIT_OPTION} -csynchronous_commit=remote_apply")


@pytest.mark.pg
def test_only_the_lease_traffic_skips_the_flush_wait(pg_database_url: str) -> None:
    store = Store(pg_database_url, table_prefix=unique_prefix())
    assert _sync(store.driver.lane(Lane.LEASES)) == "off"
    assert _sync(store.driver.lane(Lane.DEFAULT)) == "on"  # publishes and results
    assert (
        _sync(store.driver.lane(Lane.PLANNED)) == "on"
    )  # offers, and everything on the main engine
    with store.engine.connect() as conn:
        assert conn.execute(SHOW).scalar() == "on"


@pytest.mark.pg
def test_lease_sync_commit_keeps_claims_and_acks_waiting(pg_database_url: str) -> None:
    store = Store(pg_database_url, table_prefix=unique_prefix(), lease_sync_commit=True)
    assert store.driver.lane(Lane.LEASES) is store.driver.lane(Lane.DEFAULT)
    assert _sync(store.driver.lane(Lane.LEASES)) == "on"


@pytest.mark.pg
def test_each_statement_runs_on_the_engine_its_durability_needs(
    pg_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(pg_database_url, table_prefix=unique_prefix())
    ran: list[tuple[str, Any]] = []
    lanes = {"fast": Lane.DEFAULT, "fast_leases": Lane.LEASES, "fast_planned": Lane.PLANNED}
    for name, lane in lanes.items():
        fast = store.driver.lane(lane)
        real = fast.rows

        def spy(statement: Any, params: Any, _real: Any = real, _name: str = name) -> Any:
            ran.append((_name, statement))
            return _real(statement, params)

        monkeypatch.setattr(fast, "rows", spy)

    def on(statement: Any) -> set[str]:
        return {name for name, s in ran if s is statement}

    def publish(task_id: str) -> None:
        store.enqueue_many([NewMessage(queue="q", payload="{}", task_id=task_id, record=True)])

    publish("t1")
    publish("t2")
    publish("t3")
    [first] = store.claim(["q"], "w", lease_ms=60_000, limit=1)
    acked, [second] = store.ack_and_claim([first.fence], ["q"], "w", lease_ms=60_000, limit=1)
    assert acked == {first.id}
    results = ResultStore(store)
    stored = results.put("celery-task-meta-t2", b"4", state="SUCCESS", fence=second.fence)
    assert stored is Outcome.UPDATED
    assert store.ack([second.fence]) == {second.id}
    assert on(store.sql.enqueue) == {"fast"}
    assert on(store.sql.result_put) == {"fast"}
    # Plain messages: the claims without the held-work checks, their acks (outside any run)
    # without the runs' promotion (plain_claims).
    assert on(store.sql.claim_plain_single) == {"fast_leases"}
    assert on(store.sql.ack_outside_runs_claim_plain_single) == {"fast_leases"}
    assert on(store.sql.ack_outside_runs) == {"fast_leases"}
    store.enqueue("q", "in a run", run_id="r")
    store.enqueue("q", "behind it", run_id="r")
    # t3, then the run's head: the plain claim stops in front of it, the full one takes it.
    third, head = store.claim(["q"], "w", lease_ms=60_000, limit=3)
    assert (third.task_id, head.payload) == ("t3", "in a run")
    store.ack_and_claim([third.fence, head.fence], ["q"], "w", lease_ms=60_000, limit=1)
    assert on(store.sql.claim_single) == {"fast_leases"}
    assert on(store.sql.ack_claim_single) == {"fast_leases"}
    [behind] = store.claim(["q"], "w", lease_ms=60_000, limit=1)
    assert store.ack([behind.fence]) == {behind.id}
    assert on(store.sql.ack) == {"fast_leases"}


def test_lease_sync_commit_is_a_boolean_option() -> None:
    assert TransportOptions.parse({}).lease_sync_commit is False
    assert TransportOptions.parse({"lease_sync_commit": "yes"}).lease_sync_commit is True
    with pytest.raises(ConfigurationError, match="lease_sync_commit"):
        TransportOptions.parse({"lease_sync_commit": "sometimes"})


def test_publish_sync_commit_is_a_boolean_option_on_by_default() -> None:
    assert TransportOptions.parse({}).publish_sync_commit is True
    assert TransportOptions.parse({"publish_sync_commit": "off"}).publish_sync_commit is False
    with pytest.raises(ConfigurationError, match="publish_sync_commit"):
        TransportOptions.parse({"publish_sync_commit": "later"})


@pytest.mark.pg
@pytest.mark.parametrize("lease_sync_commit", [False, True])
def test_publish_sync_commit_off_moves_publishes_off_the_flush_wait(
    pg_database_url: str, lease_sync_commit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(
        pg_database_url,
        table_prefix=unique_prefix(),
        lease_sync_commit=lease_sync_commit,
        publish_sync_commit=False,
    )
    assert _sync(store.driver.lane(Lane.PUBLISH)) == "off"
    assert _sync(store.driver.lane(Lane.DEFAULT)) == "on"  # results still wait
    assert _sync(store.driver.lane(Lane.LEASES)) == ("on" if lease_sync_commit else "off")
    ran: list[Any] = []
    assert store.driver.lane(Lane.PUBLISH) is not None
    real = store.driver.lane(Lane.PUBLISH).rows

    def spy(statement: Any, params: Any) -> Any:
        ran.append(statement)
        return real(statement, params)

    monkeypatch.setattr(store.driver.lane(Lane.PUBLISH), "rows", spy)
    [one] = store.enqueue_many([NewMessage(queue="q", payload="{}", task_id="t1")])
    assert ran == [store.sql.enqueue]
    # Several rows in one transaction: that transaction's commit skips the wait, and the
    # pooled session it ran on keeps waiting afterwards.
    seen = _commit_levels_of_publishes(store, monkeypatch)
    two = store.enqueue_many([NewMessage(queue="q", payload="{}", task_id=f"t{i}") for i in (2, 3)])
    assert seen == ["off"]
    with store.engine.connect() as conn:
        assert conn.execute(SHOW).scalar() == "on"
    # Nothing is lost by it: all three are delivered, in order.
    claimed = store.claim(["q"], "w", lease_ms=60_000, limit=5)
    assert [m.id for m in claimed] == [one, *two]


@pytest.mark.pg
def test_publishes_wait_for_the_flush_by_default(pg_database_url: str) -> None:
    store = Store(pg_database_url, table_prefix=unique_prefix())
    assert store.driver.lane(Lane.PUBLISH) is store.driver.lane(Lane.DEFAULT)
    assert _sync(store.driver.lane(Lane.PUBLISH)) == "on"


@pytest.mark.pg
def test_an_engine_passed_in_skips_the_flush_for_its_publishes_transaction(
    pg_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = get_engine(pg_database_url)
    store = Store(engine, table_prefix=unique_prefix(), publish_sync_commit=False)
    # The app's engine has no no-flush pool of sqlease's: each publish is a transaction of
    # its own that skips the flush (SET LOCAL), one row as several.
    lane = store.driver.lane(Lane.PUBLISH)
    assert isinstance(lane, NoFlushLane)
    assert _sync(lane) == "off"
    seen = _commit_levels_of_publishes(store, monkeypatch)
    [one] = store.enqueue_many([NewMessage(queue="q", payload="{}", task_id="t1")])
    store.enqueue_many([NewMessage(queue="q", payload="{}", task_id=f"t{i}") for i in (2, 3)])
    assert seen == ["off"]
    with engine.connect() as conn:
        assert conn.execute(SHOW).scalar() == "on"
    [claimed] = store.claim(["q"], "w", lease_ms=60_000, limit=1)
    assert claimed.id == one
