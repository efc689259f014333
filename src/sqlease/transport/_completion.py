"""Final outcomes the transport writes itself. What a claim brought is made ready for delivery:
a redelivered message whose result was already stored (its ack was lost) is completed instead of
run again (chord parts aside), and the heartbeat keeps the leases of the rest. A task that will
not run (attempts exhausted, undecodable) gets its FAILURE result, so that clients waiting on it
are answered."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sqlease._core.chord_parts import chord_count_of
from sqlease._core.heartbeat import heartbeat
from sqlease.store import Message

if TYPE_CHECKING:
    from sqlease.transport._transport import Transport

logger = logging.getLogger(__name__)


def hold(transport: Transport, messages: list[Message]) -> list[Message]:
    """The messages to deliver; the heartbeat keeps their leases from now on."""
    messages = skip_completed(transport, messages)
    store = transport.store
    options = transport.options
    beat = heartbeat()
    for message in messages:
        beat.hold(
            store,
            message.fence,
            lease_ms=options.lease_ms,
            interval=options.heartbeat_seconds,
            task_id=message.task_id,
        )
    return messages


def skip_completed(transport: Transport, messages: list[Message]) -> list[Message]:
    """Lost-ack completion (guarantees.md, invariant 9): a redelivered message whose final
    result was already stored under its own lease (the result was written, then the ack was
    lost) is acked now instead of running the task body again."""
    redelivered = [m for m in messages if m.attempt > 1 and m.task_id is not None]
    if not redelivered:
        return messages
    results = transport.results
    done = results.completed_messages(m.id for m in redelivered)
    if not done:
        return messages
    # A chord part whose result was stored but not yet counted runs again (its count is
    # idempotent), or its chord would never complete; so does the part whose count was
    # the chord's last if the callback was never sent (sqlease._core.chord_parts).
    parts = {m.id: chord_count_of(m.payload) for m in messages if m.id in done}
    settled = results.parts_settled(p for p in parts.values() if p is not None)
    done = {i for i, p in parts.items() if p is None or p in settled}
    for message_id, part in parts.items():
        if message_id not in done and part is not None:
            logger.warning(
                "sqlease: chord part %s (message %s) stored its result, but its worker "
                "died before counting it or before sending the chord's callback; running "
                "it again (counted once)",
                part[1],
                message_id,
            )
    if not done:
        return messages
    return _complete(transport, messages, done)


def _complete(transport: Transport, messages: list[Message], done: set[int]) -> list[Message]:
    """Ack the messages ``done`` (their results are stored); the others, to deliver."""
    store = transport.store
    finished = [m for m in messages if m.id in done]
    acked = transport.leases.ack([m.fence for m in finished])
    for message in finished:
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
    return [m for m in messages if m.id not in acked]


def record_exhausted(transport: Transport, messages: list[Message]) -> None:
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
                transport, message.task_id, "AttemptsExhausted", [message.task_id, message.attempt]
            )


def record_failure(
    transport: Transport,
    task_id: str,
    exc_type: str,
    args: list[Any],
    module: str = "sqlease.errors",
) -> None:
    try:
        transport.results.record_final(task_id, "FAILURE", exc_type, args, module)
    except Exception:
        logger.warning("sqlease: could not record the failure of task %s", task_id, exc_info=True)
