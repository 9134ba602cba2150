"""Settings of the chaos harness and of the workers it starts: the throwaway cluster.

The port comes from LEASES_CHAOS_PORT (the worker's own proxy, or the cluster itself for
the harness); LEASES_CHAOS_APP names the connection in pg_stat_activity so the harness can
find one worker's backends. Log lines start with time.time() (the process's own clock,
skewed under faketime) so that the checker can line them up with the database clock.
"""

from __future__ import annotations

import copy
import os

from tests.settings import *  # noqa: F403
from tests.settings import LOGGING, TASKS

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("LEASES_CHAOS_DB", "chaos"),
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": os.environ.get("LEASES_CHAOS_PORT", "5499"),
        "CONN_MAX_AGE": None,
        "CONN_HEALTH_CHECKS": True,
        "OPTIONS": {
            "connect_timeout": 3,
            "application_name": os.environ.get("LEASES_CHAOS_APP", "chaos-harness"),
        },
    },
}
# The test suite's other aliases point at the same throwaway database (never used here).
DATABASES["queue"] = copy.deepcopy(DATABASES["default"])
TASKS = copy.deepcopy(TASKS)
# Through PgBouncer (--pooler): LISTEN on a direct connection to the cluster.
if os.environ.get("LEASES_CHAOS_DIRECT_PORT"):
    DATABASES["direct"] = copy.deepcopy(DATABASES["default"])
    DATABASES["direct"]["PORT"] = os.environ["LEASES_CHAOS_DIRECT_PORT"]
    TASKS["default"]["OPTIONS"] = {**TASKS["default"]["OPTIONS"], "LISTEN_DATABASE": "direct"}
TASKS["default"]["QUEUES"] = [*TASKS["default"].get("QUEUES", ["default"]), "isolated"]
TASKS["default"]["OPTIONS"] = {**TASKS["default"].get("OPTIONS", {}), "LEASE_SECONDS": 4}
LOGGING = {
    **LOGGING,
    # JSON lines: the checker reads events and fields (tests/worker_helpers.read_records).
    "formatters": {"json": {"()": "django_leases.worker.logs.JsonFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},
    "loggers": {
        "django_leases": {"handlers": ["console"], "level": "INFO"},
        "tests.chaos": {"handlers": ["console"], "level": "INFO"},
    },
}
