import time

from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=100)


class Shipment(models.Model):
    order = models.OneToOneField(Order, on_delete=models.CASCADE)
    #: when the worker started the task (time.time()): the wait after the commit
    started_at = models.FloatField(default=time.time)


class Receipt(models.Model):
    order = models.OneToOneField(Order, on_delete=models.CASCADE)
