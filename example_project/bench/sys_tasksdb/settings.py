"""django-tasks-db under the benchmark: its defaults."""

from __future__ import annotations

import os

from common import django_settings

globals().update(
    django_settings(
        os.environ.get("BENCH_DB", "bench_tasksdb"),
        ["django_tasks_db", "sys_tasksdb"],
        {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}},
    )
)
