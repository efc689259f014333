"""The Celery app real ``celery beat -S sqlease.beat:Scheduler`` processes run in the beat
tests (this folder on ``PYTHONPATH``): one entry every second, a short leader lease. Its
configuration comes from the environment: ``BEAT_BROKER``, ``BEAT_PREFIX``, ``BEAT_LEASE``,
``BEAT_CATCH_UP`` (``sqlease_beat_catch_up``), and ``BEAT_MANY`` entries ``many-00000``… every
``BEAT_MANY_EVERY`` seconds instead of the one (when given)."""

from __future__ import annotations

import os

from celery import Celery

import sqlease  # noqa: F401  (registers the transport)

app = Celery("beat_app")
app.conf.broker_url = os.environ["BEAT_BROKER"]
app.conf.broker_transport_options = {"table_prefix": os.environ["BEAT_PREFIX"]}
app.conf.result_backend = None
app.conf.result_expires = None  # no celery.backend_cleanup entry
app.conf.beat_scheduler = "sqlease.beat:Scheduler"
app.conf.sqlease_beat_lease_seconds = float(os.environ.get("BEAT_LEASE", "2"))
app.conf.beat_max_loop_interval = 1.0
if os.environ.get("BEAT_CATCH_UP"):
    app.conf.sqlease_beat_catch_up = os.environ["BEAT_CATCH_UP"]
app.conf.beat_schedule = {"every-second": {"task": "beat_app.tick", "schedule": 1.0}}
if os.environ.get("BEAT_MANY"):
    every = float(os.environ.get("BEAT_MANY_EVERY", "5"))
    app.conf.beat_schedule = {
        f"many-{i:05d}": {"task": "beat_app.tick", "schedule": every}
        for i in range(int(os.environ["BEAT_MANY"]))
    }


@app.task(name="beat_app.tick")
def tick() -> None:
    return None
