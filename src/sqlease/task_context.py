"""``sqlease.context()``: a task's view of its own delivery, and writes fenced by its lease.

Inside a task delivered by sqlease::

    ctx = sqlease.context()
    page = ctx.state.get("page", 0)        # the last checkpoint ({} on the first attempt)
    ctx.checkpoint({"page": page + 1})     # saved under the lease; LeaseLost if it is gone
    charge = ctx.step("charge", charge_card, order_id)   # runs once across redeliveries

Every write goes through the database's compare-and-set on ``(message id, owner, attempt)``:
a delivery that lost its lease (taken over after a stall, paused, cancelled) gets
``LeaseLost`` and writes nothing. ``LeaseLost`` is a Celery ``Ignore``: letting it propagate
stops the task without a failure or a retry being recorded.

Before the database, the delivery's lease clock (sqlease._core.lease_clock): once it has run
out (the worker could not renew the lease in time, e.g. cut off from the database), every
write raises ``LeaseLost`` at once, without a round trip; and no write waits for the database
longer than the lease has left (sqlease._db.bounds).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from sqlease._core.delivery_lease import DeliveryLease
from sqlease._core.lease_clock import DeliveryClock
from sqlease._core.names import check_id
from sqlease._core.steps import StepStore
from sqlease.errors import ContextUnavailable, LeaseLost, OutcomeUnknown
from sqlease.store import Fence, Outcome, Store

logger = logging.getLogger(__name__)

_stores: dict[int, tuple[Store, int]] = {}
_stores_lock = threading.Lock()
_CAS_RETRIES = 5


def _store_for_app(app: Any) -> tuple[Store, int]:
    """The broker's store (and lease length) as configured for ``app``."""
    key = id(app)
    with _stores_lock:
        found = _stores.get(key)
        if found is not None:
            return found
    from sqlease.transport import Transport

    conn = app.connection_for_write()
    try:
        transport = conn.transport
        if not isinstance(transport, Transport):
            raise ContextUnavailable(
                f"sqlease.context() needs the sqlease broker; this app uses "
                f"{type(transport).__module__}"
            )
        found = (transport.store, transport.options.lease_ms)
    finally:
        conn.release()
    with _stores_lock:
        _stores[key] = found
    return found


