"""A Django Tasks backend on sqlease: ``@task`` functions run by ``celery worker`` under leases.

    TASKS = {"default": {"BACKEND": "sqlease.contrib.django.tasks.SqleaseBackend",
                         "QUEUES": ["default"],
                         "OPTIONS": {"CELERY_APP": "proj.celery.app"}}}

``enqueue()`` publishes one Celery message (the task ``run_django_task``, defined here,
whose arguments are the Django task's module path and arguments) with the app's broker: a
sqlease broker (``sqlease+django://ALIAS`` or a URL). So each Django task gets what a sqlease
task gets: a lease and its heartbeat, fencing, ``max_attempts``, takeover after a crash;
``run_after`` becomes the ETA, the priority (-100..100) maps onto Celery's 0..9 (higher
first), the queue name is the Celery queue. Inside ``transaction.atomic()`` on the broker's
database the enqueue joins the transaction (``sqlease.contrib.django.joining``).

A worker runs them once it has imported this module: ``app.autodiscover_tasks()`` does it
for every installed app, this one included. ``get_result()`` reads the task's sqlease record
(its state, attempts and times) and its outcome from the app's result backend (which must be
configured, e.g. ``sqlease+django://ALIAS`` too).
"""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, datetime
from typing import Any

from celery import current_app, shared_task

from sqlease.contrib.django._compat import (
    BaseTaskBackend,
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
)
from sqlease.errors import ConfigurationError, UnknownTask

#: The Celery task that runs a Django task in a worker.
RUNNER = "sqlease.contrib.django.tasks.run_django_task"

_STATUS = {
    "succeeded": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
    "running": TaskResultStatus.RUNNING,
}


def celery_priority(priority: int) -> int:
    """Django's -100..100 onto Celery's 0..9 (both: higher runs first)."""
    return round((priority + 100) * 9 / 200)


class TasksBackend(BaseTaskBackend):  # type: ignore[misc]
    """Django tasks as sqlease messages (see the module); its documented path is
    ``sqlease.contrib.django.tasks.SqleaseBackend``."""

    supports_defer = True  # run_after: the message's ETA, held in SQL
    supports_async_task = False  # the worker calls the function; coroutines are not run
    supports_get_result = True  # from any process: sqlease's records and result backend
    supports_priority = True  # in the claim's order (Celery's 0..9 levels)

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        app = self.options.get("CELERY_APP")
        if app is not None and not isinstance(app, str):
            raise ConfigurationError(
                f"TASKS[{alias!r}]['OPTIONS']['CELERY_APP'] must be a dotted path to a Celery "
                f"app, not {app!r}"
            )
        self._app_path = app
        self._app: Any = None

    @property
    def app(self) -> Any:
        """The Celery app that publishes: ``OPTIONS["CELERY_APP"]``, else the current app."""
        if self._app is None:
            if self._app_path is None:
                self._app = current_app._get_current_object()
            else:
                from django.utils.module_loading import import_string

                self._app = import_string(self._app_path)
        return self._app

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        self.validate_task(task)
        task_id = str(uuid.uuid4())
        options: dict[str, Any] = {
            "task_id": task_id,
            "queue": task.queue_name,
            "priority": celery_priority(task.priority),
        }
        if task.run_after is not None:
            options["eta"] = task.run_after
        self.app.send_task(
            RUNNER, args=(task.module_path, list(args), dict(kwargs), self.alias), **options
        )
        return _result(task, task_id, TaskResultStatus.READY, list(args), dict(kwargs), self.alias)

    def get_result(self, result_id: str) -> TaskResult:
        from sqlease.admin import Admin

        admin = Admin(self.app.conf.broker_url, table_prefix=_prefix(self.app))
        try:
            snapshot = admin.task(result_id)
        except UnknownTask:
            raise TaskResultDoesNotExist(result_id) from None
        call = _call_of(admin, snapshot)
        if call is None:
            raise TaskResultDoesNotExist(f"{result_id} is no Django task")
        module_path, args, kwargs = call
        from django.utils.module_loading import import_string

        task = import_string(module_path)
        status = _STATUS.get(snapshot.state, TaskResultStatus.READY)
        result = _result(task, result_id, status, args, kwargs, self.alias, snapshot)
        if status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED):
            outcome = self.app.AsyncResult(result_id)
            if status == TaskResultStatus.SUCCESSFUL:
                object.__setattr__(result, "_return_value", outcome.result)
            else:
                error = outcome.result
                path = (
                    f"{type(error).__module__}.{type(error).__qualname__}"
                    if isinstance(error, BaseException)
                    else "sqlease.errors.SqleaseError"  # cancelled, attempts exhausted
                )
                trace = outcome.traceback or snapshot.last_error or snapshot.reason or ""
                result.errors.append(TaskError(exception_class_path=path, traceback=trace))
        return result


