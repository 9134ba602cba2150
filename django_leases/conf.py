"""The backend's OPTIONS, with defaults modelled on SQS, validated in one place.

Settings live in ``TASKS[alias]["OPTIONS"]`` (Django's convention for task backends) and are
read when asked for, never at import time.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS
from django.tasks import DEFAULT_TASK_QUEUE_NAME

from .exceptions import InvalidLeaseOption
from .jsonsafe import shown

# SQS's visibility timeout bounds: 30 s by default, 12 h at most.
DEFAULT_LEASE_SECONDS = 30.0
MAX_LEASE_SECONDS = 12 * 60 * 60
MIN_LEASE_SECONDS = 1.0


SILENT_PERIODS = 2
"""How many of its own heartbeat periods a worker (or a claim's renewals) may miss before
it looks gone: one missed renewal is a slow statement, two are a stopped heartbeat."""
SILENT_SLACK_SECONDS = 1.0
"""Added to those periods: a slow beat statement or ordinary scheduling delays the next
beat by tens of milliseconds, as much as a sub-second period's whole margin, and a healthy
worker judged gone has its claims ended by the admin's action."""

UNCOUNTED_RELEASES = 10
"""How many times a job may be given back at a worker's stop, its attempt not counted,
with no checkpoint between that moved its cursor: past it each release counts the attempt
(ReleasedTooOften), so that a handler that stops its own worker (a signal to it, the memory
that gets its pod evicted) ends dead instead of restarting workers forever. A checkpoint
with a new cursor starts the count again: a long job that saves its progress is released
at every deploy without cost."""


def silent_after(period: float) -> float:
    """Seconds of silence after which a worker beating every ``period`` seconds looks gone
    (SILENT_PERIODS periods and SILENT_SLACK_SECONDS)."""
    return SILENT_PERIODS * period + SILENT_SLACK_SECONDS


def ended_early(granted: float | None) -> bool:
    """Whether a claim whose last claim or renewal granted ``granted`` seconds (None:
    unknown) was ended before its time (expire_now(), the admin's action) rather than run
    out: no claim is granted less than MIN_LEASE_SECONDS."""
    return granted is None or granted < MIN_LEASE_SECONDS


# The times an enqueue may name (run_after, deadline), in UTC: MySQL's and MariaDB's DATETIME
# range, which PostgreSQL and SQLite also hold.
EARLIEST_TIME = datetime(1000, 1, 1, tzinfo=UTC)
LATEST_TIME = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
# The longest delay or max_age: Now() plus it stays far inside LATEST_TIME on every database.
MAX_INTERVAL_DAYS = 36500
MAX_INTERVAL_SECONDS = MAX_INTERVAL_DAYS * 86400


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    check_id: str
    help: str


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option(
            "DATABASE",
            DEFAULT_DB_ALIAS,
            "django_leases.E010",
            "Database alias that holds this backend's jobs.",
        ),
        Option(
            "LEASE_SECONDS",
            DEFAULT_LEASE_SECONDS,
            "django_leases.E001",
            "How long a claim stays valid without renewal (1 s to 12 h).",
        ),
        Option(
            "HEARTBEAT_SECONDS",
            None,
            "django_leases.E002",
            "Renewal period; shorter than the lease. None means lease / 3.",
        ),
        Option(
            "MAX_ATTEMPTS",
            5,
            "django_leases.E005",
            "Claims a job may use (an expired lease counts) before it is dead.",
        ),
        Option(
            "RETENTION_DAYS",
            14,
            "django_leases.E006",
            "How long finished jobs are kept before pruning.",
        ),
        Option(
            "MAX_AGE_DAYS",
            14,
            "django_leases.E013",
            "A job not finished this long after it is due is dead-lettered (SQS retention).",
        ),
        Option(
            "RETRY",
            None,
            "django_leases.E014",
            "Default retry ladder: a list of delays or a dict (base, factor, cap, jitter).",
        ),
        Option(
            "POLL_SECONDS",
            1.0,
            "django_leases.E007",
            "How often an idle worker looks for due jobs.",
        ),
        Option("CONCURRENCY", 10, "django_leases.E008", "Handlers a worker process runs at once."),
        Option(
            "GRACE_SECONDS",
            20.0,
            "django_leases.E009",
            "How long a stopping worker lets handlers finish before it tells them to stop "
            "and releases their jobs (a thread's handler then has up to 1 s to return; a "
            "process's is killed at once).",
        ),
        Option(
            "TIMEOUT_SECONDS",
            None,
            "django_leases.E024",
            "How long a handler may run before the worker stops it and fails the attempt "
            "(a process's handler is killed); None: no limit. A task's own timeout wins.",
        ),
        Option(
            "QUEUE_OPTIONS",
            {},
            "django_leases.E012",
            "Per-queue LEASE_SECONDS / MAX_ATTEMPTS / RETRY / TIMEOUT_SECONDS, e.g. "
            "{'reports': {'LEASE_SECONDS': 600}}.",
        ),
        Option(
            "NOTIFY",
            True,
            "django_leases.E011",
            "Wake idle workers with LISTEN/NOTIFY on PostgreSQL; off behind a transaction "
            "pooler unless LISTEN_DATABASE names a direct connection.",
        ),
        Option(
            "LISTEN_DATABASE",
            None,
            "django_leases.E019",
            "Database alias of a direct (unpooled) PostgreSQL connection to the jobs' database, "
            "used only for LISTEN; None listens on DATABASE.",
        ),
        Option(
            "TASK_MODULES",
            [],
            "django_leases.E016",
            "Modules holding @task functions besides each installed app's tasks module, "
            "e.g. ['shop.jobs']; workers and readers import them.",
        ),
        Option(
            "SCHEDULES",
            {},
            "django_leases.E020",
            "Periodic jobs by name: {'nightly': {'task': 'shop.tasks.report', "
            "'cron': '0 3 * * *', 'timezone': 'Europe/Paris'}} (docs/periodic.md).",
        ),
    )
}
UNKNOWN_OPTION_ID = "django_leases.E003"


