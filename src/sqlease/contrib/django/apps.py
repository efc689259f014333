"""The Django app: publishes join ``atomic()`` blocks once the app registry is ready."""

from __future__ import annotations

from django.apps import AppConfig


class SqleaseConfig(AppConfig):
    name = "sqlease.contrib.django"
    label = "sqlease"
    verbose_name = "sqlease"

    def ready(self) -> None:
        from sqlease.contrib.django.joining import open_atomic_blocks
        from sqlease.transactions import register_joiner

        register_joiner(open_atomic_blocks)
