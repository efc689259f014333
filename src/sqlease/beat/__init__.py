"""Periodic tasks on leases: ``beat_scheduler = "sqlease.beat:Scheduler"``.

Any number of ``celery beat -S sqlease.beat:Scheduler`` (or ``celery worker -B``) processes may
run; one leads on a fenced lease in the database and fires each (entry, slot) exactly once.
See docs/howto/periodic-tasks.md.
"""

from sqlease.beat._calls import slot_task_id
from sqlease.beat._scheduler import Scheduler

__all__ = ["Scheduler", "slot_task_id"]
