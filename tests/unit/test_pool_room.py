"""A Celery worker's free pool processes, as the transport's offers see them
(sqlease._celery.pool_room): known only in the worker's own process, once its pool runs."""

from __future__ import annotations

import os
from typing import Any

import pytest
from celery.worker import state

from sqlease._celery import pool_room


class _Pool:
    def __init__(self, size: int | None) -> None:
        self._size = size

    @property
    def num_processes(self) -> int:
        if self._size is None:
            raise AttributeError("_pool")  # billiard's pool before it starts
        return self._size


class _Worker:
    def __init__(self, pool: _Pool | None) -> None:
        self.pool = pool


class _Request:
    pass


@pytest.fixture(autouse=True)
def _forget() -> Any:
    yield
    pool_room._worker = None
    pool_room._pid = 0


def test_the_pool_size_and_the_tasks_received_and_not_finished() -> None:
    worker = _Worker(_Pool(3))
    pool_room.remember(worker)
    requests = [_Request(), _Request()]
    for r in requests:
        state.reserved_requests.add(r)  # type: ignore[arg-type]
    try:
        assert pool_room.load() == (3, len(state.reserved_requests))
    finally:
        for r in requests:
            state.reserved_requests.discard(r)  # type: ignore[arg-type]


def test_nothing_is_known_before_the_pool_runs_or_outside_the_worker() -> None:
    assert pool_room.load() is None  # no worker in this process
    worker = _Worker(None)
    pool_room.remember(worker)
    assert pool_room.load() is None  # its pool not made yet
    worker.pool = _Pool(None)
    assert pool_room.load() is None  # made, not started
    worker.pool = _Pool(2)
    assert pool_room.load() is not None
    pool_room._pid = os.getpid() + 1  # a forked child: the parent's worker is not its own
    assert pool_room.load() is None
    pool_room.remember(object())  # not weak-referenceable: a stand-in, not a worker
    assert pool_room.load() is None


def test_a_stopped_pool_or_worker_is_forgotten() -> None:
    pool = _Pool(2)
    worker = _Worker(pool)
    pool_room.remember(worker)
    assert pool_room.load() is not None
    pool.active = False  # type: ignore[attr-defined]  # BasePool.active: its state is RUN
    assert pool_room.load() is None
    pool.active = True  # type: ignore[attr-defined]
    pool_room.forget(_Worker(pool))  # another worker's shutdown: not this one's
    assert pool_room.load() is not None
    pool_room.forget(worker)
    assert pool_room.load() is None