def checked_number(
    name: str, value: Any, *, low: float, high: float | None = None, integer: bool = False
) -> float:
    """``value`` if it is a number (a whole one if ``integer``) from ``low`` to ``high``,
    else InvalidLeaseOption naming ``name``: NaN, infinities and bools are refused."""
    kind = "a whole number" if integer else "a number"
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (integer and not isinstance(value, int))
    ):
        raise InvalidLeaseOption(name, f"must be {kind}, got {shown(value)}")
    # NaN fails both comparisons; math.isfinite() of a huge int would raise OverflowError.
    if not (low <= value and (high is None or value <= high)) or value in (math.inf, -math.inf):
        upper = f" and at most {_plain(high)}" if high is not None else ""
        raise InvalidLeaseOption(name, f"must be at least {_plain(low)}{upper}, got {shown(value)}")
    return value


def _plain(number: float) -> str:
    """A bound as written in a message: 36500 and 1000000000, not 1e+09; 0.01 as it is."""
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


def validate_lease(value: Any, name: str = "LEASE_SECONDS") -> float:
    """Return the lease in seconds, or raise InvalidLeaseOption naming ``name``."""
    return float(checked_number(name, value, low=MIN_LEASE_SECONDS, high=MAX_LEASE_SECONDS))


def validate_heartbeat(value: Any, lease: float, name: str = "HEARTBEAT_SECONDS") -> float:
    """Return the heartbeat period; it must be positive and shorter than the lease."""
    if value is None:
        return lease / 3
    period = float(checked_number(name, value, low=0.01))
    if period >= lease:
        raise InvalidLeaseOption(
            name,
            f"must be shorter than the lease ({lease:g} s), got {shown(value)}; "
            "a renewal that comes after the lease ran out cannot keep the claim",
        )
    return period


