"""The shop's tasks: a Celery task and a Django task, both run by ``celery -A shop worker``."""

import time

from celery import shared_task

try:
    from django.tasks import task  # Django 6
except ImportError:
    from django_tasks import task  # Django 5.2 with django-tasks

from shop.models import Order, Receipt, Shipment


@shared_task
def ship(order_id: int) -> dict[str, object]:
    started = time.time()
    order = Order.objects.get(id=order_id)  # committed before this task could exist
    Shipment.objects.create(order=order, started_at=started)
    return {"order_id": order_id, "item": order.item, "shipped": True}


@task()
def send_receipt(order_id: int) -> str:
    Receipt.objects.create(order_id=order_id)
    return f"receipt for order {order_id}"
