"""The dashboard's task list served by a Django project (``sqlease.contrib.django.urls``) at
1,000,000 task records: ``GET /sqlease/tasks`` through Django's test client (sign-in, staff
check, CSRF, the forwarding to the dashboard's ASGI app, the page read and rendered), first
page and one in the middle, median of 20.

    .venv/bin/python benchmarks/django_dashboard.py --url postgresql://postgres@127.0.0.1:5432/test
    .venv/bin/python benchmarks/django_dashboard.py --url sqlite:////tmp/task_list.db

Uses the records ``benchmarks/task_list.py`` fills (table prefix ``bench_list_``; run it first
with the same ``--url``); Django's own tables go to a SQLite file of their own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url
from task_list import BASE_MS, RESULTS, median_ms


def configure(url: str, folder: Path) -> None:
    import django
    from django.conf import settings

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        bench: dict[str, Any] = {"ENGINE": "django.db.backends.sqlite3", "NAME": parsed.database}
    else:
        bench = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": parsed.database,
            "USER": parsed.username or "",
            "PASSWORD": parsed.password or "",
            "HOST": parsed.host or "",
            "PORT": str(parsed.port or ""),
        }
    settings.configure(
        INSTALLED_APPS=[
            "django.contrib.contenttypes",
            "django.contrib.auth",
            "sqlease.contrib.django",
        ],
        DATABASES={
            "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(folder / "dj.db")},
            "bench": bench,
        },
        SQLEASE_DATABASE="bench",
        SQLEASE_TABLE_PREFIX="bench_list_",
        SECRET_KEY="benchmark-only",
        SESSION_ENGINE="django.contrib.sessions.backends.signed_cookies",
        MIDDLEWARE=[
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.middleware.csrf.CsrfViewMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
        ],
        ROOT_URLCONF=__name__,
        ALLOWED_HOSTS=["testserver"],
        USE_TZ=True,
    )
    django.setup()


def urlconf() -> list[Any]:
    from django.urls import include, path

    return [path("sqlease/", include("sqlease.contrib.django.urls"))]


def __getattr__(name: str) -> Any:  # ROOT_URLCONF: urlpatterns, made once Django is set up
    if name == "urlpatterns":
        return urlconf()
    raise AttributeError(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--count", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        configure(args.url, Path(folder))
        from django.contrib.auth.models import User
        from django.core.management import call_command
        from django.test import Client

        call_command("migrate", "auth", database="default", verbosity=0)
        client = Client()
        client.force_login(User.objects.create_user("boss", is_staff=True))
        middle = f"{BASE_MS + args.count // 2}:task-{args.count // 2}"

        def page(query: dict[str, str]) -> None:
            response = client.get("/sqlease/tasks", query)
            assert response.status_code == 200, response.status_code
            assert response.content.count(b'data-task="') == 50

        figures = {
            "Django GET /sqlease/tasks, first": median_ms(lambda: page({})),
            "Django GET /sqlease/tasks, middle": median_ms(lambda: page({"before": middle})),
        }
    dialect = make_url(args.url).get_backend_name()
    for label, took in figures.items():
        print(f"{args.count:,} tasks, page of 50, {label}: {took:.2f} ms")
    out = RESULTS / f"django_dashboard-{datetime.date.today()}-{dialect}.json"
    out.write_text(json.dumps({"tasks": args.count, "median_ms": figures}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