class TaskContext:
    """One delivery of one task, as seen from inside it."""

    def __init__(
        self,
        store: Store,
        fence: Fence,
        *,
        task_id: str,
        run_id: str | None = None,
        lease_ms: int = 60_000,
        task: Any = None,
        clock: DeliveryClock | None = None,
    ) -> None:
        self.store = store
        self.fence = fence
        self.task_id = task_id
        self.run_id = run_id
        self.lease_ms = lease_ms
        self._task = task
        self._state: dict[str, Any] | None = None
        self._revision = 0
        self._steps = StepStore(store)
        #: The delivery's lease clock (without one from the worker: the task's own renewals)
        #: and the guard around every call made for it.
        self._lease = DeliveryLease(
            fence, clock if clock is not None else DeliveryClock(lease_ms / 1000.0)
        )
        self.clock = self._lease.clock
        self._lost_event: threading.Event | None = None

    # ---- identity ----------------------------------------------------------------------

    @property
    def attempt(self) -> int:
        """The delivery generation: 1 on the first delivery, +1 on every redelivery."""
        return self.fence.attempt

    @property
    def message_id(self) -> int:
        return self.fence.message_id

    # ---- state and checkpoints -----------------------------------------------------------

    def _load(self) -> None:
        with self._lease.within("state read"):
            record = self.store.get_task(self.task_id)
        if record is None:
            self._state, self._revision = {}, 0
        else:
            self._state, self._revision = dict(record.checkpoint), record.revision

    @property
    def state(self) -> Mapping[str, Any]:
        """The last checkpoint (read-only); empty on a task's first delivery."""
        if self._state is None:
            self._load()
        assert self._state is not None
        return MappingProxyType(self._state)

    @property
    def revision(self) -> int:
        if self._state is None:
            self._load()
        return self._revision

    def checkpoint(
        self,
        patch: Mapping[str, Any] | None = None,
        *,
        progress: tuple[int, int | None] | None = None,
        **values: Any,
    ) -> Mapping[str, Any]:
        """Merge ``patch`` (and keyword values) into the saved state in one fenced
        compare-and-set, renewing the lease. Raises ``LeaseLost`` if the database says this
        delivery no longer holds it. ``progress=(done, total)`` also publishes Celery's
        ``PROGRESS`` state (``AsyncResult.info``)."""
        changes = dict(patch or {})
        changes.update(values)
        if progress is not None:
            done, total = progress
            changes["_progress"] = {"done": done, "total": total}
        try:
            json.dumps(changes)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"checkpoint values must be JSON-serializable: {exc}") from exc
        for _ in range(_CAS_RETRIES):
            merged = {**self.state, **changes}
            sent = self._lease.check("checkpoint")
            with self._lease.within("checkpoint"):
                result = self.store.compare_and_set(
                    self.fence,
                    self.task_id,
                    self._revision,
                    checkpoint=merged,
                    lease_ms=self.lease_ms,
                    state="running",
                    run_id=self.run_id,
                )
            if result.outcome is Outcome.UPDATED:
                assert result.revision is not None
                self._lease.confirmed(sent)  # the checkpoint renewed the lease
                self._state, self._revision = merged, result.revision
                break
            if result.outcome is Outcome.LEASE_LOST:
                raise self._lease.refused("checkpoint refused by the database")
            self._load()  # someone else wrote (an admin, a step): merge onto theirs
        else:
            raise LeaseLost(
                self.fence.message_id,
                self.fence.attempt,
                "checkpoint kept conflicting with concurrent writes",
            )
        if progress is not None:
            self.progress(*progress)
        return self.state

    def progress(self, done: int, total: int | None = None, **meta: Any) -> None:
        """Publish ``PROGRESS`` with ``{"done", "total", …}`` through the result backend (the
        backend fences it by this delivery's lease)."""
        if self._task is None:
            return
        info = {"done": done, "total": total, **meta}
        self._task.update_state(state="PROGRESS", meta=info)

    # ---- the lease -------------------------------------------------------------------------

    @property
    def lease_lost(self) -> bool:
        """Is this delivery's lease gone? The lease clock answers first (no round trip once
        it has run out); while it runs, the database is asked (within what is left)."""
        if self.clock.lost():
            return True
        try:
            with self._lease.within("lease check"):
                held = self.store.is_held(self.fence)
        except LeaseLost:
            return True
        if not held:
            self.clock.mark_lost()
        return not held

    @property
    def deadline(self) -> float | None:
        """The last moment, on ``time.monotonic()``'s clock, at which this delivery can still
        hold its lease, counted from the last renewal the database confirmed; ``-inf`` once the
        lease is known lost; None if nothing is known yet."""
        return self.clock.deadline()

    def remaining(self) -> float | None:
        """Seconds until ``deadline`` (0.0 once the lease is known lost; None if unknown)."""
        return self.clock.remaining()

    @property
    def lease_lost_event(self) -> threading.Event:
        """A ``threading.Event`` set as soon as the lease is known lost (by its clock, or by
        the worker's refused renewal), for code that waits on something else:
        ``ctx.lease_lost_event.wait(timeout)``."""
        if self._lost_event is None:
            event = threading.Event()
            self._lost_event = event
            self.on_lease_lost(event.set)
        return self._lost_event

    def on_lease_lost(self, callback: Callable[[], Any]) -> None:
        """Call ``callback()`` once, from another thread, as soon as the lease is known lost
        (at once if it is). Nothing is called after the task has returned."""
        self._lease.watch(callback)

    def ensure_lease(self) -> None:
        """Renew the lease now; ``LeaseLost`` if the database no longer grants it (or its clock
        ran out, without a round trip)."""
        sent = self._lease.check("renewal")
        with self._lease.within("renewal"):
            held = self.store.renew([self.fence], lease_ms=self.lease_ms)
        if self.fence.message_id not in held:
            raise self._lease.refused("renewal refused")
        self._lease.confirmed(sent)

    def event(self, kind: str, data: Any = None) -> None:
        """Append an event to the task's timeline, under the lease."""
        if not isinstance(kind, str) or not kind:
            raise ValueError("an event kind is a non-empty string")
        check_id("event kind", kind)  # what PostgreSQL cannot store, refused by name
        self._lease.check("event")
        with self._lease.within("event"):
            written = self.store.append_event(self.fence, kind, data, task_id=self.task_id)
        if not written:
            raise self._lease.refused("event refused")

    def close(self) -> None:
        """The task returned: no more lease-lost callbacks for it."""
        self._lease.close()

    # ---- durable steps ---------------------------------------------------------------------

    def step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once for this task across deliveries and return its
        (JSON) result; a later delivery gets the stored result without calling ``fn``.

        A step that started in an earlier delivery and never recorded an outcome (the worker
        died inside it) raises ``OutcomeUnknown``: its side effect may or may not have
        happened. Pass ``idempotent=True`` (reserved keyword) to run such a step again.
        """
        idempotent = bool(kwargs.pop("idempotent", False))
        if not isinstance(name, str) or not name:
            raise ValueError("a step name is a non-empty string")
        check_id("step name", name)  # the key of its record
        self._lease.check(f"step {name!r}")
        with self._lease.within(f"step {name!r}"):
            record = self._steps.get(self.task_id, name)
        if record is not None and record.status == "succeeded":
            return record.result
        if record is not None and record.status in ("started", "outcome_unknown"):
            if (record.message_id, record.attempt) == (self.fence.message_id, self.fence.attempt):
                raise RuntimeError(
                    f"step {name!r} is already running in this delivery; step names must be "
                    "unique within a task"
                )
            if not idempotent:
                with self._lease.within(f"step {name!r}"):
                    self._steps.mark_unknown(self.fence, self.task_id, name)
                raise OutcomeUnknown(self.task_id, name)
        with self._lease.within(f"step {name!r}"):
            started = self._steps.start(self.fence, self.task_id, name)
        if not started:
            raise self._lease.refused(f"step {name!r} refused")
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            if not self._finish_step(name, error=f"{type(exc).__name__}: {exc}"):
                raise self._lease.refused(f"step {name!r} outcome refused") from exc
            raise
        try:
            json.dumps(result)
            stored = result
            unserializable: str | None = None
        except (TypeError, ValueError) as exc:
            stored, unserializable = None, str(exc)
        if not self._finish_step(name, result=stored):
            raise self._lease.refused(f"step {name!r} outcome refused")
        if unserializable is not None:
            raise TypeError(
                f"step {name!r} finished (recorded as succeeded), but its result is not "
                f"JSON-serializable and was stored as null: {unserializable}"
            )
        return result

    def _finish_step(self, name: str, *, result: Any = None, error: str | None = None) -> bool:
        """Record a step's outcome (False: refused); ``LeaseLost`` at once once the lease
        clock ran out."""
        self._lease.check(f"step {name!r} outcome")
        with self._lease.within(f"step {name!r} outcome"):
            return self._steps.finish(self.fence, self.task_id, name, result=result, error=error)

    # ---- waiting for a person (parks the delivery) ------------------------------------------

    def wait_for_input(
        self, prompt: str, *, schema: Mapping[str, Any] | None = None, key: str | None = None
    ) -> Any:
        """Return the answer a person gave through ``Admin.provide_input`` (validated against
        ``schema``, a JSON-Schema subset). Until there is one, the task is parked (no lease, no
        worker held) and stops here with ``WaitingForPerson``; the delivery after the answer
        runs the task again from its checkpoint and this call returns the answer."""
        from sqlease._core.waits import wait_for_input

        with self._lease.within("wait for input"):
            return wait_for_input(
                self.store, self.fence, self.task_id, prompt, schema=schema, key=key
            )

    def wait_for_approval(
        self, summary: str, *, key: str | None = None, **details: Any
    ) -> dict[str, Any]:
        """Like ``wait_for_input`` for a yes/no decision: returns ``{"approved": True, "note":
        …}`` after ``Admin.approve`` or ``{"approved": False, "reason": …}`` after
        ``Admin.reject``."""
        from sqlease._core.waits import wait_for_approval

        with self._lease.within("wait for approval"):
            return wait_for_approval(
                self.store, self.fence, self.task_id, summary, key=key, **details
            )


def context() -> TaskContext:
    """The current delivery's context; raises ``ContextUnavailable`` outside a task delivered
    by sqlease (e.g. ``task.apply()``, eager mode, another broker)."""
    from celery import current_task

    task = current_task
    request = getattr(task, "request", None) if task is not None else None
    if request is None or getattr(request, "id", None) is None:
        raise ContextUnavailable("sqlease.context() is only available inside a running task")
    cached = getattr(request, "_sqlease_context", None)
    if isinstance(cached, TaskContext):
        return cached
    from sqlease.delivery import CLOCK_KEY, LEASE_KEY, fence_of

    properties = getattr(request, "properties", None) or {}
    delivery_info = properties.get("delivery_info") or {}
    fence = fence_of(delivery_info)
    if fence is None:
        raise ContextUnavailable(
            f"task {request.id} was not delivered by sqlease (called directly, eagerly, or "
            "through another broker); sqlease.context() needs a sqlease delivery"
        )
    if getattr(task, "acks_late", True) is False:
        raise ContextUnavailable(
            f"task {request.name if hasattr(request, 'name') else task.name} acknowledges "
            "early (acks_late=False): its delivery ended before it ran, so there is no lease "
            "to write under; sqlease.context() needs acks_late (sqlease's default)"
        )
    store, lease_ms = _store_for_app(task.app)
    run_id = getattr(request, "run_id", None)
    lease_ms = int(delivery_info.get(LEASE_KEY) or lease_ms)
    ctx = TaskContext(
        store,
        fence,
        task_id=str(request.id),
        run_id=None if run_id is None else str(run_id),
        lease_ms=lease_ms,
        task=task,
        # The worker's heartbeat publishes the deadline there (in this process or, for a
        # pool child, in its parent).
        clock=DeliveryLease.of(fence, lease_ms, delivery_info.get(CLOCK_KEY)).clock,
    )
    ctx.ensure_lease()  # a delivery renews once when it starts; refused if already lost
    request._sqlease_context = ctx
    return ctx
