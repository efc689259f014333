"""The Celery app, the usual Django way: settings from ``CELERY_*``, tasks autodiscovered (the
shop's, and ``sqlease.contrib.django.tasks``, which runs Django tasks)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
