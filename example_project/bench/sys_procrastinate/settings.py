"""Procrastinate under the benchmark: its Django contrib, worker defaults."""

from __future__ import annotations

import os

from common import django_settings

globals().update(
    django_settings(
        os.environ.get("BENCH_DB", "bench_procrastinate"),
        ["procrastinate.contrib.django", "sys_procrastinate"],
        None,
    )
)
