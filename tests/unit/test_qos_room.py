"""The transport's QoS: the credit of a claim, and when a worker waits to refill, with the pool
of the Celery worker in the process (sqlease._celery.pool_room) and Celery's
``worker_disable_prefetch`` (the task room the consumer step sets)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery.worker import state

from sqlease._celery import pool_room
from sqlease.transport._qos import QoS


class _Pool:
    def __init__(self, size: int) -> None:
        self.num_processes = size


class _Worker:
    def __init__(self, size: int) -> None:
        self.pool = _Pool(size)


class _Request:
    pass


@pytest.fixture
def reserved() -> Iterator[list[_Request]]:
    """Requests the worker received and has not finished (Celery's own bookkeeping)."""
    requests: list[_Request] = []
    yield requests
    for r in requests:
        state.reserved_requests.discard(r)  # type: ignore[arg-type]
    pool_room._worker = None
    pool_room._pid = 0


def _receive(reserved: list[_Request], n: int) -> None:
    for _ in range(n):
        r = _Request()
        reserved.append(r)
        state.reserved_requests.add(r)  # type: ignore[arg-type]


def _qos(prefetch: int, held: int) -> QoS:
    qos = QoS(object(), prefetch)
    for i in range(held):
        qos.append(object(), f"{i}.1")
    return qos


def test_the_credit_is_the_free_prefetch_and_no_more_than_the_task_room() -> None:
    qos = _qos(8, 3)
    assert qos.credit() == 5 and qos.can_consume()
    qos.task_room = lambda: 2
    assert qos.credit() == 2 and qos.can_consume()
    qos.task_room = lambda: 0
    assert qos.credit() == 0 and not qos.can_consume()
    qos.task_room = lambda: -1  # more held than the pool runs (a handoff came meanwhile)
    assert qos.credit() == 0 and not qos.can_consume()


def test_without_a_prefetch_limit_only_the_task_room_limits() -> None:
    qos = _qos(0, 40)
    assert qos.credit() is None and qos.can_consume()
    qos.task_room = lambda: 3
    assert qos.credit() == 3


def test_a_worker_with_an_idle_process_does_not_wait_to_refill(reserved: Any) -> None:
    qos = _qos(8, 5)  # five held, three of the prefetch of eight free: under half
    assert qos.refill_later()  # outside a worker: wait for half the credit
    eight, four = _Worker(8), _Worker(4)  # (remembered by weak reference)
    pool_room.remember(eight)
    _receive(reserved, 5)
    assert not qos.refill_later()  # all five run, three processes idle: claim now
    pool_room.remember(four)
    assert qos.refill_later()  # one of the five waits for a process: refill later


def test_a_small_or_unlimited_prefetch_never_waits_to_refill() -> None:
    assert not _qos(4, 3).refill_later()
    assert not _qos(0, 3).refill_later()
    assert not _qos(8, 0).refill_later()


def test_deliveries_on_their_way_take_credit() -> None:
    """Redelivered messages being checked for a stored result are delivered next: they
    count as taken, so nothing (a handoff, another claim) is accepted beyond the prefetch
    meanwhile, and the worker has no room for a handoff."""
    qos = _qos(8, 3)
    qos.settling = 4
    assert qos.credit() == 1 and qos.can_consume()
    qos.settling = 5
    assert qos.credit() == 0 and not qos.can_consume()
    assert qos.can_consume_max_estimate() == 0 and qos.unacked_count() == 3
    assert qos.held_besides(["0.1"]) == 7 and qos.holds_besides(["0.1", "1.1", "2.1"])
    qos.settling = 0
    assert qos.credit() == 5 and qos.can_consume()
    assert qos.held_besides(["0.1"]) == 2 and not qos.holds_besides(["0.1", "1.1", "2.1"])


def test_deliveries_on_their_way_delay_the_refill_like_held_ones() -> None:
    qos = _qos(8, 3)  # five of eight free: claims now
    assert not qos.refill_later()
    qos.settling = 2  # three free: waits for half
    assert qos.refill_later()


def test_the_task_room_counts_deliveries_on_their_way(reserved: Any) -> None:
    """``worker_disable_prefetch``: the pool's room less the tasks received and those on
    their way, acked early or late."""
    from types import SimpleNamespace

    from sqlease._celery.no_prefetch import NoPrefetch

    qos = _qos(0, 1)  # one acked late (also received)
    _receive(reserved, 2)  # and one acked early: two received
    channel = SimpleNamespace(qos=qos)
    app = SimpleNamespace(conf={"worker_disable_prefetch": True})
    consumer = SimpleNamespace(
        app=app, task_consumer=SimpleNamespace(channel=channel), controller=_Worker(4)
    )
    NoPrefetch.start(object.__new__(NoPrefetch), consumer)
    assert qos.task_room is not None and qos.task_room() == 2
    qos.settling = 1
    assert qos.task_room() == 1 and qos.credit() == 1
    qos.settling = 2
    assert qos.task_room() == 0 and not qos.can_consume()
