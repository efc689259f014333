"""``sqlease.contrib.django``: sqlease in a Django project.

Add ``"sqlease.contrib.django"`` to ``INSTALLED_APPS``. Then:

- ``CELERY_BROKER_URL = "sqlease+django://default"`` (and the result backend likewise) names a
  Django database alias instead of repeating its credentials (``sqlease.contrib.django.conf``);
- ``manage.py migrate`` creates and upgrades sqlease's tables on ``SQLEASE_DATABASE``;
- a publish inside ``transaction.atomic()`` on the broker's database joins that transaction on
  Django's own connection, in a savepoint (``sqlease.contrib.django.joining``);
- ``manage.py sqlease …`` runs the ``sqlease`` command line on that database;
- ``TASKS = {"default": {"BACKEND": "sqlease.contrib.django.tasks.SqleaseBackend"}}`` runs
  Django tasks on sqlease's leases (``sqlease.contrib.django.tasks``).

Importing this package registers the ``django://`` URL scheme; it imports Django only when a
URL is resolved (``import sqlease`` never imports it).
"""

from __future__ import annotations

from sqlease.contrib.django.conf import resolve_url
from sqlease.urls import register_scheme

register_scheme("django", resolve_url)
