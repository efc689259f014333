"""A worker's claims, acks and offers, sent by its event loop without waiting for them.

The loop must never wait for a commit: a pool process that finished its task would wait with it
for its next job. ``BackgroundCalls`` (sqlease.transport._background) hides that wait on a
thread of its own, but in CPython the thread shares the loop's GIL: every time the statement's
client code wants the GIL back, it waits for the busy loop to let go of it, and the measured
cost of one combined ack + claim doubled beside a busy loop (150 -> 340 us of client CPU). Here
the loop itself sends the statement on a connection it keeps, watches the socket like any
other, and reads the rows when they arrive: no second thread, no GIL handoffs.

The interface is BackgroundCalls': ``submit`` jobs, ``collect`` their outcomes after
``notify`` (on the loop thread, when the rows came). Waiting jobs go out together in one
statement when the one under way has finished (``prepare``). One connection per lane (the op
says which pool and commit level it runs on), one statement at a time over all of them: a
claim submitted after acks runs after them or with them. Every op the transport prepares is
one statement on PostgreSQL (a worker acks only its own deliveries); an op that is not would
be executed, blocking, rather than lost.

A line with no connection gets one on a thread of its own (``connect``): opening one, or
waiting for the pool to free one, would hold the loop for a network round trip or more; the
statement goes out from the loop once it is there.

A statement whose connection dropped (server restart, ``pg_terminate_backend``) or could not
be made is sent again on a fresh connection, after a backoff timed by the hub, for up to
``RETRY_SECONDS``, as the store's blocking operations ride it out (sqlease._db.retry): a
repeated ack is refused as stale, never applied twice. A statement that gets no answer for
``give_up_after`` seconds (the lease: a server that stopped answering on a connection that
stays open, a network partition) is given up the same way: its connection is dropped and the
statement sent again on a new one (guarantees.md, invariant 14).

Loop thread only: the hub's callbacks and the transport's calls all run there.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from sqlease._db.bounds import passed_error
from sqlease._db.driver import WAIT_WRITE, Driver, Lane, Line, Op
from sqlease._db.retry import RETRY_SECONDS
from sqlease.transport._background import Done, Job, Prepare, run_waiting
from sqlease.transport._loop_state import Attempt, Connecting, Retry, Sent, wait_for
from sqlease.transport._unheard import Unheard

logger = logging.getLogger(__name__)


class LoopCalls:
    synchronous = False

    def __init__(
        self,
        hub: Any,
        driver: Driver,
        prepare: Prepare,
        notify: Callable[[], None],
        *,
        wake_from_thread: Callable[[], None] | None = None,
        give_up_after: float | None = None,
    ) -> None:
        self._hub = hub
        self._give_up_after = give_up_after
        #: The hub's repeating timer that looks for a statement under way for too long.
        self._patrol: Any = None
        self._wake_from_thread = wake_from_thread
        self._driver = driver
        #: The connections kept, one per pool (``Driver.line_key``).
        self._lines: dict[object, Line] = {}
        self._notify = notify
        self._prepare = prepare
        self._waiting: list[Job] = []
        self._done: deque[Done] = deque()
        #: The statement under way: how it is going, its jobs, what its rows mean, and until
        #: when (with what next delay) a dropped connection is ridden out.
        self._sending: Sent | None = None
        #: The socket registered with the hub, and whether for writing (else reading).
        self._watched: tuple[int, bool] | None = None
        #: A statement to send again once the backoff passed: its jobs, itself, the deadline,
        #: the next delay, and the hub's timer.
        self._retry: Retry | None = None
        #: A statement waiting for its line's connection, which a thread is opening.
        self._connecting: Connecting | None = None
        self._connector: ThreadPoolExecutor | None = None
        #: Claims sent whose answers never came: what they may have leased is released
        #: before the next statement goes out.
        self._unheard = Unheard(driver)

    def _line(self, lane: Lane) -> Line:
        key = self._driver.line_key(lane)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = self._driver.line(lane)
        return line

    def submit(self, key: Any, **context: Any) -> None:
        self._waiting.append(Job(key, context))
        if not self._busy:
            self._send_waiting()

    @property
    def _busy(self) -> bool:
        return self._sending is not None or self._retry is not None or self._connecting is not None

    def collect(self) -> list[Done]:
        """The calls finished since the last collect, oldest first."""
        done = list(self._done)
        self._done.clear()
        return done

    @property
    def pending(self) -> bool:
        """A call is under way or waiting, or finished and not collected."""
        return self._busy or bool(self._waiting) or bool(self._done)

    def wait_idle(self, timeout: float) -> bool:
        """Finish what is under way and what waits, blocking (closing: the loop is not
        turning); False if that took longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        while self._busy or self._waiting:
            if deadline - time.monotonic() <= 0:
                return False
            if self._connecting is not None:
                future = self._connecting.future
                try:
                    future.exception(timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    return False
                self._connected(future)
            elif self._retry is not None:
                time.sleep(min(self._retry.attempt.delay, max(0.0, deadline - time.monotonic())))
                self._send_again()
            elif self._sending is None:
                self._send_waiting()
            else:
                self._resume(wait_for(self._sending.pending, deadline - time.monotonic()))
        return True

    def stop(self, timeout: float = 5.0) -> None:
        connecting, self._connecting = self._connecting, None
        if connecting is not None:  # its jobs' messages come back when their leases expire
            try:
                connecting.future.exception(timeout=timeout)
            except TimeoutError:
                pass
        if self._connector is not None:
            self._connector.shutdown(wait=False)
            self._connector = None
        if self._retry is not None:
            self._retry.timer.cancel()
            self._retry = None
        if self._patrol is not None:
            self._patrol.cancel()
            self._patrol = None
        self._unwatch()
        busy = self._sending is not None
        if busy:
            logger.warning(
                "sqlease: closing with a claim or ack under way; its messages come back "
                "when their leases expire"
            )
            self._sending = None
        lines, self._lines = self._lines, {}
        for line in lines.values():
            line.close(busy=busy)

    # ---- the statement under way ---------------------------------------------------------

    def _send_waiting(self) -> None:
        while self._waiting and not self._busy:
            try:
                prepared, jobs = self._prepare(self._waiting)
            except BaseException as exc:  # nothing was sent: every job reports it
                jobs, self._waiting = self._waiting, []
                self._failed(jobs, exc)
                continue
            self._waiting = [job for job in self._waiting if all(job is not j for j in jobs)]
            if not prepared.sendable:  # not one statement: done at once, blocking
                self._finished(self._execute(prepared, jobs))
                continue
            self._send(Attempt(jobs, prepared, time.monotonic() + RETRY_SECONDS, 0.05))

    def _execute(self, prepared: Op[list[Done]], jobs: list[Job]) -> list[Done]:
        return run_waiting(self._driver.execute, lambda _jobs: (prepared, jobs), jobs)

    def _send(self, attempt: Attempt) -> None:
        op = attempt.op
        if self._unheard:
            op = self._unheard.release() or op
        line = self._line(op.lane)
        if not line.holds_connection:
            self._connect(line, attempt)
            return
        sent_at = time.monotonic()  # before: the statement may run as soon as it is sent
        try:
            pending = line.send(op)
        except BaseException as exc:  # the line dropped its connection: none is under way
            self._failed(attempt.jobs, exc, again=attempt)
            return
        release = None if op is attempt.op else op
        self._sending = Sent(pending, attempt, sent_at, release)
        if self._give_up_after is not None and self._patrol is None:
            # One timer for the runner's life, a few looks per lease, rather than one per
            # statement (the hot path).
            every = max(0.05, self._give_up_after / 4)
            self._patrol = self._hub.call_repeatedly(every, self._give_up_if_stuck)
        self._after_step()

    def _connect(self, line: Line, attempt: Attempt) -> None:
        """Open ``line``'s connection on the connector thread; ``attempt`` goes out from the
        loop once it is there (``_connected``)."""
        if self._connector is None:
            self._connector = ThreadPoolExecutor(1, thread_name_prefix="sqlease-connect")
        future = self._connector.submit(line.connect)
        self._connecting = Connecting(attempt, future)

        def done(_: Future[None]) -> None:  # on the connector thread
            self._hub.call_soon(self._connected, future)
            if self._wake_from_thread is not None:
                self._wake_from_thread()

        future.add_done_callback(done)

    def _connected(self, future: Future[None]) -> None:
        """The loop thread: the line's connection is there (or could not be made)."""
        if self._connecting is None or self._connecting.future is not future:
            return  # stopped meanwhile, or already taken by wait_idle
        attempt, self._connecting = self._connecting.attempt, None
        error = future.exception()
        if error is not None:
            self._failed(attempt.jobs, error, again=attempt)
        else:
            self._send(attempt)
        if not self._busy:
            self._send_waiting()

    def _failed(self, jobs: list[Job], exc: BaseException, again: Attempt | None = None) -> None:
        """Every job reports ``exc``; unless the connection dropped (or could not be made)
        and there is time left: then the statement goes out again after a backoff."""
        dropped = isinstance(exc, OperationalError | PoolTimeout)
        if again is not None and dropped and time.monotonic() + again.delay <= again.deadline:
            logger.info(
                "sqlease: database operation failed (%s); sending it again in %.2fs",
                str(exc).splitlines()[0][:200],
                again.delay,
            )
            timer = self._hub.call_later(again.delay, self._send_again)
            later = Attempt(again.jobs, again.op, again.deadline, min(again.delay * 2, 1.0))
            self._retry = Retry(later, timer)
            return
        self._finished([Done(job.key, error=exc, context=job.context) for job in jobs])

    def _send_again(self) -> None:
        retry = self._retry
        if retry is None:
            return
        retry.timer.cancel()
        self._retry = None
        self._send(retry.attempt)
        if not self._busy:
            self._send_waiting()

    def _give_up_if_stuck(self) -> None:
        """The hub's timer: a statement under way longer than ``give_up_after`` is given up
        (its connection dropped: the statement may or may not have run) and sent again."""
        sent = self._sending
        if sent is None or self._give_up_after is None:
            return
        if time.monotonic() - sent.since < self._give_up_after:
            return
        self._unwatch()
        self._sending = None
        if sent.release is None:
            self._unheard.add(sent.attempt.op, sent.since)
        self._line((sent.release or sent.attempt.op).lane).close(busy=True)
        logger.warning(
            "sqlease: no answer from the database for %.1f s to a statement sent from the "
            "event loop; dropping its connection",
            self._give_up_after,
        )
        self._failed(
            sent.attempt.jobs, passed_error("a statement sent from the event loop"), sent.attempt
        )
        if not self._busy:
            self._send_waiting()

    def _on_socket(self) -> None:
        """The hub: the socket is ready for what the statement waits for."""
        if self._sending is not None:
            self._resume(self._sending.pending.waits_for)

    def _resume(self, ready: int) -> None:
        assert self._sending is not None
        self._sending.pending.resume(ready)
        self._after_step()

    def _after_step(self) -> None:
        assert self._sending is not None
        pending, attempt = self._sending.pending, self._sending.attempt
        if pending.waits_for:
            # Writing until the request is all sent (rare: these statements are a few KB,
            # the socket's buffer far more), then reading until the rows are in.
            self._watch(pending.fileno, writing=bool(pending.waits_for & WAIT_WRITE))
            return
        self._unwatch()
        sent, self._sending = self._sending, None
        since, dropped = sent.since, isinstance(pending.error, OperationalError)
        if sent.release is not None and not dropped:  # the release is settled
            self._unheard.released(sent.release, pending.rows, pending.error)
            self._send(attempt)
        elif pending.error is not None:
            if sent.release is None and dropped:
                self._unheard.add(attempt.op, since)
            self._failed(attempt.jobs, pending.error, again=attempt)
        else:
            # It ran no earlier than this send (after a retry through an outage, seconds after
            # the submission): what it leased counts its lease from here.
            for job in attempt.jobs:
                if job.context.get("sent_at", since) < since:
                    job.context["sent_at"] = since
            assert attempt.op.finish is not None
            try:
                outcomes = attempt.op.finish(pending.rows)
            except BaseException as exc:
                outcomes = [Done(job.key, error=exc, context=job.context) for job in attempt.jobs]
            self._finished(outcomes)
        self._send_waiting()

    def _finished(self, outcomes: list[Done]) -> None:
        self._done.extend(outcomes)
        self._notify()

    def _watch(self, fileno: int, *, writing: bool) -> None:
        if self._watched == (fileno, writing):
            return
        self._unwatch()
        if writing:
            self._hub.add_writer(fileno, self._on_socket)
        else:
            self._hub.add_reader(fileno, self._on_socket)
        self._watched = (fileno, writing)

    def _unwatch(self) -> None:
        if self._watched is not None:
            fileno, writing = self._watched
            self._watched = None
            try:
                if writing:
                    self._hub.remove_writer(fileno)
                else:
                    self._hub.remove_reader(fileno)
            except Exception:
                pass
