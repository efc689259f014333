"""Django's task framework: ``django.tasks`` (Django 6.0+) or the ``django-tasks`` package that
provides the same API on Django 5.2."""

from __future__ import annotations

try:  # Django 6.0 and later
    from django.tasks import TaskContext, TaskResult, TaskResultStatus
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError
    from django.tasks.exceptions import TaskResultDoesNotExist
except ImportError:
    try:  # Django 5.2 with django-tasks
        from django_tasks import TaskContext, TaskResult, TaskResultStatus
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import Task, TaskError
        from django_tasks.exceptions import TaskResultDoesNotExist
    except ImportError as exc:
        # Django 5.2 without django-tasks. Raised as the absence of the tasks module itself, so
        # that Celery's autodiscover_tasks(), which imports every installed app's ``tasks``,
        # skips it rather than failing the worker of a project that runs no Django tasks.
        raise ModuleNotFoundError(
            "sqlease.contrib.django.tasks needs Django's task framework: Django 6.0 or later, "
            "or on Django 5.2 the django-tasks package (pip install 'django-tasks>=0.8')",
            name="sqlease.contrib.django.tasks",
        ) from exc

__all__ = [
    "BaseTaskBackend",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
]
