"""What follows a claim, the same whichever way the claim ran (in the loop, on the runner,
handed over by a publish): the pipeline the fetcher runs on the loop thread.

- Messages whose attempts were spent (the claim marked them dead) get their FAILURE result,
  so clients waiting on them are answered.
- A redelivered message whose final result was already stored under its own lease (the result
  was written, then the ack was lost) is acked instead of run again (guarantees.md,
  invariant 9), chord parts aside; one revoked while its earlier worker held it is put in
  this worker's revoked list.
- The heartbeat keeps the leases of the rest, which are delivered.

The database work of these steps goes to ``SideCalls``, a thread of its own, so the event
loop never waits on it; its answers come back to the loop thread.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sqlease import revokes
from sqlease._core.chord_parts import chord_count_of
from sqlease._core.results import ResultStore
from sqlease.store import Message, Store

logger = logging.getLogger(__name__)


class SideCalls:
    """Database work the event loop hands off and does not wait for: one thread, calls in
    order; ``then`` runs on the loop thread with the answer (``collect``, after ``wake``).
    Outside the loop (``in_loop()`` false) a call runs at once, ``then`` with it."""

    def __init__(self, *, in_loop: Callable[[], bool], wake: Callable[[], None]) -> None:
        self._in_loop = in_loop
        self._wake = wake
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._done: deque[tuple[Future[Any], Callable[[Any], None] | None]] = deque()

    def run(self, call: Callable[[], Any], then: Callable[[Any], None] | None = None) -> None:
        if not self._in_loop():
            value = call()
            if then is not None:
                then(value)
            return
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="sqlease-side")
            future = self._executor.submit(call)

        def finished(done: Future[Any]) -> None:
            self._done.append((done, then))
            self._wake()

        future.add_done_callback(finished)

    @property
    def pending(self) -> bool:
        return bool(self._done)

    def collect(self) -> None:
        """Run the ``then`` of every call finished (loop thread); a call that raised is
        logged (its ``then`` does not run)."""
        while self._done:
            future, then = self._done.popleft()
            error = future.exception()
            if error is not None:
                logger.warning("sqlease: a follow-up write failed", exc_info=error)
            elif then is not None:
                then(future.result())

    def close(self, timeout: float = 10.0) -> None:
        """Let the calls under way finish (their answers are dropped)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._done.clear()


def split_redelivered(messages: list[Message]) -> tuple[list[Message], list[Message]]:
    """Messages delivered before (their outcome may be stored, a revoke may wait for them),
    and the rest."""
    again = [m for m in messages if m.attempt > 1 and m.task_id is not None]
    if not again:
        return [], messages
    ids = {m.id for m in again}
    return again, [m for m in messages if m.id not in ids]


def settle_redelivered(
    store: Store, results: ResultStore, messages: list[Message]
) -> tuple[set[int], set[str]]:
    """For redelivered messages: the ids of those whose final result was already stored
    (never to run again: acked now, with a ``completed_from_stored_outcome`` event), and the
    task ids revoked while another worker held them."""
    done = _completed(results, messages)
    if done:
        finished = [m for m in messages if m.id in done]
        # A refused ack does not make a finished task runnable: its delivery is gone (an
        # earlier try of this ack committed and its answer was lost, e.g. to a server
        # restart, and the retry found nothing left) or another worker holds it now.
        acked = store.ack([m.fence for m in finished])
        for message in finished:
            if message.id not in acked:
                logger.info(
                    "sqlease: task %s (message %s) already has its final result; its ack "
                    "was not confirmed (done by an earlier try, or taken over): not run again",
                    message.task_id,
                    message.id,
                )
                continue
            logger.info(
                "sqlease: task %s (message %s) already has its final result; acked without "
                "running it again",
                message.task_id,
                message.id,
            )
            store.record_event(
                "completed_from_stored_outcome",
                None,
                task_id=message.task_id,
                message_id=message.id,
                attempt=message.attempt,
            )
    revoked = {
        m.task_id
        for m in messages
        if m.id not in done and m.task_id is not None and revokes.requested(store, m.task_id)
    }
    return done, revoked


def _completed(results: ResultStore, messages: list[Message]) -> set[int]:
    done = results.completed_messages(m.id for m in messages)
    if not done:
        return set()
    # A chord part whose result was stored but not yet counted runs again (its count is
    # idempotent), or its chord would never complete; so does the part whose count was
    # the chord's last if the callback was never sent (sqlease._core.chord_parts).
    parts = {m.id: chord_count_of(m.payload) for m in messages if m.id in done}
    settled = results.parts_settled(p for p in parts.values() if p is not None)
    completed = {i for i, p in parts.items() if p is None or p in settled}
    for message_id, part in parts.items():
        if message_id not in completed and part is not None:
            logger.warning(
                "sqlease: chord part %s (message %s) stored its result, but its worker "
                "died before counting it or before sending the chord's callback; running "
                "it again (counted once)",
                part[1],
                message_id,
            )
    return completed


def forward_revokes(task_ids: set[str]) -> None:
    """Tasks delivered again that a revoke reached while their earlier worker held them: put
    in this worker's revoked list, so Celery discards them (REVOKED result, ack,
    ``task-revoked`` event) instead of running them."""
    worker_state = sys.modules.get("celery.worker.state")
    if worker_state is None or not task_ids:
        return  # not a Celery worker: no revoked list to tell
    for task_id in task_ids:
        logger.info("sqlease: task %s was revoked while another worker held it", task_id)
        worker_state.revoked.add(task_id)


def record_exhausted(results: ResultStore, messages: list[Message]) -> None:
    """Exhausted tasks get a FAILURE result (AttemptsExhausted), so that clients waiting
    on them are answered instead of waiting forever."""
    for message in messages:
        logger.error(
            "sqlease: task %s (message %s) failed attempts_exhausted after %d deliveries; "
            "kept for inspection ('sqlease show %s', 'sqlease requeue %s')",
            message.task_id,
            message.id,
            message.attempt,
            message.task_id,
            message.task_id,
        )
        if message.task_id is not None:
            record_failure(
                results, message.task_id, "AttemptsExhausted", [message.task_id, message.attempt]
            )


def record_failure(
    results: ResultStore,
    task_id: str,
    exc_type: str,
    args: list[Any],
    module: str = "sqlease.errors",
) -> None:
    try:
        results.record_final(task_id, "FAILURE", exc_type, args, module)
    except Exception:
        logger.warning("sqlease: could not record the failure of task %s", task_id, exc_info=True)
