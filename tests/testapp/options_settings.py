"""Worker and reader settings for tests that change the default backend's OPTIONS in the
processes they start: tests.worker_settings plus the JSON object in LEASES_TEST_OPTIONS
(e.g. {"MAX_ATTEMPTS": 1} or {"TASK_MODULES": ["tests.testapp.jobs"]})."""

from __future__ import annotations

import json
import os

from tests.worker_settings import *  # noqa: F403
from tests.worker_settings import TASKS

TASKS["default"]["OPTIONS"].update(json.loads(os.environ.get("LEASES_TEST_OPTIONS", "{}")))
