"""Celery result backend ``sqlease+<SQLAlchemy URL>`` (loaded through the
``celery.result_backends`` entry point: no import needed).

Results live in ``<prefix>results`` as Celery's key/value records, so Celery's own logic gives
``result_extended``, groups, custom states and ``update_state``; chords are native (an atomic
SQL counter, no ``chord_unlock`` polling). When broker and backend share one database, a result
written from inside a sqlease delivery is fenced by that delivery's lease in the same
transaction: a worker that lost its lease can neither store a result nor advance a chord, and
the new holder's result stands. ``AsyncResult.get()`` wakes on NOTIFY on PostgreSQL and watches
the file on SQLite, instead of sleeping between polls.
"""

from __future__ import annotations

import logging
import threading
import time
from contextvars import ContextVar
from typing import Any

from celery import states
from celery.backends.base import KeyValueStoreBackend
from celery.exceptions import BackendStoreError
from celery.exceptions import TimeoutError as CeleryTimeoutError
from kombu.utils.encoding import bytes_to_str

from .delivery import OFFER_KEY, fence_of
from .errors import ConfigurationError, DatabaseUnavailable
from .options import TransportOptions
from .registry import store_for
from .results_store import FenceRefused, ResultStore
from .store import Fence
from .types import Outcome
from .urls import display_url, strip_prefix, to_sqlalchemy_url
from .wakeup import PostgresListener, Waker

logger = logging.getLogger(__name__)

# The fence of the delivery whose result is being written (set around Celery's own logic).
#: How many published task ids a thread remembers for on_task_call / wait_for.
FRESH_LIMIT = 1000

_writing_under: ContextVar[tuple[Fence, str] | None] = ContextVar(
    "sqlease_writing_under", default=None
)
_REFUSED = "sqlease_refused"
#: The chord part (task id) whose count is being written: counted once (ResultStore.incr).
_counting_part: ContextVar[str | None] = ContextVar("sqlease_counting_part", default=None)


