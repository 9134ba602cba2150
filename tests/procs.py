"""Start real Python processes against the database the current test is using."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote, urlencode

from django.db import connection

ROOT = Path(__file__).resolve().parent.parent


def current_database_url() -> str:
    """DATABASE_URL of the test database this process is connected to."""
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    scheme = {"postgresql": "postgres", "mysql": "mysql"}[connection.vendor]
    auth = quote(s["USER"] or "")
    if s["PASSWORD"]:
        auth += ":" + quote(s["PASSWORD"])
    host = s["HOST"] or "127.0.0.1"
    port = f":{s['PORT']}" if s["PORT"] else ""
    # PostgreSQL's OPTIONS (tests/settings.py reads them back from the query), so that a
    # child runs as the test does: with prepared statements in the prepared pass.
    options = s.get("OPTIONS", {}) if connection.vendor == "postgresql" else {}
    query = "?" + urlencode(
        {k: str(v).lower() if isinstance(v, bool) else v for k, v in options.items()}
    )
    return f"{scheme}://{auth}@{host}{port}/{s['NAME']}{query if options else ''}"


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DATABASE_URL": current_database_url(),
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra)
    return env


def python(*args: str, prefix: tuple[str, ...] = (), **popen) -> subprocess.Popen:
    """Popen ``[*prefix, python, *args]`` with the test database in its environment."""
    popen.setdefault("env", child_env())
    popen.setdefault("cwd", ROOT)
    return subprocess.Popen([*prefix, sys.executable, *args], **popen)
