"""The shop's settings. The database is a SQLite file in ``$SHOP_DIR`` (default: this folder),
or PostgreSQL when ``$SHOP_DATABASE_URL`` is ``postgresql://user@host:port/name``."""

import os
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent.parent
SECRET_KEY = "example-only"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    # Django's admin and sign-in: the sqlease dashboard (shop/urls.py) is for signed-in staff
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "sqlease.contrib.django",
    "shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "shop.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
# The dashboard sends visitors who are not signed in here (the admin's sign-in page).
LOGIN_URL = "/admin/login/"
try:
    import django.tasks  # noqa: F401  (Django 6: built in)
except ImportError:
    INSTALLED_APPS.insert(0, "django_tasks")  # Django 5.2: the django-tasks package
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_pg = os.environ.get("SHOP_DATABASE_URL")
if _pg:
    _url = urlsplit(_pg)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _url.path.lstrip("/"),
            "USER": _url.username or "",
            "PASSWORD": _url.password or "",
            "HOST": _url.hostname or "",
            "PORT": str(_url.port or ""),
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(Path(os.environ.get("SHOP_DIR") or HERE) / "django_shop.db"),
            # BEGIN IMMEDIATE: a transaction takes SQLite's write lock up front, so it never
            # fails to upgrade a read lock while a worker writes (Django 5.1+).
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30},
        }
    }

# The broker and the results on Django's own database: the alias, not its credentials.
CELERY_BROKER_URL = "sqlease+django://default"
CELERY_RESULT_BACKEND = "sqlease+django://default"
CELERY_BROKER_TRANSPORT_OPTIONS = {"lease_seconds": 5.0, "polling_interval": 0.5}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1

# Django tasks (django.tasks on Django 6, the django-tasks package on 5.2) on the same broker.
TASKS = {
    "default": {
        "BACKEND": "sqlease.contrib.django.tasks.SqleaseBackend",
        "QUEUES": ["default"],
        "OPTIONS": {"CELERY_APP": "shop.celery.app"},
    }
}
