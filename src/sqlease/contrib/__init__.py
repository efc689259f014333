"""Integrations with frameworks other than Celery and Kombu (``sqlease.contrib.django``)."""
