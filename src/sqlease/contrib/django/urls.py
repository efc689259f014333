"""The dashboard's URLs, for a project's URLconf (staff only; see
``sqlease.contrib.django.dashboard``)::

    urlpatterns = [
        path("admin/", admin.site.urls),
        path("sqlease/", include("sqlease.contrib.django.urls")),
    ]

``reverse("sqlease:dashboard")`` is the overview; every other page is below it.
"""

from __future__ import annotations

from django.urls import path

from sqlease.contrib.django.dashboard import dashboard

app_name = "sqlease"
urlpatterns = [
    path("", dashboard, name="dashboard"),
    path("<path:path>", dashboard, name="page"),
]
