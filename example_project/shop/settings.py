"""A small shop that sends its slow work to django-leases.

SQLite (the embedded default) unless DATABASE_URL names a PostgreSQL database:
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/shop python manage.py run_lease_worker
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("SECRET_KEY", "example-only-not-secret")
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"


def _database(url: str | None) -> dict:
    if not url:
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("SHOP_SQLITE", str(BASE_DIR / "shop.sqlite3")),
            # Several worker processes share the file: wait for the write lock instead of
            # failing, and take it at the start of each transaction.
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    parsed = urlparse(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parsed.path.lstrip("/")),
        "USER": unquote(parsed.username or ""),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": parsed.hostname or "",
        "PORT": str(parsed.port or ""),
    }


DATABASES = {"default": _database(os.environ.get("DATABASE_URL"))}
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_leases",
    "shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
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
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
TASKS = {
    "default": {
        "BACKEND": "django_leases.backends.LeaseBackend",
        "QUEUES": ["default", "emails", "images", "partners", "reports", "periodic"],
        "OPTIONS": {
            "LEASE_SECONDS": 30,
            # Renew every 2 s, so the admin calls a claim stalled after 4 s without a
            # heartbeat (two periods): the claim the tour's killed worker leaves behind
            # shows as stalled by the time the tour ends.
            "HEARTBEAT_SECONDS": 2,
            "MAX_ATTEMPTS": 4,
            "QUEUE_OPTIONS": {
                # The flaky partner API: three tries, 0.5 s then 1 s apart, then dead.
                "partners": {"MAX_ATTEMPTS": 3, "RETRY": [0.5, 1.0]},
            },
            # A periodic job (docs/periodic.md): every 2 s, whichever worker looks first
            # enqueues the tick, once. The settings form works on Django 6.0 and 6.1; on
            # 6.1 @task(schedule=Periodic(every=2, overlap="skip")) says the same.
            "SCHEDULES": {
                "shop.tally": {"task": "shop.tasks.tally_orders", "every": 2, "overlap": "skip"},
            },
        },
    },
}
