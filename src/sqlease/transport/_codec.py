"""Kombu's message dict to a stored ``NewMessage``, and a claimed ``Message`` back to Kombu's
payload: priority, eta, TTL, properties, the lease stamped into ``delivery_info``.

Pure translation: what to do with a message that is not readable or has expired (fail it,
record it) is the channel's decision."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, cast

from kombu.utils import json as kombu_json

from sqlease._core.names import as_id
from sqlease.delivery import ATTEMPT_KEY, CLOCK_KEY, ID_KEY, LEASE_KEY, OFFER_KEY, OWNER_KEY
from sqlease.errors import ConfigurationError
from sqlease.store import Message, NewMessage

#: Headers that carry a task option's error (sqlease._celery.task_limits, a
#: ``before_task_publish`` handler: Celery swallows a handler's exception), refused here at
#: publish.
CONCURRENCY_ERROR_HEADER = "sqlease_concurrency_error"
UNIQUE_ERROR_HEADER = "sqlease_unique_error"


logger = logging.getLogger(__name__)

#: The errors of a stored payload that is not a readable Kombu message.
UNREADABLE = (ValueError, KeyError, TypeError, AttributeError)

#: The message properties AMQP defines (RabbitMQ sends these and drops any other key a
#: ``publish(**properties)`` carried) and those Kombu's virtual transports add.
_KNOWN_PROPERTIES = frozenset(
    {
        "content_type",
        "content_encoding",
        "application_headers",
        "delivery_mode",
        "priority",
        "correlation_id",
        "reply_to",
        "expiration",
        "message_id",
        "timestamp",
        "type",
        "user_id",
        "app_id",
        "cluster_id",
        "delivery_info",
        "delivery_tag",
        "body_encoding",
    }
)


def ttl_ms(expiration: Any) -> int | None:
    """The ``expiration`` property as milliseconds (Kombu sends a string of them); None
    when there is none or it is not a number (a message is never dropped on a guess)."""
    if expiration is None or isinstance(expiration, bool):
        return None
    try:
        ttl = float(expiration)
    except (TypeError, ValueError):
        return None
    if ttl != ttl or ttl < 0:  # NaN or negative: not a TTL
        return None
    return int(ttl)


def eta_delay_ms(headers: dict[str, Any]) -> int:
    eta = headers.get("eta")
    if not eta:
        return 0
    try:
        when = eta if isinstance(eta, datetime) else datetime.fromisoformat(str(eta))
    except ValueError:
        logger.warning("ignoring unparseable eta header %r: delivering now", eta)
        return 0
    return max(0, int((when.timestamp() - time.time()) * 1000))


# ---- publishing ----------------------------------------------------------------------------


def new_message(queue: str, message: dict[str, Any]) -> NewMessage:
    """The row to store for a Kombu message published to ``queue``."""
    headers = message.get("headers") or {}
    properties = message.get("properties") or {}
    run_id = headers.get("run_id")
    task_id = headers.get("id")
    max_attempts = headers.get("max_attempts")
    task_name = headers.get("task")
    key, limit = _concurrency(headers)
    unique_key, scope, for_ms = _unique(headers)
    group = headers.get("group")
    expiration = properties.get("expiration")
    if expiration is not None and ttl_ms(expiration) is None:
        raise ConfigurationError(
            f"property 'expiration' must be a TTL in milliseconds (a number >= 0, as Kombu's "
            f"publish(expiration=seconds) sends it), not {expiration!r}"
        )
    try:
        payload = json.dumps(message)
    except (TypeError, ValueError):
        payload = _typed_json(queue, message)
    return NewMessage(
        queue=queue,
        payload=payload,
        priority=_priority(properties),
        delay_ms=eta_delay_ms(headers),
        run_id=None if run_id is None else as_id("run id", run_id, ConfigurationError),
        task_id=None if task_id is None else as_id("task id", task_id, ConfigurationError),
        max_attempts=max_attempts,
        record=task_id is not None,
        task_name=task_name if isinstance(task_name, str) else None,
        concurrency_key=key,
        concurrency_limit=limit,
        unique_key=unique_key,
        unique_scope=scope,
        unique_for_ms=for_ms,
        group_id=group if isinstance(group, str) else None,
    )


def _priority(properties: dict[str, Any]) -> int:
    try:
        priority = int(properties.get("priority") or 0)
    except (TypeError, ValueError):
        priority = 0
    return max(0, min(9, priority))


def _concurrency(headers: dict[str, Any]) -> tuple[Any, Any]:
    """The ``concurrency_key`` and ``concurrency_limit`` headers as they came (the store
    checks them, with every other field of the message)."""
    if headers.get(CONCURRENCY_ERROR_HEADER):  # from the task's options (_celery.task_limits)
        raise ConfigurationError(str(headers[CONCURRENCY_ERROR_HEADER]))
    return headers.get("concurrency_key"), headers.get("concurrency_limit")


def _unique(headers: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The ``unique_key``, ``unique_scope`` and ``unique_for`` headers, ``unique_for`` (a
    number of seconds) in milliseconds; the store checks them (``sqlease._core.uniques``). A
    part of a chord's header is never unique: a duplicate would never run, and the chord's
    body would wait for it for ever."""
    if headers.get(UNIQUE_ERROR_HEADER):  # from the task's options (_celery.task_limits)
        raise ConfigurationError(str(headers[UNIQUE_ERROR_HEADER]))
    if headers.get("chord"):
        return None, None, None
    key, scope, period = (headers.get(n) for n in ("unique_key", "unique_scope", "unique_for"))
    if isinstance(period, int | float) and not isinstance(period, bool) and period > 0:
        period = max(1, round(period * 1000))  # anything else is refused as it came
    return key, scope, period


