"""The Django Tasks backend: ``enqueue()`` publishes a sqlease message (joining an open
``atomic()`` block), options map onto the message, ``get_result()`` reads sqlease's record.
(A real worker runs them in tests/e2e/test_django_shop.py and the example's run.)"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery

from sqlease.admin import Admin
from sqlease.contrib.django._compat import Task, TaskResultDoesNotExist, TaskResultStatus
from sqlease.contrib.django.conf import url_of_alias
from sqlease.contrib.django.tasks import RUNNER, SqleaseBackend, celery_priority


def receipt(order_id: int) -> str:  # a module-level function (rebound to its Task below)
    return f"receipt {order_id}"


@pytest.fixture
def backend(celery_app: Celery) -> Iterator[Task]:
    from django.test import override_settings

    tasks = {"sq": {"BACKEND": "sqlease.contrib.django.tasks.SqleaseBackend",
                    "QUEUES": ["default", "mail"]}}  # fmt: skip
    celery_app.set_current()
    with override_settings(TASKS=tasks):
        # every field given: Django 6.0's Task has no defaults for priority and run_after
        task = Task(func=receipt, backend="sq", queue_name="default", priority=0, run_after=None)
        globals()["receipt"] = task  # what @task does: the module's name is the Task
        try:
            yield task
        finally:
            globals()["receipt"] = task.func


def test_enqueue_publishes_one_message_with_the_options(
    backend: Task, alias: str, prefix: str
) -> None:
    admin = Admin(url_of_alias(alias), table_prefix=prefix)
    result = backend.using(priority=100).enqueue(7)
    assert result.status == TaskResultStatus.READY
    snapshot = admin.task(result.id)
    assert (snapshot.state, snapshot.queue, snapshot.task_name) == ("queued", "default", RUNNER)
    assert snapshot.priority == 9
    later = backend.using(run_after=datetime.now(UTC) + timedelta(hours=1), queue_name="mail")
    scheduled = admin.task(later.enqueue(8).id)
    assert (scheduled.state, scheduled.queue) == ("scheduled", "mail")
    fetched = backend.get_result(result.id)
    assert fetched.status == TaskResultStatus.READY
    assert (fetched.args, fetched.kwargs, fetched.task.func) == ([7], {}, backend.func)
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result("no-such-task")


def test_enqueue_joins_the_atomic_block(backend: Task, alias: str, prefix: str) -> None:
    from django.db import transaction

    admin = Admin(url_of_alias(alias), table_prefix=prefix)
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        gone = backend.enqueue(1)
        raise RuntimeError
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result(gone.id)
    with transaction.atomic(using=alias):
        kept = backend.enqueue(2)
        assert admin.store.size("default") == 0  # not before the commit
    assert backend.get_result(kept.id).status == TaskResultStatus.READY


def test_the_priorities_keep_their_order() -> None:
    levels = [celery_priority(p) for p in (-100, -50, 0, 50, 100)]
    assert levels == sorted(levels)
    assert (levels[0], levels[-1]) == (0, 9)


def test_a_bad_option_is_named(alias: str) -> None:
    with pytest.raises(Exception, match=r"CELERY_APP.*dotted path"):
        SqleaseBackend("bad", {"OPTIONS": {"CELERY_APP": 3}})
    params: dict[str, Any] = {"QUEUES": ["default"]}
    assert SqleaseBackend("ok", params).supports_defer


def test_without_a_task_framework_autodiscovery_skips_the_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Django 5.2 without django-tasks: a worker's ``autodiscover_tasks()`` passes over this
    app's ``tasks`` module (the worker starts); importing it says what to install."""
    import importlib
    import sys

    from celery.loaders.base import find_related_module

    for name in ("django.tasks", "django_tasks"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it fails
    for name in ("sqlease.contrib.django._compat", "sqlease.contrib.django.tasks"):
        monkeypatch.delitem(sys.modules, name)
    assert find_related_module("sqlease.contrib.django", "tasks") is None
    with pytest.raises(ModuleNotFoundError, match=r"Django 6\.0 or later.*django-tasks"):
        importlib.import_module("sqlease.contrib.django.tasks")
