"""SQLite: a busy worker's claim takes the acks waiting to be written with it, in one
transaction (one write lock, one commit), in a real Kombu ``Hub``."""

from __future__ import annotations

from typing import Any

import pytest
from kombu.asynchronous import Hub

import sqlease.transport._acks as acks_module
from sqlease import Store

from .test_background_claims import Connect, holding_eight, hub, run_until, threads_of
from .test_kombu import leased_rows, msg_id, rows

__all__ = ["hub"]  # the fixture, shared

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
]


def test_the_refill_claim_writes_the_waiting_acks_in_its_transaction(
    connect: Connect, db_store: Store, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The acks' own timer must not write them first: only the claim may.
    monkeypatch.setattr(acks_module, "ACK_DELAY", 30.0)
    worker, got = holding_eight(connect, hub, 12)
    store = worker.transport.store
    combined = threads_of(monkeypatch, store, "ack_and_claim_op")
    plain_acks = threads_of(monkeypatch, store, "ack_op")
    for message in got[:4]:
        message.ack()
    assert len(worker.transport.fetcher.acks.pending) == 4  # deferred
    run_until(hub, lambda: len(got) == 12)
    assert [sorted(f.message_id for f in fences) for _, fences in combined] == [
        sorted(msg_id(m) for m in got[:4])
    ]
    assert plain_acks == []
    assert worker.transport.fetcher.acks.pending == []
    assert not worker.transport.fetcher.outage._leaving  # answered with the claim
    assert rows(db_store, "work") == 8
    assert sorted(m.id for m in leased_rows(db_store)) == sorted(msg_id(m) for m in got[4:])
    worker.release()


def test_a_failed_combined_claim_keeps_its_acks_for_the_next_write(
    connect: Connect, db_store: Store, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(acks_module, "ACK_DELAY", 30.0)
    worker, got = holding_eight(connect, hub, 12)
    store = worker.transport.store
    real = store.ack_and_claim_op
    failures: list[Any] = []

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        if not failures:
            failures.append(args[0])
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "ack_and_claim_op", failing_once)
    for message in got[:4]:
        message.ack()
    channel = worker.default_channel
    with pytest.raises(RuntimeError, match="injected"):
        channel.drain_events()
    # Nothing was written, and nothing is lost: the acks wait again, and their timer is set.
    assert len(worker.transport.fetcher.acks.pending) == 4
    assert worker.transport.fetcher.acks.timer_set
    assert rows(db_store, "work") == 12
    run_until(hub, lambda: len(got) == 12)
    assert rows(db_store, "work") == 8
    worker.release()
