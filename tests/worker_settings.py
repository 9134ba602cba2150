"""Settings for run_lease_worker processes started by the worker tests.

The same as tests.settings, pointed at the test database the pytest process created
(LEASES_WORKER_DB_NAME), with timestamps in the log lines. LEASES_WORKER_NOTIFY=0 turns
NOTIFY off, as a deployment behind PgBouncer transaction pooling without a direct connection
would; LEASES_POOLER_DIRECT_URL adds that direct connection for LISTEN_DATABASE. LEASES_WORKER_FAULT
injects a driver fault into one thread's statements (tests/worker_faults.py);
LEASES_WORKER_CHILD_SETUP_SECONDS slows each handler process's start; LEASES_WORKER_OPTIONS
(JSON) adds to the default backend's OPTIONS.
"""

from __future__ import annotations

import json
import os

import tests.tick_faults  # noqa: F401 -- LEASES_TICK_FAULT, for the schedule tests
import tests.worker_faults  # noqa: F401 -- LEASES_WORKER_FAULT, for the tests that set it
from tests.settings import *  # noqa: F403
from tests.settings import DATABASES, LOGGING, TASKS, database_from_url

DATABASES["default"]["NAME"] = os.environ["LEASES_WORKER_DB_NAME"]
if os.environ.get("LEASES_WORKER_QUEUE_DB_NAME"):
    DATABASES["queue"]["NAME"] = os.environ["LEASES_WORKER_QUEUE_DB_NAME"]
# A handler's connection cut while idle is checked and reopened before its next job;
# LEASES_WORKER_HEALTH_CHECKS=0 leaves Django's default (off), as a user's project has it.
DATABASES["default"]["CONN_HEALTH_CHECKS"] = os.environ.get("LEASES_WORKER_HEALTH_CHECKS") != "0"
TASKS["default"]["OPTIONS"]["NOTIFY"] = os.environ.get("LEASES_WORKER_NOTIFY", "1") == "1"
# The pass through PgBouncer (tests/run.sh): "default" is the pooler, and the worker LISTENs
# on a direct connection to the same database ("direct"), as docs/databases.md advises.
# LEASES_WORKER_LISTEN_DIRECT=0 leaves LISTEN_DATABASE unset.
if os.environ.get("LEASES_POOLER_DIRECT_URL"):
    DATABASES["direct"] = database_from_url(os.environ["LEASES_POOLER_DIRECT_URL"])
    DATABASES["direct"]["NAME"] = os.environ["LEASES_WORKER_DB_NAME"]
    if os.environ.get("LEASES_WORKER_LISTEN_DIRECT", "1") == "1":
        TASKS["default"]["OPTIONS"]["LISTEN_DATABASE"] = "direct"
# Periodic schedules in the settings form, as JSON (tests/test_schedule_workers.py).
if os.environ.get("LEASES_WORKER_SCHEDULES"):
    TASKS["default"]["OPTIONS"]["SCHEDULES"] = json.loads(os.environ["LEASES_WORKER_SCHEDULES"])
# More of the default backend's OPTIONS, as JSON (TIMEOUT_SECONDS, QUEUE_OPTIONS, ...).
if os.environ.get("LEASES_WORKER_OPTIONS"):
    TASKS["default"]["OPTIONS"].update(json.loads(os.environ["LEASES_WORKER_OPTIONS"]))
# JSON lines: the tests wait on the worker's events and fields (tests/worker_helpers.py).
LOGGING["formatters"] = {"json": {"()": "django_leases.worker.logs.JsonFormatter"}}
LOGGING["handlers"]["console"]["formatter"] = "json"
# The worker tests of start-up and connection limits: another port (a proxy), another role.
if os.environ.get("LEASES_WORKER_DB_PORT"):
    DATABASES["default"]["PORT"] = os.environ["LEASES_WORKER_DB_PORT"]
if os.environ.get("LEASES_WORKER_DB_USER"):
    DATABASES["default"]["USER"] = os.environ["LEASES_WORKER_DB_USER"]
# QUEUES as a comma-separated list ("" for QUEUES: [], any queue name allowed); "-" adds a
# backend "noqueues" with no QUEUES at all, which Django reads as ["default"] (the test
# tasks' own backend keeps its queues, or declaring them would fail).
if os.environ.get("LEASES_WORKER_QUEUES") == "-":
    TASKS["noqueues"] = {
        "BACKEND": "django_leases.backends.LeaseBackend",
        "OPTIONS": {"LEASE_SECONDS": 30},
    }
elif "LEASES_WORKER_QUEUES" in os.environ:
    TASKS["default"]["QUEUES"] = [q for q in os.environ["LEASES_WORKER_QUEUES"].split(",") if q]
# No LOGGING of the project's own: run_lease_worker then installs its handler and format.
if os.environ.get("LEASES_WORKER_OWN_LOGGING") == "1":
    LOGGING = {"version": 1, "disable_existing_loggers": False}  # noqa: F811
# The worker's lines and Django's task lines to a file (a FileHandler, as a project's LOGGING
# may route them), in the worker's "json" or "text" formatter: LEASES_WORKER_LOG_FILE(_FORMAT).
if os.environ.get("LEASES_WORKER_LOG_FILE"):
    _formatter = {"json": "JsonFormatter", "text": "TextFormatter"}[
        os.environ.get("LEASES_WORKER_LOG_FILE_FORMAT", "text")
    ]
    LOGGING = {  # noqa: F811
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"file": {"()": f"django_leases.worker.logs.{_formatter}"}},
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "encoding": "utf-8",
                "filename": os.environ["LEASES_WORKER_LOG_FILE"],
                "formatter": "file",
            }
        },
        "loggers": {
            name: {"handlers": ["file"], "level": "INFO", "propagate": False}
            for name in ("django_leases", "django.tasks")
        },
    }
# A handler process slow to start, so that a test can kill its worker before the handler
# runs (tests/test_worker_process.py): seconds to sleep in each handler child's setup.
if os.environ.get("LEASES_WORKER_CHILD_SETUP_SECONDS"):
    import multiprocessing
    import time

    if multiprocessing.parent_process() is not None:
        time.sleep(float(os.environ["LEASES_WORKER_CHILD_SETUP_SECONDS"]))
