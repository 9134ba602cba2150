"""Test settings: SQLite by default, PostgreSQL or MySQL when DATABASE_URL names one.

DATABASE_URL=postgres://postgres@127.0.0.1:5432/test
DATABASE_URL=sqlite:///path/to/file.sqlite3   (a file: worker processes share it)
DATABASE_URL=postgres://...?server_side_binding=true&prepare_threshold=0   (prepared statements)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

BASE_DIR = Path(__file__).resolve().parent


def database_from_url(url: str) -> dict:
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        name = unquote(parsed.path) or str(Path(tempfile.gettempdir()) / "django_leases.sqlite3")
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": name,
            # A file, not memory, so real worker processes see the test database.
            "TEST": {"NAME": name.replace(".sqlite3", "") + "-test.sqlite3"},
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    engine = {
        "postgres": "django.db.backends.postgresql",
        "postgresql": "django.db.backends.postgresql",
        "mysql": "django.db.backends.mysql",
    }[parsed.scheme]
    database = {
        "ENGINE": engine,
        "NAME": unquote(parsed.path.lstrip("/")),
        "USER": unquote(parsed.username or ""),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": parsed.hostname or "",
        "PORT": str(parsed.port or ""),
        "CONN_MAX_AGE": 0,
        "TEST": {"NAME": os.environ.get("LEASES_TEST_DB_NAME") or None},
    }
    # PostgreSQL: the query's parameters go to the driver as OPTIONS (sslmode=...), and
    # ?server_side_binding=true&prepare_threshold=0 turns on psycopg's prepared statements,
    # as a project may (tests/run.sh's prepared pass).
    query = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
    if query and not engine.endswith("postgresql"):
        raise ValueError(f"DATABASE_URL: a query is read for PostgreSQL only: {parsed.query!r}")
    if query:
        options: dict[str, Any] = dict(query)
        if "server_side_binding" in options:
            options["server_side_binding"] = options["server_side_binding"] == "true"
        if "prepare_threshold" in options:
            options["prepare_threshold"] = int(options["prepare_threshold"])
        database["OPTIONS"] = options
    return database


def queue_database(default: dict) -> dict:
    """A second database on the same server (or a second SQLite file) for the "queue"
    backend: jobs on their own database, as OPTIONS["DATABASE"] allows. pytest-django
    creates its test database only for tests that declare databases=[..., "queue"]."""
    queue = {**default, "OPTIONS": dict(default.get("OPTIONS", {})), "TEST": dict(default["TEST"])}
    if default["ENGINE"].endswith("sqlite3"):
        queue["NAME"] = default["NAME"].replace(".sqlite3", "") + "-queue.sqlite3"
        queue["TEST"]["NAME"] = (
            default["TEST"]["NAME"].replace("-test.sqlite3", "") + "-queue-test.sqlite3"
        )
    else:
        # A TEST NAME of its own, or Django takes both aliases for one database.
        queue["TEST"]["NAME"] = (default["TEST"]["NAME"] or f"test_{default['NAME']}") + "_queue"
    return queue


DATABASES = {"default": database_from_url(os.environ.get("DATABASE_URL", "sqlite://"))}
DATABASES["queue"] = queue_database(DATABASES["default"])

# MySQL/MariaDB: partial indexes and a unique generated column draw warnings there
# (docs/databases.md); migration 0002 provides the plain claim indexes instead. The
# "any_queue" backend below shares "default"'s database and queues on purpose (W005).
SILENCED_SYSTEM_CHECKS = ["models.W037", "mysql.W003", "django_leases.W005"]
SECRET_KEY = "tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.admin",
    "django.contrib.staticfiles",
    "django_leases",
    "tests.testapp",
    "tests.shopapp",
    "tests.reportapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
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
ROOT_URLCONF = "tests.urls"
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Annotated as Django's own setting is: mypy reads these settings through django-stubs.
TASKS: dict[str, dict[str, Any]] = {
    "default": {
        "BACKEND": "django_leases.backends.LeaseBackend",
        "QUEUES": ["default", "emails", "reports"],
        "OPTIONS": {"LEASE_SECONDS": 30},
    },
    # Jobs on a database of their own: enqueue is not part of the caller's transaction on
    # "default" (tests/test_tasks_api.py); workers serve it with --backend queue.
    "queue": {
        "BACKEND": "django_leases.backends.LeaseBackend",
        "QUEUES": ["bulk"],
        "OPTIONS": {"DATABASE": "queue", "LEASE_SECONDS": 30},
    },
    # Any queue name on "default" (QUEUES: [] in Django's terms). Job.objects.enqueue()
    # refuses a queue no backend on its database accepts; the manager's own tests claim
    # jobs in queues of their own (tests/test_enqueue_hostile.py tests the refusal).
    "any_queue": {
        "BACKEND": "django_leases.backends.LeaseBackend",
        "QUEUES": [],
        "OPTIONS": {"LEASE_SECONDS": 30},
    },
    # Not a lease backend: a task declared for it and sent to a lease backend with
    # using(backend=...) is run by that backend's workers (tests/test_tasks_api.py).
    "immediate": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"},
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_leases": {"handlers": ["console"], "level": "INFO"}},
}
