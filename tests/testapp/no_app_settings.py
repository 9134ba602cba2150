"""A project that configures the lease backend but forgot 'django_leases' in INSTALLED_APPS
(issue 15.2), for tests that run manage.py commands in it."""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "django_leases"]
