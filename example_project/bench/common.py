"""Helpers shared by every process of the benchmark, in every virtualenv (stdlib only).

The harness runs each queue in its own virtualenv, so nothing here may import Django,
django_leases or a peer at module level.
"""

from __future__ import annotations

import os
import time

PG = {
    "host": os.environ.get("BENCH_PGHOST", "127.0.0.1"),
    "port": os.environ.get("BENCH_PGPORT", "5432"),
    "user": os.environ.get("BENCH_PGUSER", "postgres"),
    "password": os.environ.get("BENCH_PGPASSWORD", ""),
}


def dsn(dbname: str) -> str:
    parts = [f"dbname={dbname}", f"host={PG['host']}", f"port={PG['port']}", f"user={PG['user']}"]
    if PG["password"]:
        parts.append(f"password={PG['password']}")
    return " ".join(parts)


def url(dbname: str) -> str:
    """The same as dsn(), as the postgresql:// URL that asyncpg and PgQueuer's CLI take."""
    from urllib.parse import quote

    auth = quote(PG["user"]) + (f":{quote(PG['password'])}" if PG["password"] else "")
    return f"postgresql://{auth}@{PG['host']}:{PG['port']}/{quote(dbname)}"


def django_settings(dbname: str, apps: list[str], tasks: dict | None) -> dict:
    """Settings for one system's Django side: only what it needs, on its own database.

    CONN_MAX_AGE comes from BENCH_CONN_MAX_AGE (Django's default 0 unless set; "none"
    keeps connections open for the life of the process).
    """
    cma_raw = os.environ.get("BENCH_CONN_MAX_AGE", "0").lower()
    conn_max_age = None if cma_raw in ("none", "persistent") else int(cma_raw)
    settings = {
        "SECRET_KEY": "bench-only",
        "DEBUG": False,
        "USE_TZ": True,
        "TIME_ZONE": "UTC",
        "DEFAULT_AUTO_FIELD": "django.db.models.BigAutoField",
        "INSTALLED_APPS": ["django.contrib.contenttypes", "django.contrib.auth", *apps],
        "DATABASES": {
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": dbname,
                "USER": PG["user"],
                "PASSWORD": PG["password"],
                "HOST": PG["host"],
                "PORT": PG["port"],
                "CONN_MAX_AGE": conn_max_age,
            }
        },
    }
    if os.environ.get("BENCH_PREPARED"):
        # A tuned variant: psycopg's server-side binding, each statement prepared from its
        # 5th run on a connection (Django binds client-side and prepares nothing by default).
        settings["DATABASES"]["default"]["OPTIONS"] = {
            "server_side_binding": True,
            "prepare_threshold": 5,
        }
    if tasks is not None:
        settings["TASKS"] = tasks
    return settings


def record(*fields: object) -> None:
    """Append one line to $BENCH_RECORD: what the latency and recovery tasks report.

    One write() of a short line on an O_APPEND descriptor, so lines from several
    processes never interleave.
    """
    path = os.environ.get("BENCH_RECORD")
    if not path:
        return
    line = " ".join(str(f) for f in fields) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def stamp_body(sent: float) -> None:
    """Body of the latency task: write when it was enqueued and when it started."""
    record("start", repr(sent), repr(time.time()), os.getpid())


def sleep_body(seconds: float, tag: str) -> None:
    """Body of the recovery task: note the start of each attempt, then hold the claim."""
    record("attempt", tag, repr(time.time()), os.getpid())
    time.sleep(seconds)
