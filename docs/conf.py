"""Sphinx configuration: MyST Markdown pages, API reference from the docstrings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import django  # noqa: E402
from django.conf import settings  # noqa: E402

settings.configure(
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django.contrib.admin",
                    "django.contrib.sessions", "django.contrib.messages", "django_leases"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    TASKS={"default": {"BACKEND": "django_leases.backends.LeaseBackend"}},
    USE_TZ=True,
)
django.setup()

project = "django-leases"
author = "django-leases developers"
release = __import__("django_leases").__version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
# bench_results.md is the harness's raw output; benchmarks.md presents it.
exclude_patterns = ["_build", "images/README.md", "bench_results.md"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
html_theme = os.environ.get("SPHINX_THEME", "furo")
nitpicky = False
suppress_warnings = ["myst.xref_missing"]
