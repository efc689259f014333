"""A Celery group whose app's broker is sqlease publishes as one batch (``sqlease.batch()``):
its tasks in one transaction, all or nothing, instead of one commit each. A chord's header
(``chord.run`` publishes it with ``header.apply_async``) and ``chunks`` (a group of
``xstarmap`` tasks) are groups too; a group inside a group, or inside the caller's own
``batch()`` block, joins the outer batch.

Celery offers no hook around a group's publication: ``group.apply_async`` acquires one
producer and calls each task's ``apply_async`` with it (``group._apply_tasks``), and the
signals (``before_task_publish``, ``after_task_publish``) are per task. So the method is
wrapped, once per process, and the wrapper changes nothing for an app whose broker is not
sqlease (nor for eager apps: nothing is published there).
"""

from __future__ import annotations

import functools
from typing import Any

from celery import canvas

from sqlease._celery.defaults import uses_sqlease

#: Marks the wrapper (installed once, however often this module is reloaded).
_WRAPPED = "__sqlease_batch__"


def _wrap(apply_async: Any) -> Any:
    @functools.wraps(apply_async)
    def publish_as_one_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        app = self.app
        if app.conf.task_always_eager or not uses_sqlease(app):
            return apply_async(self, *args, **kwargs)
        from sqlease.batches import batch  # on first use: ``import sqlease`` stays light

        with batch():
            return apply_async(self, *args, **kwargs)

    setattr(publish_as_one_batch, _WRAPPED, True)
    return publish_as_one_batch


def install() -> None:
    """Wrap ``celery.canvas.group.apply_async`` (once)."""
    if not getattr(canvas.group.apply_async, _WRAPPED, False):
        canvas.group.apply_async = _wrap(canvas.group.apply_async)  # type: ignore[method-assign]


install()
