"""Placing an order: the order, its shipping task and its receipt in one transaction."""

from typing import Any

from django.db import transaction

from shop.models import Order
from shop.tasks import send_receipt, ship


class PaymentDeclined(Exception):
    pass


def place_order(item: str, *, declined: bool = False) -> tuple[Order, Any, Any]:
    """Save the order and enqueue its tasks; they exist iff the order was committed."""
    with transaction.atomic():
        order = Order.objects.create(item=item)
        shipping = ship.delay(order.id)  # a Celery task: the real id, now
        receipt = send_receipt.enqueue(order.id)  # a Django task, on the same transaction
        if declined:
            raise PaymentDeclined(f"card declined for order {order.id}")
    return order, shipping, receipt
