"""Waiting for results without polling: NOTIFY on PostgreSQL, the file's data_version on
SQLite, the interval only a safety net; a result usually arrives inside its notification."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import states
from celery.backends.base import KeyValueStoreBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError
from kombu.utils.encoding import bytes_to_str

from sqlease._db.wakeup import Waker

logger = logging.getLogger(__name__)

#: How many published task ids a thread remembers for on_task_call / wait_for.
FRESH_LIMIT = 1000


class PushedWaits(KeyValueStoreBackend):  # type: ignore[misc]
    """``AsyncResult.get()`` / ``join`` for the sqlease result backend (a mixin of it)."""

    def _waker(self) -> Waker:
        waker = getattr(self._local, "waker", None)
        if waker is None:
            results = self.results
            # Results are notified only while a waiting client holds these keys.
            waker = results.store.driver.waker(
                results.notify_channel, shared_keys=results.waiter_keys
            )
            self._local.waker = waker
        return waker

    def _nap(
        self, waker: Waker, interval: float, timeout: float | None, elapsed: float
    ) -> list[str] | None:
        """Sleep until a notification (PostgreSQL) or a commit to the file (SQLite), the
        interval being only the safety net. Returns the notifications' payloads, if known."""
        nap = max(interval, 1.0) if waker.pushes else interval
        if timeout is not None:
            nap = min(nap, timeout - elapsed)
        return waker.wait_payloads(max(nap, 0.0))

    def _wake(
        self,
        waker: Waker,
        start: float,
        interval: float,
        timeout: float | None,
        on_interval: Any,
    ) -> list[str] | None:
        """One turn of a wait for a task's result: Celery's ``on_interval``, the timeout, then
        the nap until a notification; returns its payloads (noted as heard)."""
        if on_interval:
            on_interval()
        elapsed = time.monotonic() - start
        if timeout is not None and elapsed >= timeout:
            raise CeleryTimeoutError("The operation timed out.")
        payloads = self._nap(waker, interval, timeout, elapsed)
        self._heard(payloads)
        return payloads

    def _ready_meta_from(self, payloads: list[str] | None, task_id: Any) -> Any:
        """A final result carried by its notification (``<key>\\n<value>``), decoded and
        cached as ``get_task_meta`` would; None when no payload holds one."""
        metas = self._metas_from(payloads, task_id)
        if not metas or metas[-1].get("status") not in states.READY_STATES:
            return None  # the latest write wins
        meta = metas[-1]
        if meta.get("status") == states.SUCCESS:
            self._cache[task_id] = meta
        return meta

    def _metas_from(self, payloads: list[str] | None, task_id: Any) -> list[Any] | None:
        """The states the notifications carried for ``task_id``, oldest first (empty: none
        named it); None when one named it without a value decodable here (read it back)."""
        if payloads is None:
            return None
        key = bytes_to_str(self.get_key_for_task(task_id))
        metas = []
        for payload in payloads:
            name, sep, value = payload.partition("\n")
            if name != key:
                continue
            # A binary serializer's value never travels as notification text.
            if not sep or self.content_encoding == "binary":
                return None
            try:
                metas.append(self.decode_result(value))
            except Exception:  # not decodable here: read it back instead
                return None
        return metas

    def on_task_call(self, producer: Any, task_id: Any) -> dict[str, Any]:
        """Celery calls this before it publishes a task. In a thread that already waits for
        results on PostgreSQL (it has a listener; a thread that never calls get() opens no
        connection for this): make sure it is listening now, so every write of this task's
        result, all later than this moment, is heard, and a get() can skip its first read."""
        waker: Waker | None = getattr(self._local, "waker", None)
        if waker is not None and waker.pushes and waker.fileno() is not None:
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
            and waker.pushes
            and waker.connected
            and waker.generation == generation
        )

    def _heard(self, payloads: list[str] | None) -> None:
        """Notifications read while waiting for one task are gone for the others: a task
        published by this thread whose write was among them is no longer 'unheard', so its
        own get() must read first rather than wait for a notification already consumed."""
        fresh = self._fresh()
        if not payloads or not fresh:
            return
        prefix = bytes_to_str(self.task_keyprefix)
        for payload in payloads:
            name = payload.partition("\n")[0]
            if name.startswith(prefix):
                fresh.pop(name[len(prefix) :], None)

    def _joined_failure(self, task_id: str) -> None:
        """A failure a join was given: ``is_cached`` says so while it is among the latest, as
        Celery's chord (``_failed_join_report``) asks it which part failed, to name it in the
        ChordError ("Dependency <id> raised ..."). Celery keeps no result cache by default
        (``result_cache_max``), so without this the part went unnamed."""
        failed: dict[str, None] | None = getattr(self._local, "joined_failures", None)
        if failed is None:
            failed = self._local.joined_failures = {}
        failed[task_id] = None
        while len(failed) > FRESH_LIMIT:
            failed.pop(next(iter(failed)))

    def is_cached(self, task_id: Any) -> bool:
        failed = getattr(self._local, "joined_failures", None) or {}
        return bool(super().is_cached(task_id) or bytes_to_str(task_id) in failed)

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
        start = time.monotonic()
        while True:
            listening = waker.connected
            if look:
                meta = self.get_task_meta(task_id)
                if meta["status"] in states.READY_STATES:
                    return _final(meta, on_interval)
            look = True
            if not listening and _listen(waker):
                continue  # read once more, listening: a write before that was not notified
            payloads = self._wake(waker, start, interval, timeout, on_interval)
            # The result usually arrives with its notification: no read back needed.
            meta = self._ready_meta_from(payloads, task_id)
            if meta is not None:
                return _final(meta, on_interval)

    def wait_for_pending(
        self,
        result: Any,
        timeout: float | None = None,
        interval: float = 0.5,
        no_ack: bool = True,
        on_message: Any = None,
        on_interval: Any = None,
        callback: Any = None,
        propagate: bool = True,
    ) -> Any:
        """Celery's, and ``AsyncResult.get(on_message=...)``: the callback is given each state
        the result takes while it is waited for (STARTED, RETRY, custom states such as
        PROGRESS, then the final one), as Redis's result backend gives it."""
        on_interval = self._parents_read_at_once(result, on_interval)
        if on_message is None:
            return super().wait_for_pending(
                result,
                timeout=timeout,
                interval=interval,
                no_ack=no_ack,
                on_interval=on_interval,
                callback=callback,
                propagate=propagate,
            )
        self._ensure_not_eager()
        meta = _final(
            self._wait_reporting(result.id, timeout, interval, on_message, on_interval), on_interval
        )
        result._maybe_set_cache(meta)
        return result.maybe_throw(propagate=propagate, callback=callback)

    def _wait_reporting(
        self,
        task_id: Any,
        timeout: float | None,
        interval: float,
        on_message: Any,
        on_interval: Any,
    ) -> Any:
        """Wait for ``task_id``'s final state, giving ``on_message`` every state seen on the
        way. On PostgreSQL each write's notification carries its state, so none is missed;
        where a notification carries none (SQLite, a value too large), the state is read
        back, and states written faster than that are seen as the latest of them."""
        waker = self._waker()
        waker.fileno()  # listen before the first read, so no later write goes unheard
        self._fresh().pop(bytes_to_str(task_id), None)
        reported: list[Any] = [None]

        def report(meta: Any) -> bool:
            if meta["status"] != states.PENDING and meta != reported[0]:
                reported[0] = meta
                on_message(meta)
            return bool(meta["status"] in states.READY_STATES)

        start = time.monotonic()
        meta = self.get_task_meta(task_id)
        while not report(meta):  # (a state already reported is not given again)
            payloads = self._wake(waker, start, interval, timeout, on_interval)
            # None carried (or the safety interval): read it back.
            for meta in self._metas_from(payloads, task_id) or [self.get_task_meta(task_id)]:
                if report(meta):
                    break
        if meta["status"] == states.SUCCESS:
            self._cache[task_id] = meta
        return meta

    def _parents_read_at_once(self, result: Any, on_interval: Any) -> Any:
        """Celery's ``on_interval`` for a result with parents reads each parent still pending,
        one by one, at every turn of the wait (a chord's header of 1,000 parts: 1,000 reads
        per result written, and a client next to an in-process worker kept it waiting). One
        ``mget`` reads them all first; the check then finds them read."""
        if not on_interval or getattr(result, "parent", None) is None:
            return on_interval

        @_Costly
        def check() -> Any:
            ids = _pending_parents(result)
            if len(ids) < 2:
                return on_interval()
            values = self.mget([self.get_key_for_task(i) for i in ids])
            self._local.read_at_once = dict(zip(ids, values, strict=True))
            try:
                return on_interval()
            finally:
                self._local.read_at_once = None

        return check

    def _get_task_meta_for(self, task_id: Any) -> Any:
        read: dict[str, Any] | None = getattr(self._local, "read_at_once", None)
        if read is not None and (key := bytes_to_str(task_id)) in read:
            value = read[key]
            if not value:
                return {"status": states.PENDING, "result": None}
            return self.decode_result(value)
        return super()._get_task_meta_for(task_id)

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
        start = time.monotonic()
        iterations = 0
        while ids:
            listening = waker.connected
            keys = list(ids)
            found = self._mget_to_results(
                self.mget([self.get_key_for_task(k) for k in keys]), keys, READY_STATES
            )
            self._cache.update(found)
            ids.difference_update({bytes_to_str(v) for v in found})
            for key, value in found.items():
                if on_message is not None:
                    on_message(value)
                if value["status"] in states.PROPAGATE_STATES:
                    self._joined_failure(bytes_to_str(key))
                yield bytes_to_str(key), value
            if not ids:
                break
            if not listening and _listen(waker):
                continue  # read once more, listening: a write before that was not notified
            elapsed = time.monotonic() - start
            if timeout is not None and elapsed >= timeout:
                raise CeleryTimeoutError(f"Operation timed out ({timeout})")
            if on_interval:
                on_interval()
            self._heard(self._nap(waker, interval, timeout, elapsed))
            iterations += 1
            if max_iterations and iterations >= max_iterations:
                break


