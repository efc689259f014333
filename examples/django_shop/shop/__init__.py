"""A small Django shop on sqlease: orders, a Celery task and a Django task."""

from shop.celery import app as celery_app

__all__ = ["celery_app"]