#: The name settings use (``TASKS[…]["BACKEND"]``); the class has its own so that no two of
#: sqlease's classes share a name (the Celery result backend is ``SqleaseBackend`` too).
SqleaseBackend = TasksBackend


def _prefix(app: Any) -> str:
    options = app.conf.broker_transport_options or {}
    return str(options.get("table_prefix", "sqlease_"))


def _at(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=UTC)


def _result(
    task: Task,
    task_id: str,
    status: Any,
    args: list[Any],
    kwargs: dict[str, Any],
    backend: str,
    snapshot: Any = None,
) -> TaskResult:
    started = [e for e in (snapshot.events if snapshot else []) if e.get("kind") == "started"]
    return TaskResult(
        task=task,
        id=task_id,
        status=status,
        enqueued_at=_at(snapshot.created_at_ms) if snapshot else datetime.now(UTC),
        started_at=_at(started[0].get("at_ms")) if started else None,
        finished_at=_at(snapshot.finished_at_ms) if snapshot else None,
        last_attempted_at=_at(started[-1].get("at_ms")) if started else None,
        args=args,
        kwargs=kwargs,
        backend=backend,
        errors=[],
        # one entry per delivery that started (Django counts attempts by them)
        worker_ids=[str(e.get("owner") or e.get("attempt") or "") for e in started],
    )


def _call_of(admin: Any, snapshot: Any) -> tuple[str, list[Any], dict[str, Any]] | None:
    """The Django task's module path and arguments: from its message while it is kept, else
    from the checkpoint the runner wrote when it started."""
    if snapshot.task_name not in (None, RUNNER):
        return None
    recorded = snapshot.checkpoint.get("django_task")
    if recorded:
        return recorded["module_path"], recorded["args"], recorded["kwargs"]
    if snapshot.message_id is None:
        return None
    message = admin.store.get_message(snapshot.message_id)
    if message is None:
        return None
    payload = json.loads(message.payload)
    body = payload["body"]
    if payload.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body).decode("utf-8")
    runner_args = json.loads(body)[0]
    return runner_args[0], runner_args[1], runner_args[2]


@shared_task(name=RUNNER, bind=True)  # type: ignore[untyped-decorator]
def run_django_task(
    self: Any, module_path: str, args: list[Any], kwargs: dict[str, Any], backend: str
) -> Any:
    """Run one Django task in a Celery worker (under the delivery's lease)."""
    from django.utils.module_loading import import_string

    import sqlease

    task = import_string(module_path)
    if not isinstance(task, Task):
        raise ConfigurationError(f"{module_path!r} is not a Django task (@task)")
    ctx = sqlease.context()
    if "django_task" not in ctx.state:  # get_result() reads it once the message is gone
        call = {"module_path": module_path, "args": args, "kwargs": kwargs}
        ctx.checkpoint({"django_task": call})
    if task.takes_context:
        running = _result(task, self.request.id, TaskResultStatus.RUNNING, args, kwargs, backend)
        object.__setattr__(running, "worker_ids", [self.request.hostname or ""] * ctx.attempt)
        return task.call(TaskContext(task_result=running), *args, **kwargs)
    return task.call(*args, **kwargs)
