"""A task's default concurrency key and limit, and its uniqueness key, from its own options.

``@app.task(concurrency_key="tenant:{tenant_id}", concurrency_limit=3)``: every publish of
the task that does not carry a ``concurrency_key`` header gets one, formatted with the call's
keyword arguments (and ``args`` as ``{args[0]}``), or returned by the option when it is a
callable taking the call's ``(*args, **kwargs)``. ``@app.task(unique_key="report:{user}",
unique_scope="active", unique_for=None)`` does the same for the ``unique_key``,
``unique_scope`` and ``unique_for`` headers. Applied by a ``before_task_publish`` handler,
which Celery calls with the headers it is about to send.
"""

from __future__ import annotations

import inspect
from typing import Any

from celery import signals

from sqlease.errors import ConfigurationError

#: The headers that carry a task option's error to the transport, which refuses the publish
#: (sqlease.transport._codec reads them).
ERROR_HEADER = "sqlease_concurrency_error"
UNIQUE_ERROR_HEADER = "sqlease_unique_error"


def _call_of(body: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # Protocol 2: (args, kwargs, embed); protocol 1: a dict with args and kwargs.
    if isinstance(body, tuple | list) and len(body) >= 2:
        return tuple(body[0] or ()), dict(body[1] or {})
    if isinstance(body, dict):
        return tuple(body.get("args") or ()), dict(body.get("kwargs") or {})
    return (), {}


def key_for(task: Any, body: Any) -> tuple[str, int] | None:
    """The task's default key and limit for this call, or None if it has none."""
    # From the class: a function set as a task option would be bound to the task instance.
    template = getattr(type(task), "concurrency_key", getattr(task, "concurrency_key", None))
    limit = getattr(task, "concurrency_limit", None)
    if template is None and limit is None:
        return None
    name = getattr(task, "name", task)
    if template is None or limit is None:
        raise ConfigurationError(
            f"task {name!r} sets only one of concurrency_key and concurrency_limit: give both"
        )
    return _format(task, "concurrency_key", template, body), limit


def _format(task: Any, option: str, template: Any, body: Any) -> Any:
    """The option's key for this call: the template formatted with its arguments, or what
    the callable returns for them."""
    args, kwargs = _call_of(body)
    try:
        # Positional arguments by their parameter names too: delay("acme") fills {tenant}.
        bound = inspect.signature(task.run).bind_partial(*args, **kwargs).arguments
        kwargs = {**bound, **kwargs}
    except (TypeError, ValueError):
        pass
    try:
        return (
            template(*args, **kwargs)
            if callable(template)
            else str(template).format(*args, args=args, **kwargs)
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"task {getattr(task, 'name', task)!r}: {option} {template!r} could not be made "
            f"from the call's arguments ({type(exc).__name__}: {exc}); the task was not sent"
        ) from None


def unique_for(task: Any, body: Any) -> dict[str, Any] | None:
    """The task's uniqueness headers for this call, or None if it sets no ``unique_key``."""
    template = getattr(type(task), "unique_key", getattr(task, "unique_key", None))
    scope = getattr(task, "unique_scope", None)
    period = getattr(task, "unique_for", None)
    if template is None:
        if scope is not None or period is not None:
            raise ConfigurationError(
                f"task {getattr(task, 'name', task)!r} sets unique_scope or unique_for "
                "without a unique_key"
            )
        return None
    headers = {"unique_key": _format(task, "unique_key", template, body)}
    if scope is not None:
        headers["unique_scope"] = scope
    if period is not None:
        headers["unique_for"] = period
    return headers


def _task_named(name: str) -> Any:
    """The task the publish is for: the signal names it but not its app, so the current app
    is asked first, then every other live app (an app made with ``set_as_current=False``)."""
    from celery import _state

    current = _state.get_current_app()
    apps = [current, *(a for a in _state._get_active_apps() if a is not current)]
    for app in apps:
        if app.finalized or app is current:
            task = app.tasks.get(name)
            if task is not None:
                return task
    return None


def _apply_task_default(
    sender: Any = None, body: Any = None, headers: Any = None, **_: Any
) -> None:
    if not isinstance(headers, dict):
        return
    task = _task_named(sender) if isinstance(sender, str) else None
    if task is not None and "unique_key" not in headers:
        try:
            headers.update(unique_for(task, body) or {})
        except ConfigurationError as exc:
            headers[UNIQUE_ERROR_HEADER] = str(exc)
    if "concurrency_key" in headers:
        return
    try:
        found = None if task is None else key_for(task, body)
    except ConfigurationError as exc:
        # Celery logs and swallows a handler's exception; the transport refuses the message
        # at publish with this text instead (sqlease.transport._codec).
        headers[ERROR_HEADER] = str(exc)
        return
    if found is not None:
        headers["concurrency_key"], headers["concurrency_limit"] = found


signals.before_task_publish.connect(_apply_task_default, weak=False)


def task_rate_limits() -> dict[str, str]:
    """The ``rate_limit`` of each task of the worker's app, as ``{"task:<name>": rate}``
    (the ``cluster_rate_limits`` transport option)."""
    from celery import current_app

    found: dict[str, str] = {}
    for name, task in current_app.tasks.items():
        limit = getattr(task, "rate_limit", None)
        if limit:
            found[f"task:{name}"] = str(limit)
    return found


def write_limits(store: Any, options: Any) -> None:
    """A consuming worker's ``concurrency_limits``, ``rate_limits`` and (with
    ``cluster_rate_limits``) its tasks' own rate limits become the cluster's, replacing those
    in the database; an option left unset leaves the database's as they are (every worker
    should carry the same; the last one to start wins)."""
    if options.concurrency_limits is not None:
        store.set_limits(options.concurrency_limits, replace=True)
    rates = dict(options.rate_limits or {})
    if options.cluster_rate_limits:
        rates = task_rate_limits() | rates
    if options.rate_limits is not None or options.cluster_rate_limits:
        store.set_rate_limits(rates, replace=True)