#: How Kombu's JSON tags a value of a registered type.
_TYPE_TAG = '"__type__"'
_tagged_dumps = cast(Callable[[Any], str], kombu_json.dumps)
_tagged_loads = cast(Callable[[str], Any], kombu_json.loads)


def _typed_json(queue: str, message: dict[str, Any]) -> str:
    """The JSON of a message that plain JSON refused. Header and property values of the types
    Kombu's JSON registers (datetime, Decimal, UUID, bytes) are kept as Kombu's Redis transport
    keeps them, tagged, and come back as they went (``parse``). Properties that are not AMQP's
    and cannot be stored even so (e.g. a ``before_task_publish`` handler that passes its
    ``**kwargs``, the signal object among them, on to ``producer.publish``) are dropped, as
    RabbitMQ drops them. Anything else that cannot be stored is the publisher's error."""
    try:
        return _tagged_dumps(message)
    except (TypeError, ValueError) as exc:
        error: Exception = exc
    properties = message.get("properties") or {}
    foreign = [k for k in properties if k not in _KNOWN_PROPERTIES and not _storable(properties[k])]
    if foreign:
        kept = {k: v for k, v in properties.items() if k not in foreign}
        try:
            payload = _tagged_dumps({**message, "properties": kept})
        except (TypeError, ValueError) as exc:
            error = exc
        else:
            logger.warning(
                "sqlease: message for queue %r: dropped message properties %s, which are not "
                "AMQP properties and cannot be stored as JSON (RabbitMQ drops them too)",
                queue,
                ", ".join(repr(k) for k in foreign),
            )
            return payload
    raise ConfigurationError(
        f"message for queue {queue!r} cannot be stored as JSON: {error}"
    ) from error


def _storable(value: Any) -> bool:
    try:
        _tagged_dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# ---- delivering ----------------------------------------------------------------------------


#: What a fetched message that will not reach its consumer becomes: ``refuse(message,
#: reason, error)`` (the fetcher: failed ``reason`` if leased, recorded if deleted on fetch).
Refuse = Callable[[Message, str, str], None]


def decode(
    message: Message,
    decode_body: Callable[[Any, Any], Any],
    *,
    lease_ms: int,
    now_ms: Callable[[], int],
    leased: bool,
    refuse: Refuse,
    offer: dict[str, Any] | None = None,
    clock: str | None = None,
    queue_ttl: int | None = None,
) -> dict[str, Any] | None:
    """The Kombu payload of a fetched row, stamped with its lease (and ``clock``, where its
    lease clock is published); None if the row is not a readable message (refused
    ``undecodable``) or its TTL or its queue's (``queue_ttl``, ms) passed (refused
    ``expired``)."""
    try:
        payload, properties, delivery_info = parse(message, decode_body)
    except UNREADABLE as exc:
        error = f"{type(exc).__name__}: {exc}"
        logger.error(
            "sqlease: message %s in queue %r is not a readable Kombu message (%s); "
            "it is kept as failed 'undecodable' for inspection",
            message.id,
            message.queue,
            error,
        )
        refuse(message, "undecodable", error)
        return None
    expired = None
    if properties.get("expiration") is not None or queue_ttl is not None:
        expired = ttl_passed(
            message,
            payload,
            properties,
            lease_ms=lease_ms,
            now_ms=now_ms,
            leased=leased,
            queue_ttl=queue_ttl,
        )
    if expired is not None:
        logger.info(
            "sqlease: message %s in queue %r expired: %s; kept as failed 'expired'",
            message.id,
            message.queue,
            expired,
        )
        refuse(message, "expired", expired)
        return None
    stamp(
        message,
        payload,
        properties,
        delivery_info,
        lease_ms=lease_ms,
        leased=leased,
        offer=offer,
        clock=clock,
    )
    return payload


