"""django-leases under the benchmark: default OPTIONS (heartbeats on, NOTIFY on).

BENCH_LEASE_SECONDS overrides LEASE_SECONDS for the recovery workload only, and
BENCH_CONCURRENCY sets CONCURRENCY for the one variant that is not default settings.
"""

from __future__ import annotations

import os

from common import django_settings

_options = {}
if os.environ.get("BENCH_CONCURRENCY"):
    _options["CONCURRENCY"] = int(os.environ["BENCH_CONCURRENCY"])
if os.environ.get("BENCH_LEASE_SECONDS"):
    _options["LEASE_SECONDS"] = float(os.environ["BENCH_LEASE_SECONDS"])

globals().update(
    django_settings(
        os.environ.get("BENCH_DB", "bench_leases"),
        ["django_leases", "sys_leases"],
        {
            "default": {
                "BACKEND": "django_leases.backends.LeaseBackend",
                "QUEUES": ["default", "held"],
                "OPTIONS": _options,
            }
        },
    )
)
