"""Periodic task entries, shared by ``sqlease.beat`` and ``sqlease.Admin``: ``_specs``
(Celery's schedules as stored JSON, entries checked field by field, the next slot) and
``_admin`` (``Admin``'s periodic task verbs). Internal: use ``sqlease.beat`` and
``sqlease.Admin``; the rows and their SQL are in ``sqlease._core.schedules``."""
