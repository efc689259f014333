"""The test project's URLconf: the dashboard mounted as a project mounts it."""

from django.urls import include, path

urlpatterns = [path("ops/sqlease/", include("sqlease.contrib.django.urls"))]
