"""manage.py run_lease_worker: parse and check the options, then Worker(...).run()."""

from __future__ import annotations

import atexit
import concurrent.futures.thread
import contextlib
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from django.core.management.base import CommandError, CommandParser

from ... import conf
from ...exceptions import InvalidLeaseOption
from ...worker.shutdown import exit_status
from .. import LeasesCommand, unapplied_migrations, unmigrated

if TYPE_CHECKING:
    from ...worker import Worker


class Command(LeasesCommand):
    help = (
        "Run jobs of a django_leases backend: claim under a lease, renew it from a "
        "heartbeat thread, acknowledge on success. Stops gracefully on SIGTERM, SIGINT or SIGHUP."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        defaults = self._defaults()
        parser.add_argument(
            "--backend",
            default=None,
            help="Alias in settings.TASKS of the lease backend to serve (default: the first "
            "lease backend). Its OPTIONS give the defaults below.",
        )
        served = parser.add_mutually_exclusive_group()
        served.add_argument(
            "--queue",
            action="append",
            dest="queues",
            metavar="NAME",
            help="Queue to take jobs from; repeat for several (default: every queue in the "
            "backend's QUEUES, which Django reads as ['default'] when absent; every queue "
            "at all when QUEUES is empty).",
        )
        served.add_argument(
            "--all-queues",
            action="store_true",
            help="Take jobs of every queue, whatever its name (the default when the "
            "backend's QUEUES is empty).",
        )
        parser.add_argument(
            "--concurrency",
            type=int,
            default=None,
            metavar="N",
            help=_option_help("CONCURRENCY", f"{defaults.concurrency}"),
        )
        parser.add_argument(
            "--isolation",
            choices=["thread", "process"],
            default="thread",
            help="Run each handler in a thread (default) or in a child process that is "
            "killed if its claim is lost and it does not stop by itself.",
        )
        parser.add_argument(
            "--lease",
            type=float,
            default=None,
            metavar="SECONDS",
            help="Lease given to every claim and renewal (default: each job's own lease, "
            f"LEASE_SECONDS when enqueued through the backend: {defaults.lease_seconds:g}).",
        )
        parser.add_argument(
            "--heartbeat",
            type=float,
            default=None,
            metavar="SECONDS",
            help="Renewal period, shorter than the lease (default: the smaller of "
            "HEARTBEAT_SECONDS and lease / 3, the lease being --lease or else "
            f"LEASE_SECONDS: {conf.worker_heartbeat(defaults, None):g} "
            "s without --lease). Claims whose own lease is shorter are renewed every "
            "third of it anyway.",
        )
        parser.add_argument(
            "--poll",
            type=float,
            default=None,
            metavar="SECONDS",
            help=_option_help("POLL_SECONDS", f"{defaults.poll_seconds:g}; with 10%% jitter"),
        )
        parser.add_argument(
            "--burst",
            action="store_true",
            help="Exit (status 0) as soon as nothing is claimable and nothing is running.",
        )
        parser.add_argument(
            "--max-jobs",
            type=int,
            default=None,
            metavar="N",
            help="Exit after claiming N jobs and settling them.",
        )
        parser.add_argument(
            "--grace",
            type=float,
            default=None,
            metavar="SECONDS",
            help=_option_help(
                "GRACE_SECONDS", f"{defaults.grace_seconds:g}; on SIGTERM/SIGINT/SIGHUP"
            ),
        )
        parser.add_argument(
            "--worker-id",
            default=None,
            help="Name recorded as claimed_by and in the worker table (default: host-pid); "
            "one live process per id: a second waits until the first stops or goes silent.",
        )
        parser.add_argument(
            "--log-format",
            choices=["text", "json"],
            default="text",
            help="Lines of the handler this command adds when LOGGING does not route the "
            "worker's loggers: text (default) or one JSON object per line.",
        )
        parser.add_argument(
            "--skip-connection-check",
            action="store_true",
            help="Neither refuse to start when the database's connection limits leave fewer "
            "connections than the worker may hold (2 or 3 + --concurrency), nor open a "
            "handler's connection before it runs: for handlers that do not use the "
            "database, or behind a connection pooler, whose own limit is what counts.",
        )

    @staticmethod
    def _defaults() -> conf.LeaseOptions:
        try:
            return conf.get_options(None)
        except InvalidLeaseOption:
            return conf.LeaseOptions.from_dict({})

    def execute(self, *args: Any, **options: Any) -> Any:
        """Wait for the database before Django's system checks, some of which query it
        (a GeneratedField's, MySQL's features): started while the database is down or
        full, the worker waits as it does for any outage, then checks and starts."""
        from ...worker.identity import default_worker_id
        from ...worker.logs import configure
        from ...worker.startup import wait_for_database

        configure(options["verbosity"], options["log_format"])
        try:
            kwargs = self._worker_kwargs(options)
        except InvalidLeaseOption:
            kwargs = None  # handle() reports it, after the checks have had their say
        if kwargs is not None and not wait_for_database(
            kwargs["database"], kwargs["worker_id"] or default_worker_id()
        ):
            return None  # stopped by a stop signal while waiting: a clean exit
        return super().execute(*args, **options)

    def handle(self, *args: Any, **options: Any) -> None:
        from ...worker import Worker

        try:
            kwargs = self._worker_kwargs(options)
        except InvalidLeaseOption as e:
            raise CommandError(f"--{e.option.replace('_', '-')}: {e.reason}") from e
        _require_ready_database(kwargs["database"])
        if kwargs["connect_handlers"]:
            _require_connections(kwargs)
        worker = Worker(**kwargs)
        try:
            status = worker.run()
        except BaseException as e:
            if worker.handlers_running():
                _end_now(exit_status(e), worker)
            raise
        if worker.handlers_running():
            _end_now(status, worker)
        # Its own process (run_from_argv), not a project's call_command(), which goes on.
        if getattr(self, "_called_from_command_line", False):
            _end_if_threads_linger(status, worker)
        if status:
            sys.exit(status)

    def _worker_kwargs(self, options: dict[str, Any]) -> dict[str, Any]:
        """Check every option before anything is claimed; raise InvalidLeaseOption naming it."""
        from ...worker.options import worker_kwargs

        try:
            return worker_kwargs(
                backend=options["backend"],
                queues=options["queues"],
                all_queues=options.get("all_queues", False),
                lease=options["lease"],
                heartbeat=options["heartbeat"],
                concurrency=options["concurrency"],
                poll=options["poll"],
                grace=options["grace"],
                max_jobs=options["max_jobs"],
                worker_id=options["worker_id"],
                isolation=options["isolation"],
                burst=options["burst"],
                connect_handlers=not options.get("skip_connection_check", False),
            )
        except InvalidLeaseOption as e:
            if e.option == "queues":  # the flag is --queue, given once per queue
                raise InvalidLeaseOption("queue", e.reason) from e
            raise


def _option_help(name: str, default: str) -> str:
    """An option's --help: what the backend's OPTIONS say of it (conf.OPTIONS), and its
    value there, which is the default here."""
    return f"{conf.OPTIONS[name].help.removesuffix('.')} (default: {name}, {default})."


# How long the project's exit hooks may take when the worker ends at once: a handler left
# running after its release runs on meanwhile (docs/worker.md, "Signals and stopping").
EXIT_HOOKS_SECONDS = 2.0


def _end_if_threads_linger(status: int, worker: Worker) -> None:
    """Python waits at exit for every thread that is not a daemon: one a handler started
    (``daemon=False``) and left looping kept a stopped worker alive forever ("Worker
    stopped", then nothing; a second SIGTERM, or a --burst run that never ended). Such
    threads get the grace to end; then the process ends without them, naming them."""
    wait = max(worker.grace, 1.0)
    deadline = time.monotonic() + wait
    _end_idle_executor_threads()
    for thread in _threads_python_waits_for():
        thread.join(max(0.0, deadline - time.monotonic()))
    names = [thread.name for thread in _threads_python_waits_for()]
    if not names:
        return
    with contextlib.suppress(Exception):
        logging.getLogger("django_leases.worker").warning(
            "Threads still run %s s after the worker stopped: %s; ending the process without them",
            wait,
            ", ".join(names),
            extra={"event": "threads_left", "threads": names},
        )
    _end_now(status, worker)


def _end_idle_executor_threads() -> None:
    """Tell every executor's threads to end once idle, as Python's exit does before it
    joins them: an idle one waits on its queue for work (asgiref keeps a pool's thread
    per async_to_sync call until it is collected), and joined without this word it held
    the stop for the whole grace. No executor takes work from here on."""
    module = concurrent.futures.thread
    queues = getattr(module, "_threads_queues", None)
    lock = getattr(module, "_global_shutdown_lock", None)
    if queues is None or lock is None:
        return
    with lock:
        module._shutdown = True
    for work in list(queues.values()):
        work.put(None)


def _threads_python_waits_for() -> list[threading.Thread]:
    """The threads besides this one that Python would join at exit: alive, no daemon,
    or an executor's, which concurrent.futures joins at exit even as daemons (asyncio's
    default executor's among them: a run_in_executor() call an async handler left)."""
    current = threading.current_thread()
    waited = [t for t in threading.enumerate() if not t.daemon]
    executors = getattr(concurrent.futures.thread, "_threads_queues", {})
    waited += [t for t in list(executors) if t not in waited]
    return [t for t in waited if t is not current and t.is_alive()]


def _end_now(status: int, worker: Worker) -> None:
    """End the process at once, handlers still running with it (as the handlers_running
    line said), not when Python has joined every thread: an async handler's event loop
    runs on one it waits for (asgiref's). Handler children are killed, connections
    closed, and the exit hooks (atexit: logging's flush, an error tracker's) run on the
    main thread, as at any exit, for EXIT_HOOKS_SECONDS at most; multiprocessing's own
    hook, which would spend them waiting for children, is left out. Whatever happens
    meanwhile, os._exit comes last: stop signals are ignored from here, and a hook still
    running when the time is up is left its locks (logging's, stdout's) rather than the
    exit waiting on them."""
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                signal.signal(signum, signal.SIG_IGN)
        # Armed first: nothing below may keep the process alive past the hooks' time.
        deadline = threading.Timer(EXIT_HOOKS_SECONDS, os._exit, args=(status,))
        deadline.daemon = True
        deadline.start()
        with contextlib.suppress(Exception):
            worker.kill_handler_processes()
        from django.db import connections

        with contextlib.suppress(Exception):
            connections.close_all()
        # multiprocessing's own exit hook would join every child, without a timeout for
        # one not a daemon, before the hooks registered earlier (an error tracker's) ran.
        # The project's daemon children are ended as that hook would have; others outlive
        # the process, as with any os._exit.
        exit_function = getattr(multiprocessing.util, "_exit_function", None)
        if exit_function is not None:
            atexit.unregister(exit_function)
        for child in multiprocessing.active_children():
            if child.daemon:
                with contextlib.suppress(Exception):
                    child.terminate()
        atexit._run_exitfuncs()  # logging's flush among them
        for finish in (sys.stdout.flush, sys.stderr.flush):
            with contextlib.suppress(Exception):
                finish()
    finally:
        os._exit(status)


def _require_ready_database(database: str) -> None:
    """Refuse to start on a database that lacks django_leases's tables or columns (every
    claim would fail, and the loop would log the same error once per poll forever), or
    whose session clock is not UTC (MySQL/MariaDB: every lease would be off)."""
    from django.db import DatabaseError

    try:
        missing = unapplied_migrations(database)
    except DatabaseError as e:
        # Unreachable for now: the loop waits for it like for any outage.
        logging.getLogger("django_leases.worker").warning(
            "Could not check the migrations of database %r: %s",
            database,
            e,
            extra={"event": "migrations_unchecked", "error": str(e)},
        )
        return
    if missing:
        raise unmigrated(database, missing)
    from ...checks import utc_session_problem

    problem = utc_session_problem(database)
    if problem:
        raise CommandError(problem)


def _require_connections(kwargs: dict[str, Any]) -> None:
    """Refuse a worker that may hold more connections than the database lets its role
    open now: its handlers would fail with "too many connections" and its renewals too."""
    from django.db import DatabaseError, connections

    from ...capacity import connection_limits

    database, concurrency = kwargs["database"], kwargs["concurrency"]
    # The listener's connection counts here only when it goes to this database.
    listener = int(
        kwargs["notify"]
        and kwargs["listen_database"] == database
        and connections[database].vendor == "postgresql"
    )
    needed = 2 + listener + concurrency
    try:
        limits = connection_limits(database)
    except DatabaseError as e:
        logging.getLogger("django_leases.worker").warning(
            "Could not read the connection limits of database %r: %s",
            database,
            e,
            extra={"event": "limits_unread", "error": str(e)},
        )
        return
    if not limits or limits[0].free >= needed:
        return
    tightest = limits[0]
    fits = tightest.free - 2 - listener
    raise CommandError(
        f"--concurrency {concurrency} needs up to {needed} connections to database "
        f"{database!r} (main 1, heartbeat 1, listener {listener}, handlers {concurrency}), "
        f"but {tightest.what} allows {tightest.size} and other sessions hold "
        f"{tightest.in_use_by_others}: {tightest.free} free. "
        + (
            f"Lower --concurrency to {fits} or less, raise the limit"
            if fits >= 1
            else "Raise the limit, wait for the other sessions to close"
        )
        + ", or pass --skip-connection-check (behind a connection pooler)."
    )
