"""A project that configures the lease backend but forgot 'django_leases' in INSTALLED_APPS
(issue 15.2), for tests that run manage.py commands in it."""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

# With it go the models that point at its jobs.
INSTALLED_APPS = [a for a in INSTALLED_APPS if a not in ("django_leases", "tests.reportapp")]
