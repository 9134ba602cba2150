"""django-ox under the benchmark: its defaults."""

from __future__ import annotations

import os

from common import django_settings

# The recovery workload gives django-ox the same lease as django-leases (LOCK_TIMEOUT is
# "seconds a worker may stop renewing its lease"); every other workload runs its defaults.
_options = {}
if os.environ.get("BENCH_LEASE_SECONDS"):
    _options["LOCK_TIMEOUT"] = float(os.environ["BENCH_LEASE_SECONDS"])

globals().update(
    django_settings(
        os.environ.get("BENCH_DB", "bench_ox"),
        ["django_ox", "sys_ox"],
        {"default": {"BACKEND": "django_ox.backend.OxBackend", "OPTIONS": _options}},
    )
)
