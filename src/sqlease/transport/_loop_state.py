"""The records of sqlease.transport._loop_calls: the statement under way, the one waiting for
its connection or its backoff, and the blocking wait for a statement's socket (``wait_idle``)."""

from __future__ import annotations

import select
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from sqlease._db.driver import WAIT_READ, WAIT_WRITE, Op, Pending
from sqlease.transport._background import Done, Job


@dataclass(slots=True)
class Attempt:
    """An op and the jobs it answers, with until when (and after what next backoff) a
    dropped connection is ridden out by sending it again."""

    jobs: list[Job]
    op: Op[list[Done]]
    deadline: float
    delay: float


@dataclass(slots=True)
class Sent:
    """The statement under way: how it is going, and what it is."""

    pending: Pending
    attempt: Attempt
    #: When it was sent (monotonic).
    since: float
    #: The release of unheard claims' leases, sent in its stead (``Unheard``).
    release: Op[Any] | None = None


@dataclass(slots=True)
class Connecting:
    """A statement waiting for its line's connection, which the connector thread opens."""

    attempt: Attempt
    future: Future[None]


@dataclass(slots=True)
class Retry:
    """A statement to send again once the backoff passed (the hub's timer)."""

    attempt: Attempt
    timer: Any


def wait_for(sending: Pending, timeout: float | None) -> int:
    """Block until the socket is ready for what ``sending`` waits for (0 on timeout)."""
    poller = select.poll()
    mask = (select.POLLIN if sending.waits_for & WAIT_READ else 0) | (
        select.POLLOUT if sending.waits_for & WAIT_WRITE else 0
    )
    poller.register(sending.fileno, mask)
    events = poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
    ready = 0
    for _, event in events:
        if event & (select.POLLIN | select.POLLERR | select.POLLHUP):
            ready |= WAIT_READ
        if event & select.POLLOUT:
            ready |= WAIT_WRITE
    return ready
