"""The shop's URLs: Django's admin, and sqlease's dashboard at /sqlease/ for signed-in staff
(``python manage.py createsuperuser``, then open http://127.0.0.1:8000/sqlease/)."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("sqlease/", include("sqlease.contrib.django.urls")),
]