class SqleaseBackend(KeyValueStoreBackend):  # type: ignore[misc]
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
        broker_prefix = str(
            (conf.get("broker_transport_options") or {}).get("table_prefix", "sqlease_")
        )
        shares_database = self._shares_broker_database()
        if "table_prefix" not in options and shares_database:
            options["table_prefix"] = broker_prefix
        options.pop("global_keyprefix", None)
        self.options = TransportOptions.parse(options)
        # Results are fenced only when the broker's messages are in the same tables: the
        # lease check and the write happen in one transaction.
        self._same_db_as_broker = shares_database and self.options.table_prefix == broker_prefix
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
        from .celery_defaults import broker_urls, sqlease_transport_setting

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

    # ---- fencing ---------------------------------------------------------------------

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
        try:
            self._put(
                self.get_key_for_task(task_id),
                self.encode(meta),
                state,
                fence=fence,
                task_id=bytes_to_str(task_id),
                keep_success=True,
                offer=offer,
            )
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
                setattr(request, _REFUSED, True)
        return stored

    def on_chord_part_return(self, request: Any, state: str, result: Any, **kwargs: Any) -> Any:
        fence = self._fence_for(request)
        if fence is not None and getattr(request, _REFUSED, False):
            return None  # its result was refused: it must not count towards the chord
        chord = getattr(request, "chord", None)
        if self._counted_before(request):
            # A duplicate of a part already counted (the same task delivered twice, e.g. a
            # publish repeated by the app): Celery's base would restore the group first, which
            # is deleted once the chord fired, and fail the chord's body with "GroupResult …
            # no longer exists". The count it would add is refused anyway (``incr``).
            logger.info(
                "sqlease: chord part %s of group %s was counted already; not counted again",
                request.id,
                request.group,
            )
            return None
        size = self._chord_size(request)
        if size is not None and isinstance(chord, dict):
            request.chord = dict(chord, chord_size=size)  # Celery's base reads it from here
        token = _writing_under.set((fence, str(request.id)) if fence else None)
        part = _counting_part.set(str(request.id))
        try:
            return super().on_chord_part_return(request, state, result, **kwargs)
        except FenceRefused:
            logger.warning("sqlease: chord part of task %s refused: its lease is gone", request.id)
            return None
        finally:
            _counting_part.reset(part)
            _writing_under.reset(token)
            if size is not None:
                request.chord = chord

    def _counted_before(self, request: Any) -> bool:
        """Was this chord part counted already, with nothing more to do for it? (A part
        whose count may have been the chord's last, with the callback never sent, is not:
        its redelivery must go on and send the callback.)"""
        group, part = getattr(request, "group", None), getattr(request, "id", None)
        if not group or not part or not getattr(request, "chord", None):
            return False
        pair = (self._key(self.get_key_for_chord(group)), str(part))
        return pair in self.results.parts_settled([pair])

    def set_chord_size(self, group_id: Any, chord_size: int) -> None:
        """Celery calls this while publishing a chord's header, with the number of parts that
        will report: a nested group counts each of its tasks, where the restored header
        (Celery's fallback, ``len(deps)``) counts it once. Without it, a header such as
        ``group(a, chain(b, group(c, d)))`` fires its body after two parts of three and then
        joins a part that has not run. Stored in the results table under the chord counter's
        own key, so it is expired and deleted with the counter."""
        self._put(self.get_key_for_chord(group_id), str(int(chord_size)), None, fence=None)

    def _chord_size(self, request: Any) -> int | None:
        """The size stored by :meth:`set_chord_size` for this part's chord, unless the
        request already carries one (None: Celery falls back to the restored header)."""
        chord, group = getattr(request, "chord", None), getattr(request, "group", None)
        if not group or not isinstance(chord, dict) or chord.get("chord_size") is not None:
            return None
        stored = self.get(self.get_key_for_chord(group))
        try:
            return None if stored is None else int(bytes_to_str(stored))
        except ValueError:
            return None

    # ---- the key/value primitives Celery builds on ------------------------------------

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
        return self.results.get(self._key(key))

    def mget(self, keys: Any) -> Any:
        return self.results.mget([self._key(k) for k in keys])

    def set(self, key: Any, value: Any) -> Any:
        return self._set_with_state(key, value, None)

    def _set_with_state(self, key: Any, value: Any, state: str | None) -> Any:
        writing = _writing_under.get()
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
        writing = _writing_under.get()
        part = _counting_part.get()
        expires = getattr(self, "expires", None)
        terms: dict[str, Any] = {
            "part": part,
            "part_expires_ms": int(expires * 1000) if part and expires else None,
        }
        if writing is not None:
            terms.update(fence=writing[0], task_id=writing[1])
        return self.results.incr(self._key(key), **terms)

    def expire(self, key: Any, value: Any) -> Any:
        self.results.expire(self._key(key), value)

    def cleanup(self) -> None:
        removed = self.results.cleanup()
        logger.info("sqlease: removed %d expired result rows", removed)

    # ---- waiting without polling --------------------------------------------------------

    def _waker(self) -> Waker:
        waker = getattr(self._local, "waker", None)
        if waker is None:
            waker = self.results.store.driver.waker(self.results.notify_channel)
            self._local.waker = waker
        return waker

    def _nap(
        self, waker: Waker, interval: float, timeout: float | None, elapsed: float
    ) -> list[str] | None:
        """Sleep until a notification (PostgreSQL) or a commit to the file (SQLite), the
        interval being only the safety net. Returns the notifications' payloads, if known."""
        nap = max(interval, 1.0) if isinstance(waker, PostgresListener) else interval
        if timeout is not None:
            nap = min(nap, timeout - elapsed)
        if isinstance(waker, PostgresListener):
            return waker.wait_payloads(max(nap, 0.0))
        waker.wait(max(nap, 0.0))
        return None

    def _ready_meta_from(self, payloads: list[str] | None, task_id: Any) -> Any:
        """A final result carried by its notification (``<key>\\n<value>``), decoded and
        cached as ``get_task_meta`` would; None when no payload holds one."""
        if not payloads or self.content_encoding == "binary":
            return None  # a binary serializer's value never travels as notification text
        key = bytes_to_str(self.get_key_for_task(task_id))
        for payload in reversed(payloads):  # the latest write wins
            name, sep, value = payload.partition("\n")
            if not sep or name != key:
                continue
            try:
                meta = self.decode_result(value)
            except Exception:  # not decodable here: read it back instead
                return None
            if meta.get("status") not in states.READY_STATES:
                return None
            if meta.get("status") == states.SUCCESS:
                self._cache[task_id] = meta
            return meta
        return None

    def on_task_call(self, producer: Any, task_id: Any) -> dict[str, Any]:
        """Celery calls this before it publishes a task. In a thread that already waits for
        results on PostgreSQL (it has a listener; a thread that never calls get() opens no
        connection for this): make sure it is listening now, so every write of this task's
        result, all later than this moment, is heard, and a get() can skip its first read."""
        waker = getattr(self._local, "waker", None)
        if isinstance(waker, PostgresListener) and waker.fileno() is not None:
            fresh = self._fresh()
            fresh[bytes_to_str(task_id)] = waker.generation
            while len(fresh) > FRESH_LIMIT:
                fresh.pop(next(iter(fresh)))
        return {}

    def _fresh(self) -> dict[str, int]:
        fresh: dict[str, int] | None = getattr(self._local, "fresh", None)
        if fresh is None:
            fresh = self._local.fresh = {}
        return fresh

    def _heard_since_publish(self, waker: Waker, task_id: Any) -> bool:
        """Was this thread listening, without a break, since before the task was published?
        Then its result cannot be stored yet without a notification waiting for us."""
        generation = self._fresh().pop(bytes_to_str(task_id), None)
        return (
            generation is not None
            and isinstance(waker, PostgresListener)
            and waker.connected
            and waker.generation == generation
        )

    def wait_for(
        self,
        task_id: Any,
        timeout: float | None = None,
        interval: float = 0.5,
        no_ack: bool = True,
        on_interval: Any = None,
    ) -> Any:
        self._ensure_not_eager()
        waker = self._waker()
        # Skip the first read when it cannot find the result (see on_task_call).
        look = not self._heard_since_publish(waker, task_id)
        waker.fileno()  # listen before the first look, so no notification is missed
        start = time.monotonic()
        while True:
            if look:
                meta = self.get_task_meta(task_id)
                if meta["status"] in states.READY_STATES:
                    return meta
            look = True
            if on_interval:
                on_interval()
            elapsed = time.monotonic() - start
            if timeout is not None and elapsed >= timeout:
                raise CeleryTimeoutError("The operation timed out.")
            payloads = self._nap(waker, interval, timeout, elapsed)
            # The result usually arrives with its notification: no read back needed.
            meta = self._ready_meta_from(payloads, task_id)
            if meta is not None:
                return meta

    def get_many(
        self,
        task_ids: Any,
        timeout: float | None = None,
        interval: float = 0.5,
        no_ack: bool = True,
        on_message: Any = None,
        on_interval: Any = None,
        max_iterations: int | None = None,
        READY_STATES: Any = states.READY_STATES,
    ) -> Any:
        interval = 0.5 if interval is None else interval
        ids = set(task_ids)
        for task_id in list(ids):
            cached = self._cache.get(task_id)
            if cached is not None and cached["status"] in READY_STATES:
                ids.discard(task_id)
                yield bytes_to_str(task_id), cached
        waker = self._waker()
        waker.fileno()
        start = time.monotonic()
        iterations = 0
        while ids:
            keys = list(ids)
            found = self._mget_to_results(
                self.mget([self.get_key_for_task(k) for k in keys]), keys, READY_STATES
            )
            self._cache.update(found)
            ids.difference_update({bytes_to_str(v) for v in found})
            for key, value in found.items():
                if on_message is not None:
                    on_message(value)
                yield bytes_to_str(key), value
            if not ids:
                break
            elapsed = time.monotonic() - start
            if timeout is not None and elapsed >= timeout:
                raise CeleryTimeoutError(f"Operation timed out ({timeout})")
            if on_interval:
                on_interval()
            self._nap(waker, interval, timeout, elapsed)
            iterations += 1
            if max_iterations and iterations >= max_iterations:
                break


def _offer_of(request: Any) -> Any:
    """The handoff offer the transport asked this delivery's final result to write, if any
    (``sqlease.delivery.OFFER_KEY``: set on a delivery its worker took while idle)."""
    properties = getattr(request, "properties", None) or {}
    info = properties.get("delivery_info") if isinstance(properties, dict) else None
    return info.get(OFFER_KEY) if isinstance(info, dict) else None
