"""What the app's management commands share."""

from __future__ import annotations

import django
from django.core.management.base import BaseCommand

from .. import __version__


class LeasesCommand(BaseCommand):
    """A command of this app: ``--version`` names django-leases' version (BaseCommand's
    names Django's alone)."""

    def get_version(self) -> str:
        return f"django-leases {__version__} (Django {django.get_version()})"
