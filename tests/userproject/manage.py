#!/usr/bin/env python
"""A user's project on the installed wheel of django-leases (tests/test_package.py)."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "userproject.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
