"""Durable by default: a Celery app whose broker is sqlease acknowledges tasks late and
requeues a task whose worker process died, unless the app says otherwise.

Celery acks a task *before* running it unless ``task_acks_late`` is set; then a worker killed
mid-task loses it. Celery binds those settings to task classes when the app is finalized, so
the defaults are changed just before that (``connect_on_app_finalize``), only for settings the
app did not set itself, and so that per-task options (``@app.task(acks_late=False)``) still win.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals
from celery._state import connect_on_app_finalize

from sqlease._celery import lease_interrupt as _lease_interrupt  # noqa: F401 (task signals)
from sqlease._celery import task_limits as _task_limits  # noqa: F401 (its publish handler)

logger = logging.getLogger(__name__)

_DEFAULTS = {
    # setting: (old-style name, durable value)
    "task_acks_late": ("CELERY_ACKS_LATE", True),
    "task_reject_on_worker_lost": ("CELERY_REJECT_ON_WORKER_LOST", True),
}


def broker_urls(app: Any) -> list[str]:
    """The broker URLs an app is configured with (``conf.broker_url`` also reads the
    ``CELERY_BROKER_URL`` environment variable)."""
    conf = app.conf
    found: list[str] = []
    for value in (
        getattr(conf, "broker_url", None),
        conf.get("broker_read_url"),
        conf.get("broker_write_url"),
    ):
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, str) and item.strip():
                found.append(item.strip())
    return found


def sqlease_transport_setting(app: Any) -> bool:
    """``broker_transport`` names sqlease's transport (then the URL is a plain SQL URL)."""
    transport = app.conf.get("broker_transport")
    if transport is None:
        return False
    name = transport if isinstance(transport, str) else getattr(transport, "__module__", "")
    return "sqlease" in str(name)


def uses_sqlease(app: Any) -> bool:
    if sqlease_transport_setting(app):
        return True
    return any(url.lower().startswith("sqlease") for url in broker_urls(app))


def _explicit(conf: Any, *keys: str) -> bool:
    # Settings is a chain: [changes, the app's config sources…, Celery's defaults].
    maps = getattr(conf, "maps", None)
    if not maps:
        return False
    return any(key in layer for layer in maps[:-1] for key in keys)


def _durable_defaults(app: Any) -> None:
    try:
        if not uses_sqlease(app):
            return
        for key, (old_key, value) in _DEFAULTS.items():
            if not _explicit(app.conf, key, old_key):
                app.conf[key] = value
        options = app.conf.get("broker_transport_options") or {}
        if options.get("cluster_rate_limits") and not _explicit(
            app.conf, "worker_disable_rate_limits", "CELERY_DISABLE_RATE_LIMITS"
        ):
            # The claim enforces each task's rate_limit across the cluster; Celery's own
            # per-worker bucket would only hold claimed tasks back in worker memory.
            app.conf["worker_disable_rate_limits"] = True
    except Exception:  # never break an app's finalization over a default
        logger.debug("sqlease could not apply durable defaults", exc_info=True)


# The defaults must be in place before any task class is bound. Celery runs its finalize
# callbacks in no fixed order (shared tasks bind inside them), so ours goes first by wrapping
# the announcement; the plain registration stays as a fallback for other Celery versions.
connect_on_app_finalize(_durable_defaults)


def _run_first() -> None:
    import celery.app.base as app_base

    announce = getattr(app_base, "_announce_app_finalized", None)
    if announce is None or getattr(announce, "_sqlease_first", False):
        return

    def announce_with_durable_defaults(app: Any) -> None:
        _durable_defaults(app)
        announce(app)

    announce_with_durable_defaults._sqlease_first = True  # type: ignore[attr-defined]
    app_base._announce_app_finalized = announce_with_durable_defaults


_run_first()


@signals.worker_shutdown.connect
def _forget_the_pool(sender: Any = None, **kwargs: Any) -> None:
    from sqlease._celery import pool_room

    pool_room.forget(sender)


@signals.worker_init.connect
def _warn_if_early_ack(sender: Any = None, **kwargs: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not uses_sqlease(app):
        return
    from sqlease._celery import no_prefetch, pool_room, scheduled

    pool_room.remember(sender)  # its free pool processes: handoff offers while busy
    scheduled.install()  # inspect scheduled: the ETA tasks waiting in the database
    no_prefetch.install(app)  # worker_disable_prefetch, which Celery applies to Redis alone
    if not app.conf.task_acks_late:
        logger.warning(
            "sqlease: task_acks_late is False, so tasks are acknowledged before they run and a "
            "worker killed mid-task loses its task. Remove that setting to make tasks durable "
            "(opt out per task with @app.task(acks_late=False))."
        )


@signals.worker_ready.connect
def _shutdown_signals_outside_sqlite(sender: Any = None, **kwargs: Any) -> None:
    """Celery's shutdown handlers, installed by now, wait for the main thread to leave SQLite
    (sqlease._db.signal_defer): the soft shutdown sleeps in its handler, which must not
    hold a transaction's write lock meanwhile."""
    app = getattr(sender, "app", None)
    if app is None or not uses_sqlease(app):
        return
    import signal

    from sqlease._db.signal_defer import defer_handlers

    names = ("SIGTERM", "SIGINT", "SIGQUIT")  # SIGQUIT is not on Windows
    defer_handlers([getattr(signal, name) for name in names if hasattr(signal, name)])