def validate_max_attempts(value: Any, name: str = "MAX_ATTEMPTS") -> int:
    return int(checked_number(name, value, low=1, high=1000, integer=True))


def validate_poll(value: Any, name: str = "POLL_SECONDS") -> float:
    return float(checked_number(name, value, low=0.001, high=3600))


def validate_concurrency(value: Any, name: str = "CONCURRENCY") -> int:
    return int(checked_number(name, value, low=1, high=1000, integer=True))


def validate_grace(value: Any, name: str = "GRACE_SECONDS") -> float:
    return float(checked_number(name, value, low=0, high=MAX_LEASE_SECONDS))


# The shortest run timeout: a process-isolated handler's start (a fresh interpreter, Django
# set up) counts against it, and a shorter one would end handlers before they began. The
# longest: a week (None, no limit, for longer).
MIN_TIMEOUT_SECONDS = 1.0
MAX_TIMEOUT_SECONDS = 7 * 86400


def validate_timeout(value: Any, name: str = "TIMEOUT_SECONDS") -> float | None:
    """The run timeout in seconds, or None for no limit; InvalidLeaseOption naming ``name``."""
    if value is None:
        return None
    return float(checked_number(name, value, low=MIN_TIMEOUT_SECONDS, high=MAX_TIMEOUT_SECONDS))


@dataclass(frozen=True)
class LeaseOptions:
    """One backend's validated options."""

    database: str
    lease_seconds: float
    heartbeat_seconds: float
    max_attempts: int
    retention_days: float
    max_age_days: float
    retry: Any
    poll_seconds: float
    concurrency: int
    grace_seconds: float
    notify: bool
    # The alias the worker LISTENs on: LISTEN_DATABASE, else DATABASE.
    listen_database: str
    queue_options: dict[str, dict[str, Any]]
    # How long a handler may run (None: no limit); a task's own timeout and the queue's win.
    timeout_seconds: float | None = None

    def for_queue(self, queue_name: str) -> tuple[float, int]:
        """The (lease seconds, max attempts) a job of ``queue_name`` gets by default."""
        per_queue = self.queue_options.get(queue_name, {})
        return (
            float(per_queue.get("LEASE_SECONDS", self.lease_seconds)),
            int(per_queue.get("MAX_ATTEMPTS", self.max_attempts)),
        )

    def retry_for_queue(self, queue_name: str) -> Any:
        """The retry ladder of ``queue_name``'s jobs (a Retry), or None for the default."""
        per_queue = self.queue_options.get(queue_name, {})
        if "RETRY" in per_queue:
            return _validate_retry(per_queue["RETRY"])
        return self.retry

    def timeout_for_queue(self, queue_name: str) -> float | None:
        """How long a handler of ``queue_name`` may run when its task sets no timeout."""
        per_queue = self.queue_options.get(queue_name, {})
        if "TIMEOUT_SECONDS" in per_queue:
            return validate_timeout(per_queue["TIMEOUT_SECONDS"])
        return self.timeout_seconds

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> LeaseOptions:
        """Validate ``options``; raise InvalidLeaseOption on the first problem."""
        problems = validate_options(options)
        if problems:
            raise problems[0]
        merged = {name: options.get(name, o.default) for name, o in OPTIONS.items()}
        lease = validate_lease(merged["LEASE_SECONDS"])
        return cls(
            database=merged["DATABASE"],
            lease_seconds=lease,
            heartbeat_seconds=validate_heartbeat(merged["HEARTBEAT_SECONDS"], lease),
            max_attempts=merged["MAX_ATTEMPTS"],
            retention_days=float(merged["RETENTION_DAYS"]),
            max_age_days=float(merged["MAX_AGE_DAYS"]),
            retry=_validate_retry(merged["RETRY"]),
            poll_seconds=float(merged["POLL_SECONDS"]),
            concurrency=merged["CONCURRENCY"],
            grace_seconds=float(merged["GRACE_SECONDS"]),
            notify=merged["NOTIFY"],
            listen_database=merged["LISTEN_DATABASE"] or merged["DATABASE"],
            queue_options=dict(merged["QUEUE_OPTIONS"]),
            timeout_seconds=validate_timeout(merged["TIMEOUT_SECONDS"]),
        )


