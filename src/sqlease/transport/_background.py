"""The worker's database jobs, done on a thread of their own (a psycopg without the
statement generator that ``LoopCalls`` drives).

A busy worker's event loop dispatches jobs to the pool and reads their results; every
millisecond it spends waiting for a claim's commit is a millisecond in which a pool process
that finished its task waits for its next one. So the transport hands its claims and acks to
this thread and goes on with the loop; the outcome comes back through the loop's self-pipe
and is delivered on the loop's own thread (Celery's callbacks are not thread-safe). One op
runs at a time, in submission order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlease._db.driver import Driver, Op


@dataclass
class Done:
    """A finished call: ``value`` if it returned, ``error`` if it raised (what a runner hands
    back to the loop thread; not a database outcome, see ``sqlease.Outcome``)."""

    key: Any
    value: Any = None
    error: BaseException | None = None
    context: dict[str, Any] = field(default_factory=dict)
    #: For calls that wrote acks as well: the ids acked.
    acked: set[int] | None = None


@dataclass(eq=False)
class Job:
    """A job waiting for a runner: its kind (``key``) and what it needs (``context``)."""

    key: Any
    context: dict[str, Any]


#: Turns waiting jobs into one op: the op, and the jobs whose outcomes it answers.
Prepare = Callable[[list[Job]], "tuple[Op[list[Done]], list[Job]]"]


def run_waiting(
    execute: Callable[[Op[list[Done]]], list[Done]], prepare: Prepare, jobs: list[Job]
) -> list[Done]:
    """Every job of ``jobs``, as ops one after another (blocking): their outcomes, in order.
    An op that raises makes the outcome of each job it covered that error."""
    outcomes: list[Done] = []
    while jobs:
        try:
            op, covered = prepare(jobs)
        except BaseException as exc:  # nothing was sent: every job reports it
            outcomes += [Done(job.key, error=exc, context=job.context) for job in jobs]
            return outcomes
        try:
            outcomes += execute(op)
        except BaseException as exc:  # handed to the loop thread, which raises it there
            outcomes += [Done(job.key, error=exc, context=job.context) for job in covered]
        jobs = [job for job in jobs if all(job is not c for c in covered)]
    return outcomes


class BackgroundCalls:
    """One daemon thread doing submitted jobs in order; finished jobs wait in ``collect()``
    for the loop thread, which ``notify`` wakes (called from this thread).

    The jobs waiting when the thread comes back for more are prepared together
    (``prepare``), so several may go as one statement (one outcome per job)."""

    synchronous = False

    def __init__(
        self,
        driver: Driver,
        prepare: Prepare,
        notify: Callable[[], None],
        name: str = "sqlease-claims",
        on_start: Callable[[], None] | None = None,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        self._driver = driver
        self._prepare = prepare
        self._notify = notify
        self._on_start = on_start  # both run on the thread itself: as it starts, as it ends
        self._on_exit = on_exit
        self._name = name
        self._jobs: SimpleQueue[Job | None] = SimpleQueue()
        self._done: deque[Done] = deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running = 0  # submitted and not yet finished
        self._thread: threading.Thread | None = None

    def submit(self, key: Any, **context: Any) -> None:
        with self._lock:
            self._running += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
        self._jobs.put(Job(key, context))

    def collect(self) -> list[Done]:
        """The calls finished since the last collect, oldest first."""
        done: list[Done] = []
        while True:
            try:
                done.append(self._done.popleft())
            except IndexError:
                return done

    @property
    def pending(self) -> bool:
        """A call is running or waiting to run, or finished and not collected."""
        with self._lock:
            return self._running > 0 or bool(self._done)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no call is running (their outcomes are then in ``collect()``)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout)

    def stop(self, timeout: float = 5.0) -> None:
        thread = self._thread
        if thread is None:
            return
        self._jobs.put(None)
        thread.join(timeout)
        self._thread = None

    def _work(self) -> None:
        if self._on_start is not None:
            self._on_start()
        try:
            self._serve()
        finally:
            if self._on_exit is not None:
                self._on_exit()

    def _serve(self) -> None:
        stopping = False
        while not stopping:
            first = self._jobs.get()
            if first is None:
                return
            jobs = [first]
            while True:  # whatever else is already waiting goes with it
                try:
                    job = self._jobs.get_nowait()
                except Empty:
                    break
                if job is None:
                    stopping = True
                    break
                jobs.append(job)
            self._done.extend(run_waiting(self._driver.execute, self._prepare, jobs))
            with self._idle:
                self._running -= len(jobs)
                self._idle.notify_all()
            self._notify()