def parse(
    message: Message, decode_body: Callable[[Any, Any], Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The Kombu payload of a stored row, its properties and its ``delivery_info``; raises
    one of ``UNREADABLE`` if the row is not a readable Kombu message."""
    text = message.payload
    # Tagged values (``_typed_json``) only where a publish needed them: the plain decoder
    # is the faster one.
    payload = _tagged_loads(text) if _TYPE_TAG in text else json.loads(text)
    properties = payload["properties"]
    delivery_info = properties.setdefault("delivery_info", {})
    if not isinstance(delivery_info, dict):
        raise TypeError("properties.delivery_info is not an object")
    # The body must decode too, or Kombu would fail on it later, outside our reach.
    decode_body(payload.get("body"), properties.get("body_encoding"))
    return payload, properties, delivery_info


def ttl_passed(
    message: Message,
    payload: dict[str, Any],
    properties: dict[str, Any],
    *,
    lease_ms: int,
    now_ms: Callable[[], int],
    leased: bool,
    queue_ttl: int | None = None,
) -> str | None:
    """Kombu's per-message TTL (``publish(expiration=…)``, the AMQP ``expiration``
    property) and its queue's (``x-message-ttl``, ``queue_ttl``): why the message is not to
    be delivered, if it stayed queued longer than the shorter of them after it became
    deliverable (counted from its publish or eta, or an operator's requeue); else None.
    Celery task messages with an ``expires`` header are left to the worker for their own
    TTL, which revokes them itself (REVOKED result, ``task_revoked`` signal,
    ``task-revoked`` event), as on Redis."""
    ttl = ttl_ms(properties.get("expiration"))
    headers = payload.get("headers")
    if isinstance(headers, dict) and headers.get("task") and headers.get("expires"):
        ttl = None
    whose = "message"
    if queue_ttl is not None and (ttl is None or queue_ttl < ttl):
        ttl, whose = queue_ttl, "queue's"
    if ttl is None:
        return None
    if message.lease_expires_at_ms is not None and leased:
        # When it was leased: at the claim, or at the publish for a handoff (so a TTL
        # of 0 delivers to a consumer that is waiting, and to no one else, as AMQP does).
        delivered_at = message.lease_expires_at_ms - lease_ms
    else:
        delivered_at = now_ms()
    # Counted from when it became deliverable: its publish (or eta), or its last
    # requeue by an operator, which gives an expired message a fresh TTL.
    waited = delivered_at - message.available_at_ms
    if waited <= ttl:
        return None
    return f"{whose} TTL of {ttl} ms passed before delivery ({waited} ms queued)"


def stamp(
    message: Message,
    payload: dict[str, Any],
    properties: dict[str, Any],
    delivery_info: dict[str, Any],
    *,
    lease_ms: int,
    leased: bool,
    offer: dict[str, Any] | None,
    clock: str | None = None,
) -> None:
    """Give the payload its delivery tag and, if leased, the lease it is delivered under
    (with where its lease clock is published, and the handoff offer its final result is to
    write)."""
    properties["delivery_tag"] = f"{message.id}.{message.attempt}"
    delivery_info["redelivered"] = message.attempt > 1
    if leased:
        delivery_info.update(
            {
                ID_KEY: message.id,
                ATTEMPT_KEY: message.attempt,
                OWNER_KEY: message.lease_owner,
                LEASE_KEY: lease_ms,
            }
        )
        if offer is not None:
            delivery_info[OFFER_KEY] = offer
        if clock is not None:
            delivery_info[CLOCK_KEY] = clock
    payload["redelivered"] = message.attempt > 1
