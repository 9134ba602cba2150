"""A throwaway PostgreSQL 15 cluster for the chaos suite: never the shared server.

initdb refuses to run as root, so the cluster belongs to the ``postgres`` OS user and lives
in a temporary directory that is removed at the end. Settings go into postgresql.conf so
that a restart keeps them.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

PG_BIN = Path(os.environ.get("LEASES_CHAOS_PG_BIN", "/usr/lib/postgresql/15/bin"))


def free_port(start: int = 5499) -> int:
    for port in range(start, start + 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port from {start}")


class Cluster:
    def __init__(self, *, max_connections: int = 40, port: int | None = None) -> None:
        if not (PG_BIN / "initdb").exists():
            raise RuntimeError(
                f"{PG_BIN}/initdb not found (apt-get install postgresql-15, or "
                "set LEASES_CHAOS_PG_BIN)"
            )
        self.port = port or free_port()
        self.max_connections = max_connections
        self.dir = Path(tempfile.mkdtemp(prefix="leases-chaos-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.restarts = 0
        self._as_root = os.geteuid() == 0

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [str(PG_BIN / args[0]), *args[1:]]
        if self._as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n"
                f"{done.stderr}\n{self.tail()}"
            )
        return done

    def tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def start(self) -> None:
        if self._as_root:
            pg = pwd.getpwnam("postgres")
            os.chown(self.dir, pg.pw_uid, pg.pw_gid)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        )
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.dir}'\nmax_connections = {self.max_connections}\n"
                "superuser_reserved_connections = 0\nfsync = off\n"
                "full_page_writes = off\nshared_buffers = 32MB\nlog_min_messages = warning\n"
            )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE chaos")

    def restart(self, mode: str = "fast") -> float:
        """pg_ctl restart -m MODE; return how long the server was away (seconds)."""
        started = time.monotonic()
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-t",
            "60",
            "-m",
            mode,
            "restart",
        )
        self.restarts += 1
        return time.monotonic() - started

    def dsn(self, db: str = "chaos") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={db} connect_timeout=3"

    def stop_and_remove(self) -> None:
        with contextlib.suppress(Exception):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)
