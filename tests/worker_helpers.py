"""Start real run_lease_worker processes for the worker tests, and wait for conditions.

The workers write JSON lines (tests/worker_settings.py, ``--log-format json``); tests wait
on and look at their events (django_leases.worker.logs.EVENTS) and fields, never at the
wording of a message, which stays free to change. Every record read is checked to carry
an event of that list.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from django.db import connection, connections, transaction

ROOT = Path(__file__).resolve().parent.parent
ON_POSTGRES = os.environ.get("DATABASE_URL", "").startswith("postgres")
PG_ONLY = (
    "needs PostgreSQL (LISTEN/NOTIFY, pg_terminate_backend); run with DATABASE_URL=postgres://..."
)


def process_ended(pid: int) -> bool:
    """Whether process ``pid`` has exited (an orphan's zombie counts: nobody may reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for(
    condition,
    timeout: float,
    what: str | Callable[[], str],
    interval: float = 0.05,
    error: type[Exception] = AssertionError,
):
    """Poll ``condition`` until it returns something truthy; raise ``error`` after
    ``timeout`` seconds (a test fails; the chaos harness catches TimeoutError). ``what``
    may be a callable, asked only then (a log's tail as it was at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise error(f"timed out after {timeout:g} s waiting for {said}")
        time.sleep(interval)


def read_records(log: str) -> list[dict[str, Any]]:
    """The JSON records of a worker's log (other lines, such as a handler's prints or a
    line still being written, are passed over). A record of the worker's loggers must
    carry an event of EVENTS: the test fails otherwise."""
    from django_leases.worker.logs import EVENTS, TASKS_LOGGER, WORKER_LOGGER

    found = []
    for line in log.splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or "logger" not in record:
            continue
        if record["logger"] in (WORKER_LOGGER, TASKS_LOGGER):
            assert record.get("event") in EVENTS, f"an event not in EVENTS: {line}"
        found.append(record)
    return found


def _matches(record: dict[str, Any], event: str, facts: dict[str, Any]) -> bool:
    """A record of ``event`` whose fields have the values of ``facts`` (compared as text:
    a TaskResult's id is a string, the record's job_id a number)."""
    return record.get("event") == event and all(
        str(record.get(k)) == str(v) for k, v in facts.items()
    )


class WorkerProcess:
    def __init__(
        self,
        worker_id: str,
        args: list[str],
        log_path: Path,
        env: dict[str, str],
        own_group: bool = False,
        prefix: tuple[str, ...] = (),
    ):
        self.worker_id = worker_id
        self.log_path = log_path
        self.own_group = own_group
        self._log = open(log_path, "wb")  # noqa: SIM115 -- closed in kill()
        self._read, self._records = 0, []  # records(): what of the log is parsed so far
        cmd = [
            *prefix,  # a command that execs the worker (nohup): the pid stays the worker's
            sys.executable,
            "-m",
            "django",
            "run_lease_worker",
            "--settings=tests.worker_settings",
            "--worker-id",
            worker_id,
            *args,
        ]
        # own_group: a process group of its own (the worker and its handler children), as
        # a systemd unit's cgroup is, so that signal_group() reaches all of them.
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            process_group=0 if own_group else None,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def records(self) -> list[dict[str, Any]]:
        """The JSON records in the log so far (see read_records), each line read once."""
        with open(self.log_path, "rb") as log:
            log.seek(self._read)
            chunk = log.read()
        complete = chunk.rfind(b"\n") + 1  # a line still being written waits for its end
        if complete:
            self._records += read_records(chunk[:complete].decode(errors="replace"))
            self._read += complete
        return list(self._records)

    def events(self, event: str, **facts: Any) -> list[dict[str, Any]]:
        """The records of ``event`` whose fields have the values of ``facts``."""
        return [r for r in self.records() if _matches(r, event, facts)]

    def wait_event(self, event: str, timeout: float = 10.0, **facts: Any) -> dict[str, Any]:
        """The first record of ``event`` with ``facts``, once the worker has logged it."""
        return wait_for(
            lambda: next(iter(self.events(event, **facts)), None),
            timeout,
            lambda: f"event {event} {facts} from {self.worker_id}:\n{self.log()[-3000:]}",
            interval=0.1,
        )

    def order(self, *wanted: tuple[str, dict[str, Any]]) -> list[int]:
        """The position in the log of the first record of each (event, facts), -1 if none."""
        records = self.records()
        return [
            next((i for i, r in enumerate(records) if _matches(r, event, facts)), -1)
            for event, facts in wanted
        ]

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def signal_group(self, sig: int) -> None:
        """Signal the worker and every process under it at once (started with
        own_group=True), as systemd's KillMode=control-group does: the worker's process
        group, and each handler child's (a child leads its own, child.py)."""
        assert self.own_group, "start the worker with own_group=True"
        under = descendants(self.pid)
        os.killpg(self.pid, sig)
        for pid in under:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def wait_exit(self, timeout: float = 15.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.worker_id} did not exit:\n{self.log()[-3000:]}") from None

    def kill(self) -> None:
        under = descendants(self.pid)
        if self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, sig)
            self.proc.wait(10)
        if self.own_group:
            # Handler children left behind, if any.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        for pid in under:  # a handler child leads its own group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self._log.close()


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (children, theirs, ...), read from /proc (Linux)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # pid (comm) state ppid ...: comm may hold spaces and parentheses.
            text = stat.read_text()
            parents[int(text.split(" ", 1)[0])] = int(text.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return found


class Workers:
    """Start workers against the test database; kill whatever is left at teardown."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.started: list[WorkerProcess] = []

    def start(
        self,
        worker_id: str,
        *args: str,
        ready: bool = True,
        notify: bool = True,
        verbosity: int = 2,
        own_group: bool = False,
        env_extra: dict[str, str] | None = None,
        log_format: str = "json",
        log_name: str | None = None,
        prefix: tuple[str, ...] = (),
    ) -> WorkerProcess:
        """Start ``run_lease_worker --worker-id worker_id *args``, logging to
        ``log_name`` (default: the worker id) in the test's directory."""
        env = dict(os.environ)
        env.update(env_extra or {})
        env["LEASES_WORKER_DB_NAME"] = connection.settings_dict["NAME"]
        if "queue" in connections.settings:
            # The "queue" backend's test database (its own name only if a test set it up).
            env["LEASES_WORKER_QUEUE_DB_NAME"] = connections["queue"].settings_dict["NAME"]
        env["LEASES_WORKER_NOTIFY"] = "1" if notify else "0"
        env["PYTHONPATH"] = str(ROOT)
        worker = WorkerProcess(
            worker_id,
            ["--log-format", log_format, *args, "-v", str(verbosity)],
            self.tmp_path / f"{log_name or worker_id}.log",
            env,
            own_group,
            prefix,
        )
        self.started.append(worker)
        if ready:
            assert log_format == "json", "a worker logging text is started with ready=False"
            # A bound on start-up, not a measure: a loaded machine may take long to import.
            worker.wait_event("started", timeout=60)
        return worker

    def close(self) -> None:
        for worker in self.started:
            worker.kill()
        for worker in self.started:
            worker.records()  # each record of the worker's names an event of EVENTS


# Short leases so that expiry happens within a test.
LEASE, BEAT, POLL = 2.0, 0.5, 0.2
FAST = ["--lease", str(LEASE), "--heartbeat", str(BEAT), "--poll", str(POLL)]


# The process token of rows worker_row() registers (WorkerProcess.instance).
ROW_INSTANCE = "test"


def worker_row(worker_id: str, hostname: str = "h", pid: int = 1, queues=("default",)) -> None:
    """A worker's row as run_lease_worker registers it (10 s beats), for a test that needs
    one without starting a worker."""
    from django_leases.models import WorkerProcess

    WorkerProcess.objects.register(
        worker_id,
        instance=ROW_INSTANCE,
        hostname=hostname,
        pid=pid,
        queues=list(queues),
        heartbeat_seconds=10,
    )


def job_of(result):
    """The job row behind a django.tasks TaskResult."""
    from django_leases.models import Job

    return Job.objects.get(pk=int(result.id))


def _session_id() -> Any:
    """This connection's database session: its backend pid (PostgreSQL), connection id
    (MySQL). Through a transaction pooler it is stable only inside one transaction."""
    own = "pg_backend_pid()" if connection.vendor == "postgresql" else "CONNECTION_ID()"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {own}")
        return cursor.fetchone()[0]


class Held:
    """The open transaction of held_open(): commit it, or wait until it blocks another."""

    def __init__(self, finish: threading.Event) -> None:
        self.commit = finish.set
        self.session: Any = None  # read inside the transaction, so a pooler cannot change it

    def until_it_blocks_another(self, seconds: float = 30.0) -> bool:
        """True once another session waits for a lock this transaction holds, False after
        ``seconds``: a race test's proof that the race happened. The waiter is found
        through the holder (PostgreSQL's pg_blocking_pids), as through a transaction
        pooler its own session is not known before it waits; on MySQL/MariaDB, as any
        other session of the test database in an InnoDB lock wait (the table that names
        the blocker is not the same on the two), the test's own being the only ones."""
        query = (
            "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))"
            if connection.vendor == "postgresql"
            else "SELECT count(*) FROM information_schema.innodb_trx t "
            "JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id "
            "WHERE t.trx_state = 'LOCK WAIT' AND p.db = DATABASE() AND p.id <> %s"
        )
        # InnoDB refreshes these tables only when they were last read over 0.1 s ago:
        # polled faster, they would never show the wait.
        pause = 0.01 if connection.vendor == "postgresql" else 0.15
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with connection.cursor() as cursor:
                cursor.execute(query, [self.session])
                if cursor.fetchone()[0]:
                    return True
            time.sleep(pause)
        return False


@contextlib.contextmanager
def held_open(write: Callable[[], Any]) -> Iterator[Held]:
    """Run ``write`` in a transaction of another thread (its own connection) and keep it
    open, its row locks held, until the block ends or ``Held.commit`` is called; then it
    commits. A race test's other session."""
    written, finish = threading.Event(), threading.Event()
    held = Held(finish)
    failed: list[BaseException] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                write()
                held.session = _session_id()
                written.set()
                finish.wait(30)
        except BaseException as e:  # noqa: BLE001 -- reported to the test below
            failed.append(e)
            written.set()
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert written.wait(30) and not failed, failed
    try:
        yield held
    finally:
        finish.set()
        holder.join(30)
    assert not failed, failed