def _listen(waker: Waker) -> bool:
    """Listen now (on PostgreSQL holding the waiters' keys, so that result writes notify:
    sqlease._core.waiters); True if the waker now pushes notifications. Only a wait whose
    first read found nothing listens, so a join of results already stored turns no
    notifications on."""
    return waker.pushes and waker.fileno() is not None


def _pending_parents(result: Any) -> list[str]:
    """The ids of ``result``'s parents (a group's each result) not known final yet, as
    Celery's ``AsyncResult._maybe_reraise_parent_error`` will read them."""
    ids: list[str] = []
    node = getattr(result, "parent", None)
    while node is not None:
        stack = [node]
        while stack:
            item = stack.pop()
            nested = getattr(item, "results", None)
            if nested is not None:
                stack.extend(nested)
            elif getattr(item, "_cache", None) is None and getattr(item, "id", None):
                ids.append(bytes_to_str(item.id))
        node = getattr(node, "parent", None)
    return ids


def _final(meta: Any, on_interval: Any) -> Any:
    """A failure is returned only after a last parent check, so that a parent's failure is
    raised first, as at every turn while the check is cheap (``_Costly``)."""
    if meta.get("status") in states.PROPAGATE_STATES and isinstance(on_interval, _Costly):
        on_interval(force=True)
    return meta


class _Costly:
    """A parent check (``_parents_read_at_once``) at each turn of a wait while it is cheap,
    so that a part's failure is raised as soon as it is written, before the chord's own
    error; once it costs, for no more than a tenth of the wait (a header of 1,000 parts,
    checked at every result written, kept an in-process worker waiting)."""

    __slots__ = ("_call", "_cost", "_last")

    #: A check cheaper than this runs at every turn.
    CHEAP = 0.01
    #: The clock that times the checks (a test's fake clock in their tests).
    clock = staticmethod(time.monotonic)

    def __init__(self, call: Any) -> None:
        self._call = call
        self._last: float | None = None
        self._cost = 0.0

    def __call__(self, force: bool = False) -> Any:
        now = self.clock()
        costly = self._cost >= self.CHEAP
        if not force and costly and self._last is not None and now - self._last < 10 * self._cost:
            return None
        self._last = now
        try:
            return self._call()
        finally:
            self._cost = self.clock() - now
