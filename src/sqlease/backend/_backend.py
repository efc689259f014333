"""The result backend itself: configuration, fenced result writes, the key/value primitives."""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import states
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str

from sqlease._celery.lease_interrupt import disarm
from sqlease._celery.registry import store_for
from sqlease._core.delivery_lease import DeliveryLease
from sqlease._core.results import ResultStore
from sqlease.backend._chords import NativeChords
from sqlease.backend._fencing import (
    REFUSED,
    counted_part,
    counting_part,
    pending_expiries,
    writing_under,
)
from sqlease.backend._waits import PushedWaits
from sqlease.delivery import CLOCK_KEY, LEASE_KEY, OFFER_KEY, fence_of
from sqlease.errors import ConfigurationError, DatabaseUnavailable, LeaseLost
from sqlease.options import TransportOptions
from sqlease.store import Fence
from sqlease.types import Outcome
from sqlease.urls import display_url, strip_prefix, to_sqlalchemy_url

logger = logging.getLogger(__name__)


class SqleaseBackend(PushedWaits, NativeChords):  # type: ignore[misc]
    """Result backend on SQL, fenced by sqlease delivery leases."""

    implements_incr = True
    supports_native_join = True
    supports_autoexpire = False  # expired rows go in cleanup() (celery.backend_cleanup)
    persistent = True

    def __init__(self, app: Any = None, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(app=app, url=url, **kwargs)
        conf = self.app.conf
        raw = url or conf.result_backend or "sqlease://"
        if not isinstance(raw, str):
            raise ConfigurationError("the sqlease result backend needs a URL string")
        self.url = strip_prefix(raw) if raw.startswith("sqlease") else raw
        self.sa_url = to_sqlalchemy_url(self.url)
        options = dict(conf.get("result_backend_transport_options") or {})
        broker_options = conf.get("broker_transport_options") or {}
        broker_prefix = str(broker_options.get("table_prefix", "sqlease_"))
        shares_database = self._shares_broker_database()
        if "table_prefix" not in options and shares_database:
            options["table_prefix"] = broker_prefix
        if "lease_seconds" not in options and shares_database:
            # The broker's lease: its connections' keepalives follow it, and a worker's
            # backend and transport then share one store (one set of pools).
            lease = broker_options.get("lease_seconds")
            if lease is not None:
                options["lease_seconds"] = lease
        options.pop("global_keyprefix", None)
        self.options = TransportOptions.parse(options)
        # Results are fenced only when the broker's messages are in the same tables: the
        # lease check and the write happen in one transaction.
        self._same_db_as_broker = (
            shares_database and self.options.table_prefix == broker_prefix.lower()
        )
        if shares_database and not self._same_db_as_broker:
            logger.warning(
                "sqlease: result backend table_prefix %r differs from the broker's %r: results "
                "are stored without lease fencing",
                self.options.table_prefix,
                broker_prefix,
            )
        self._results: ResultStore | None = None
        self._local = threading.local()

    def _shares_broker_database(self) -> bool:
        from sqlease._celery.defaults import broker_urls, sqlease_transport_setting

        plain_sql_ok = sqlease_transport_setting(self.app)
        mine = self.sa_url.render_as_string(hide_password=False)
        for broker in broker_urls(self.app):
            if not broker.startswith("sqlease") and not plain_sql_ok:
                continue
            try:
                if to_sqlalchemy_url(broker).render_as_string(hide_password=False) == mine:
                    return True
            except ConfigurationError:
                continue
        return False

    @property
    def results(self) -> ResultStore:
        if self._results is None:
            self._results = ResultStore(store_for(self.sa_url, self.options))
        return self._results

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        return super().__reduce__(args, dict(kwargs or {}, url=self.url))

    def as_uri(self, include_password: bool = False) -> str:
        text = f"sqlease+{self.url}" if not self.url.startswith("sqlease") else self.url
        return text if include_password else display_url(text)

    def exception_safe_to_retry(self, exc: Exception) -> bool:
        # With result_backend_always_retry, Celery retries storing a result after these.
        from sqlalchemy.exc import OperationalError

        return isinstance(exc, OperationalError | DatabaseUnavailable)

    def _fence_for(self, request: Any) -> Fence | None:
        """The lease a write from this request must hold (None: write unfenced)."""
        if request is None or not self._same_db_as_broker:
            return None
        properties = getattr(request, "properties", None) or {}
        fence = fence_of(properties.get("delivery_info") if isinstance(properties, dict) else None)
        if fence is None:
            return None
        task = self.app.tasks.get(getattr(request, "task", None) or "")
        if task is not None and not task.acks_late:
            return None  # acked before it ran: the lease row is already gone
        return fence

    def _store_result(
        self,
        task_id: Any,
        result: Any,
        state: str,
        traceback: Any = None,
        request: Any = None,
        **kwargs: Any,
    ) -> Any:
        fence = self._fence_for(request)
        self._local.refused = False
        meta = self._get_result_meta(
            result=result, state=state, traceback=traceback, request=request
        )
        meta["task_id"] = bytes_to_str(task_id)
        # Celery reads the stored state first and keeps a SUCCESS (a late duplicate must not
        # overwrite it); here that rule is part of the write itself: one statement, no read.
        # A final result of an idle worker's delivery also puts back that worker's offer.
        offer = _offer_of(request) if fence is not None and state in states.READY_STATES else None
        lease = self._lease_of(request, fence)
        if lease is not None and state in states.READY_STATES:
            disarm()  # the body returned: its result is not interrupted (interrupt_on_lease_lost)
        try:
            if lease is not None:
                # Refused here, without a round trip, once the lease clock ran out; else the
                # write waits no longer than the lease has left.
                lease.check("result")
                with lease.within("result"):
                    self._put_result(task_id, meta, state, fence, offer)
            else:
                self._put_result(task_id, meta, state, fence, offer)
        except LeaseLost:
            self._local.refused = True
        except BackendStoreError as ex:
            raise BackendStoreError(str(ex), state=state, task_id=task_id) from ex
        stored = result
        if self._local.refused and fence is not None:
            logger.warning(
                "sqlease: %s result of task %s refused: delivery (message %s, attempt %s) "
                "lost its lease; the new holder's result stands",
                state,
                bytes_to_str(task_id),
                fence.message_id,
                fence.attempt,
            )
            if request is not None:
                setattr(request, REFUSED, True)
        return stored

    def _put_result(
        self, task_id: Any, meta: dict[str, Any], state: str, fence: Fence | None, offer: Any
    ) -> None:
        self._put(
            self.get_key_for_task(task_id),
            self.encode(meta),
            state,
            fence=fence,
            task_id=bytes_to_str(task_id),
            keep_success=True,
            offer=offer,
        )

    def _lease_of(self, request: Any, fence: Fence | None) -> DeliveryLease | None:
        """The lease clock of the delivery a fenced write is made for."""
        if fence is None:
            return None
        properties = getattr(request, "properties", None) or {}
        info = properties.get("delivery_info") or {}
        lease_ms = int(info.get(LEASE_KEY) or self.options.lease_ms)
        return DeliveryLease.of(fence, lease_ms, info.get(CLOCK_KEY))

    @staticmethod
    def _key(key: Any) -> str:
        return bytes_to_str(key)

    @staticmethod
    def _bytes(value: Any) -> bytes:
        return value if isinstance(value, bytes) else str(value).encode("utf-8")

    def _task_id_of(self, key: str) -> str | None:
        prefix = bytes_to_str(self.task_keyprefix)
        return key[len(prefix) :] if key.startswith(prefix) else None

    def get(self, key: Any) -> Any:
        return self.results.get_or_original(self._key(key), bytes_to_str(self.task_keyprefix))

    def mget(self, keys: Any) -> Any:
        """The values under ``keys``; a unique task's duplicate publish never runs: the result
        of its task id is the original's (sqlease._core.uniques)."""
        texts = [self._key(k) for k in keys]
        return self.results.mget_or_originals(texts, bytes_to_str(self.task_keyprefix))

    def set(self, key: Any, value: Any) -> Any:
        return self._set_with_state(key, value, None)

    def _set_with_state(self, key: Any, value: Any, state: str | None) -> Any:
        writing = writing_under.get()
        return self._put(key, value, state, fence=writing[0] if writing else None)

    def _put(
        self,
        key: Any,
        value: Any,
        state: str | None,
        *,
        fence: Fence | None,
        task_id: str | None = None,
        keep_success: bool = False,
        offer: Any = None,
    ) -> bool:
        text = self._key(key)
        expires_ms = int(self.expires * 1000) if self.expires else None
        outcome = self.results.put(
            text,
            self._bytes(value),
            state=state,
            task_id=task_id or self._task_id_of(text),
            expires_ms=expires_ms,
            fence=fence,
            keep_success=keep_success,
            offer=offer,
        )
        if outcome is Outcome.LEASE_LOST:
            self._local.refused = True
        return outcome is Outcome.UPDATED

    def delete(self, key: Any) -> Any:
        self.results.delete(self._key(key))

    def incr(self, key: Any) -> int:
        counted = counted_part.get()
        if counted is not None and counted[0] == self._key(key):
            return counted[1].value  # counted already, with the part's whole count (_chords)
        writing = writing_under.get()
        part = counting_part.get()
        expires = getattr(self, "expires", None)
        terms: dict[str, Any] = {
            "part": part,
            "part_expires_ms": int(expires * 1000) if part and expires else None,
        }
        if writing is not None:
            terms.update(fence=writing[0], task_id=writing[1])
        return self.results.incr(self._key(key), **terms)

    def expire(self, key: Any, value: Any) -> Any:
        counted = counted_part.get()
        if counted is not None and (self._key(key), value) in counted[2]:
            return  # written with the part's count
        pending = pending_expiries.get()
        if pending is not None:  # counting a chord part: written with the others at its end
            pending.append((self._key(key), value))
        else:
            self.results.expire(self._key(key), value)

    def cleanup(self) -> None:
        removed = self.results.cleanup()
        logger.info("sqlease: removed %d expired result rows", removed)


def _offer_of(request: Any) -> Any:
    """The handoff offer the transport asked this delivery's final result to write, if any
    (``sqlease.delivery.OFFER_KEY``: set on a delivery its worker took while idle)."""
    properties = getattr(request, "properties", None) or {}
    info = properties.get("delivery_info") if isinstance(properties, dict) else None
    return info.get(OFFER_KEY) if isinstance(info, dict) else None