def validate_options(options: Any) -> list[InvalidLeaseOption]:
    """Return every problem with a backend's OPTIONS dict (empty when valid)."""
    if not isinstance(options, dict):
        return [InvalidLeaseOption("OPTIONS", f"must be a dict, got {options!r}")]
    problems: list[InvalidLeaseOption] = []
    for name in options:
        if name not in OPTIONS:
            # Compared upper-cased: 'lease_seconds' is a spelling of LEASE_SECONDS.
            close = difflib.get_close_matches(str(name).upper(), OPTIONS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            problems.append(
                InvalidLeaseOption(
                    str(name),
                    f"is not an option of django_leases{hint} Known options: {', '.join(OPTIONS)}.",
                )
            )
    merged = {name: options.get(name, o.default) for name, o in OPTIONS.items()}
    checks: list[tuple[str, Callable[[Any], object]]] = [
        ("LEASE_SECONDS", lambda v: validate_lease(v)),
        ("MAX_ATTEMPTS", validate_max_attempts),
        ("RETENTION_DAYS", lambda v: checked_number("RETENTION_DAYS", v, low=1 / 24, high=3650)),
        ("MAX_AGE_DAYS", lambda v: checked_number("MAX_AGE_DAYS", v, low=1 / 1440, high=3650)),
        ("RETRY", _validate_retry),
        ("POLL_SECONDS", validate_poll),
        ("CONCURRENCY", validate_concurrency),
        ("GRACE_SECONDS", validate_grace),
        ("TIMEOUT_SECONDS", validate_timeout),
    ]
    for name, check in checks:
        try:
            check(merged[name])
        except InvalidLeaseOption as e:
            problems.append(e)
    try:
        lease = validate_lease(merged["LEASE_SECONDS"])
    except InvalidLeaseOption:
        lease = None
    if lease is not None:
        try:
            validate_heartbeat(merged["HEARTBEAT_SECONDS"], lease)
        except InvalidLeaseOption as e:
            problems.append(e)
    problems.extend(_queue_option_problems(merged["QUEUE_OPTIONS"]))
    if not isinstance(merged["NOTIFY"], bool):
        problems.append(
            InvalidLeaseOption("NOTIFY", f"must be True or False, got {merged['NOTIFY']!r}")
        )
    problems.extend(_listen_database_problems(merged["LISTEN_DATABASE"]))
    problems.extend(_task_module_problems(merged["TASK_MODULES"]))
    if merged["DATABASE"] not in settings.DATABASES:
        problems.append(
            InvalidLeaseOption("DATABASE", f"{merged['DATABASE']!r} is not in settings.DATABASES")
        )
    return problems


def _validate_retry(value: Any, name: str = "RETRY") -> Any:
    from .retry import Retry, checked_ladder

    if value is None:
        return None
    try:
        return checked_ladder(Retry.from_json(value))
    except InvalidLeaseOption as e:
        raise InvalidLeaseOption(name + _setting_index(value, e.option), e.reason) from e


def _setting_index(value: Any, option: str) -> str:
    """Where in a RETRY setting ``value`` the enqueue() option path ``option`` points, as
    Python indexes it: ``retry.delays[2]`` is ``[2]`` of a list, ``['delays'][2]`` of a
    dict; ``retry`` is the setting itself."""
    rest = option.removeprefix("retry")
    if isinstance(value, list | tuple):
        return rest.removeprefix(".delays")
    field, bracket, tail = rest.removeprefix(".").partition("[")
    return f"[{field!r}]{bracket}{tail}" if field else rest


def _listen_database_problems(alias: Any) -> list[InvalidLeaseOption]:
    """LISTEN_DATABASE: None, or an alias of settings.DATABASES on PostgreSQL (LISTEN is
    PostgreSQL's; an alias of another engine would silently never wake anyone)."""
    if alias is None:
        return []
    if not isinstance(alias, str) or alias not in settings.DATABASES:
        return [
            InvalidLeaseOption(
                "LISTEN_DATABASE",
                f"must be None or an alias of settings.DATABASES, got {shown(alias)}",
            )
        ]
    engine = str(settings.DATABASES[alias].get("ENGINE", ""))
    if "postgresql" not in engine and "postgis" not in engine:
        return [
            InvalidLeaseOption(
                "LISTEN_DATABASE",
                f"{alias!r} is not a PostgreSQL database (ENGINE {engine!r}); LISTEN is "
                "PostgreSQL's",
            )
        ]
    return []


def _task_module_problems(modules: Any) -> list[InvalidLeaseOption]:
    """TASK_MODULES must be a list of dotted module paths that can be found."""
    from importlib.util import find_spec

    if not isinstance(modules, list | tuple):
        return [
            InvalidLeaseOption("TASK_MODULES", f"must be a list of module paths, got {modules!r}")
        ]
    problems = []
    for i, module in enumerate(modules):
        if not isinstance(module, str) or not module:
            problems.append(
                InvalidLeaseOption(
                    f"TASK_MODULES[{i}]",
                    f"must be a dotted module path such as 'shop.jobs', got {module!r}",
                )
            )
            continue
        try:
            found = find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            problems.append(
                InvalidLeaseOption(
                    f"TASK_MODULES[{i}]", f"{module!r} is not a module that can be imported"
                )
            )
    return problems


PER_QUEUE = ("LEASE_SECONDS", "MAX_ATTEMPTS", "RETRY", "TIMEOUT_SECONDS")


def _queue_option_problems(per_queue: Any) -> list[InvalidLeaseOption]:
    if not isinstance(per_queue, dict):
        return [
            InvalidLeaseOption(
                "QUEUE_OPTIONS", f"must be a dict of queue name to options, got {per_queue!r}"
            )
        ]
    problems = []
    for queue, options in per_queue.items():
        name = f"QUEUE_OPTIONS[{queue!r}]"
        if not isinstance(options, dict):
            problems.append(InvalidLeaseOption(name, f"must be a dict, got {options!r}"))
            continue
        for key, value in options.items():
            try:
                if key == "LEASE_SECONDS":
                    validate_lease(value, f"{name}['LEASE_SECONDS']")
                elif key == "MAX_ATTEMPTS":
                    validate_max_attempts(value, f"{name}['MAX_ATTEMPTS']")
                elif key == "RETRY":
                    _validate_retry(value, f"{name}['RETRY']")
                elif key == "TIMEOUT_SECONDS":
                    validate_timeout(value, f"{name}['TIMEOUT_SECONDS']")
                else:
                    raise InvalidLeaseOption(
                        f"{name}[{key!r}]",
                        f"is not a per-queue option; use one of {', '.join(PER_QUEUE)}",
                    )
            except InvalidLeaseOption as e:
                problems.append(e)
    return problems


def check_id_for(problem: InvalidLeaseOption) -> str:
    if problem.option.startswith("QUEUE_OPTIONS"):
        return OPTIONS["QUEUE_OPTIONS"].check_id
    option = OPTIONS.get(problem.option.partition("[")[0])  # RETRY['delays'][1]: RETRY's
    return option.check_id if option else UNKNOWN_OPTION_ID


def queues_served_on(database: str) -> frozenset[str] | None:
    """The queue names the lease backends keeping jobs on ``database`` accept, as Django
    reads ``QUEUES`` (absent: only "default"), or None when any name goes: one of them has
    ``QUEUES: []`` (Django: any queue is allowed), or no lease backend uses that database.
    Read once per settings."""
    try:
        return _queues_cache[database]
    except KeyError:
        queues = _queues_cache[database] = _read_queues(database)
        return queues


def _read_queues(database: str) -> frozenset[str] | None:
    tasks = getattr(settings, "TASKS", {})
    names: set[str] = set()
    found = False
    for alias in lease_backend_aliases():
        params = tasks[alias]
        options = params.get("OPTIONS") or {}
        if (
            options.get("DATABASE", DEFAULT_DB_ALIAS) if isinstance(options, dict) else None
        ) != database:
            continue
        found = True
        queues = params.get("QUEUES", [DEFAULT_TASK_QUEUE_NAME])
        if not queues:
            return None
        names.update(queues)
    return frozenset(names) if found else None


# The backend class, named rather than imported: backends.py imports this module.
LEASE_BACKEND = "django_leases.backends.LeaseBackend"


def lease_backend_aliases() -> list[str]:
    """Aliases in settings.TASKS whose backend is django_leases' LeaseBackend (or a
    subclass of it)."""
    from django.utils.module_loading import import_string

    aliases = []
    for alias, params in getattr(settings, "TASKS", {}).items():
        try:
            cls = import_string(params.get("BACKEND", ""))
        except ImportError:
            continue
        if isinstance(cls, type) and any(
            f"{k.__module__}.{k.__qualname__}" == LEASE_BACKEND for k in cls.__mro__
        ):
            aliases.append(alias)
    return aliases


def first_lease_backend() -> str | None:
    """The alias a command, the advisor or the test helpers serve when given none: the
    first lease backend in settings.TASKS (None if there is none)."""
    aliases = lease_backend_aliases()
    return aliases[0] if aliases else None


def lease_backend(alias: str | None, option: str = "backend") -> str:
    """``alias`` (None: the first lease backend), or InvalidLeaseOption naming ``option``
    when it names no lease backend: a command given another backend's alias would read
    default options, and prune under the default retention."""
    aliases = lease_backend_aliases()
    chosen = alias if alias is not None else (aliases[0] if aliases else None)
    if chosen is None or chosen not in aliases:
        raise InvalidLeaseOption(
            option,
            f"{chosen!r} is not a django_leases backend in settings.TASKS "
            f"(lease backends: {', '.join(aliases) or 'none'})",
        )
    return chosen


def served_queues(alias: str) -> list[str] | None:
    """The queues a worker of backend ``alias`` serves by default: its QUEUES as Django
    reads them (absent: ["default"]), or None (every queue) when it is empty, as Django
    then accepts any queue name."""
    return list(settings.TASKS[alias].get("QUEUES", [DEFAULT_TASK_QUEUE_NAME])) or None


def worker_heartbeat(options: LeaseOptions, lease: float | None) -> float:
    """A worker's renewal period: the smaller of HEARTBEAT_SECONDS and a third of the
    lease it grants (``lease``, else LEASE_SECONDS)."""
    return min(options.heartbeat_seconds, (options.lease_seconds if lease is None else lease) / 3)


_options_cache: dict[str | None, LeaseOptions] = {}
_queues_cache: dict[str, frozenset[str] | None] = {}


def clear_options_cache(**kwargs: Any) -> None:
    """Forget validated options (connected to setting_changed for TASKS in apps.py)."""
    if kwargs.get("setting", "TASKS") == "TASKS":
        _options_cache.clear()
        _queues_cache.clear()


def get_options(alias: str | None = None) -> LeaseOptions:
    """Validated options of the backend ``alias`` (the first lease backend by default),
    validated once per settings."""
    try:
        return _options_cache[alias]
    except KeyError:
        options = _options_cache[alias] = _read_options(alias)
        return options


def _read_options(alias: str | None) -> LeaseOptions:
    tasks = getattr(settings, "TASKS", {})
    if alias is None:
        alias = first_lease_backend()
    if alias is None:
        return LeaseOptions.from_dict({})
    if alias not in tasks:
        raise InvalidLeaseOption("TASKS", f"no task backend named {alias!r}")
    return LeaseOptions.from_dict(tasks[alias].get("OPTIONS", {}))
