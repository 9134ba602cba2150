"""A throwaway PgBouncer in transaction pooling mode, for the pooled test pass and the chaos
suite (Debian's ``pgbouncer``; ``LEASES_PGBOUNCER`` names another binary).

It lives in a temporary directory with its own ini and auth file, listens on a free port of
127.0.0.1 and sends every database name on to the PostgreSQL server it is given (trust).
PgBouncer refuses to run as root, so under root it runs as the ``postgres`` OS user, as the
chaos suite's cluster does. A small pool with round-robin server choice makes the
transactions of one client connection land on different server sessions, so that anything
relying on session state across transactions breaks in these tests instead of in
production.

    python -m tests.pooler start DIR --target 127.0.0.1:5432    prints the port, runs detached
    python -m tests.pooler stop DIR
    python -m tests.pooler dropdb NAME... --target 127.0.0.1:5432   directly, not pooled
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BINARY = os.environ.get("LEASES_PGBOUNCER") or shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
MISSING = (
    f"PgBouncer not found ({BINARY}): apt-get install pgbouncer, or set LEASES_PGBOUNCER "
    "to its binary"
)


def available() -> bool:
    return os.access(BINARY, os.X_OK)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgBouncer:
    """One pgbouncer process; ``port`` is where clients connect, ``admin_dsn()`` its console."""

    def __init__(
        self,
        target_port: int,
        *,
        target_host: str = "127.0.0.1",
        directory: Path | None = None,
        pool_size: int = 5,
        query_wait_timeout: int = 30,
    ) -> None:
        self.dir = directory or Path(tempfile.mkdtemp(prefix="leases-pgbouncer-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.target = (target_host, target_port)
        self.pool_size = pool_size
        self.query_wait_timeout = query_wait_timeout
        self.port = 0
        self.ini = self.dir / "pgbouncer.ini"
        self.log = self.dir / "pgbouncer.log"
        self.pidfile = self.dir / "pgbouncer.pid"
        self._as_root = os.geteuid() == 0

    def _write_config(self) -> None:
        host, port = self.target
        (self.dir / "userlist.txt").write_text('"postgres" ""\n')
        self.ini.write_text(
            "[databases]\n"
            f"* = host={host} port={port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'userlist.txt'}\n"
            "admin_users = postgres\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {self.pool_size}\n"
            # Server sessions opened ahead, so that round robin has several to go round.
            f"min_pool_size = {self.pool_size}\n"
            "max_client_conn = 1000\n"
            # Each transaction takes the next server session in turn (not the last used).
            "server_round_robin = 1\n"
            # Reconnect to a restarted server at once; give up on a wait well before CI does.
            "server_login_retry = 1\n"
            "server_connect_timeout = 3\n"
            f"query_wait_timeout = {self.query_wait_timeout}\n"
            "ignore_startup_parameters = extra_float_digits\n"
            f"logfile = {self.log}\n"
            f"pidfile = {self.pidfile}\n"
        )

    def start(self) -> int:
        """Start it detached (it outlives this process); return its port."""
        if not available():
            raise RuntimeError(MISSING)
        self.port = free_port()
        self._write_config()
        cmd = [BINARY, "-d", str(self.ini)]
        if self._as_root:
            pg = pwd.getpwnam("postgres")
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, pg.pw_uid, pg.pw_gid)
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}\n{self.tail()}"
            )
        deadline = time.monotonic() + 15
        while not self._accepting():
            if time.monotonic() > deadline:
                raise RuntimeError(f"pgbouncer did not listen on port {self.port}:\n{self.tail()}")
            time.sleep(0.05)
        return self.port

    def _accepting(self) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def admin_dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=pgbouncer"

    def stop(self) -> None:
        """Stop it (immediate shutdown) and remove its directory."""
        stop(self.dir)


def stop(directory: Path) -> None:
    pidfile = directory / "pgbouncer.pid"
    with contextlib.suppress(OSError, ValueError):
        pid = int(pidfile.read_text().strip())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            os.kill(pid, 0)  # raises once it is gone
            time.sleep(0.05)
    shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.pooler")
    parser.add_argument("action", choices=["start", "stop", "dropdb"])
    parser.add_argument("dir", help="start, stop: its directory; dropdb: database names", nargs="+")
    parser.add_argument("--target", default="127.0.0.1:5432", help="the PostgreSQL server")
    parser.add_argument("--pool-size", type=int, default=5)
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    if args.action == "stop":
        stop(Path(args.dir[0]))
        return 0
    if args.action == "dropdb":
        import psycopg

        dsn = f"host={host} port={port} user=postgres dbname=postgres"
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in args.dir:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        return 0
    if not available():
        sys.stderr.write(MISSING + "\n")
        return 3
    bouncer = PgBouncer(
        int(port), target_host=host, directory=Path(args.dir[0]), pool_size=args.pool_size
    )
    sys.stdout.write(f"{bouncer.start()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
