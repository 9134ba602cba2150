"""System checks for lease backends; one id per problem, listed in docs/reference.md."""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.db import connections

from .conf import (
    LeaseOptions,
    check_id_for,
    get_options,
    lease_backend_aliases,
    served_queues,
    validate_options,
)
from .exceptions import InvalidLeaseOption


def check_backend(alias: str, options: Any) -> list[checks.CheckMessage]:
    """Problems with TASKS[alias]: the app, its OPTIONS and the database they point at."""
    from django.apps import apps

    if not apps.is_installed("django_leases"):
        # The app's ready() never runs then, so this comes through the backend's check().
        return [
            checks.Error(
                f"TASKS[{alias!r}] uses django_leases.backends.LeaseBackend, but 'django_leases' "
                "is not in INSTALLED_APPS: there is no job table to enqueue into and no "
                "run_lease_worker command.",
                hint="Add 'django_leases' to INSTALLED_APPS, then run `python manage.py migrate`.",
                obj=f"TASKS[{alias!r}]",
                id="django_leases.E017",
            )
        ]
    messages: list[checks.CheckMessage] = [
        checks.Error(
            f"{_option_path(alias, problem.option)} {problem.reason}",
            obj=f"TASKS[{alias!r}]",
            id=check_id_for(problem),
        )
        for problem in validate_options(options)
    ]
    messages.extend(_queue_messages(alias, options))
    messages.extend(_schedule_messages(alias, options))
    time_zone = _time_zone_messages(alias)  # beside any other message, never in their stead
    if any(m.id == "django_leases.E010" for m in messages):
        return messages + time_zone
    if not messages:
        mine = LeaseOptions.from_dict(options)
        messages.extend(_shared_retention_messages(alias, mine))
        messages.extend(_shared_queue_messages(alias, mine))
        messages.extend(_shared_schedule_messages(alias, mine, options.get("SCHEDULES") or {}))
    messages.extend(time_zone)
    database = options.get("DATABASE", "default") if isinstance(options, dict) else "default"
    messages.extend(check_database(alias, database))
    return messages


def _option_path(alias: str, option: str) -> str:
    """Where ``option`` (a name, or a path such as ``QUEUE_OPTIONS['q']['RETRY']``) is in
    the settings, as Python would index it."""
    where = f"TASKS[{alias!r}]['OPTIONS']"
    if option == "OPTIONS":
        return where
    name, bracket, rest = option.partition("[")
    return f"{where}[{name!r}]{bracket}{rest}"


def _queue_messages(alias: str, options: Any) -> list[checks.CheckMessage]:
    """QUEUES (Django's own key) must list queue names, as enqueue() checks a queue_name:
    Django reads a string as its letters, and a worker cannot serve a name that is no
    text. Per-queue options for a queue QUEUES does not list apply to no job."""
    import difflib

    from django.conf import settings

    from .enqueue_options import checked_text

    # Absent, Django's QUEUES is ["default"]: only that queue takes this backend's jobs.
    given = "QUEUES" in settings.TASKS.get(alias, {})
    queues = settings.TASKS.get(alias, {}).get("QUEUES", ["default"])
    problem = None
    if not isinstance(queues, list | tuple | set | frozenset):
        problem = f" must be a list of queue names, got {queues!r}"
    else:
        for i, queue in enumerate(queues):
            try:
                checked_text("queue", queue, 100)
            except InvalidLeaseOption as e:
                where = f"[{i}]" if isinstance(queues, list | tuple) else f" item {queue!r}"
                problem = f"{where}: a queue name {e.reason}"
                break
    if problem is not None:
        return [
            checks.Error(
                f"TASKS[{alias!r}]['QUEUES']{problem}",
                hint="List the queue names the backend takes, e.g. ['default', 'emails'] "
                "(an empty list: any name).",
                obj=f"TASKS[{alias!r}]",
                id="django_leases.E022",
            )
        ]
    per_queue = options.get("QUEUE_OPTIONS") if isinstance(options, dict) else None
    if not queues or not isinstance(per_queue, dict):
        return []
    messages: list[checks.CheckMessage] = []
    for queue in per_queue:
        if queue in queues:
            continue
        close = difflib.get_close_matches(str(queue), [str(q) for q in queues], n=1)
        messages.append(
            checks.Warning(
                f"TASKS[{alias!r}]['OPTIONS']['QUEUE_OPTIONS'][{queue!r}] is for a queue "
                + (
                    f"TASKS[{alias!r}]['QUEUES'] does not list"
                    if given
                    else "other than 'default', the only queue of a backend without QUEUES"
                )
                + ": no job of this backend is in it, so these options apply to none.",
                hint=f"Did you mean {close[0]!r}?"
                if close
                else "Add the queue to QUEUES."
                if given
                else "Set QUEUES to the queues it takes.",
                obj=f"TASKS[{alias!r}]",
                id="django_leases.W004",
            )
        )
    return messages


def _schedule_messages(alias: str, options: Any) -> list[checks.CheckMessage]:
    """The backend's schedules, declared by its tasks (``@task(schedule=...)``) and in
    OPTIONS["SCHEDULES"], must read as schedules, each naming a task declared for the
    backend (after discovery), with no name declared twice, and USE_TZ on."""
    from . import registry
    from .exceptions import InvalidSchedule
    from .schedules import declared_schedules, listed_schedules

    if not isinstance(options, dict):
        return []
    try:
        registry.discover()
    except Exception:  # a broken tasks module: E016 or E023 says so
        return []
    listed = options.get("SCHEDULES") or {}
    try:
        declared_schedules(alias, listed)
    except InvalidSchedule as e:
        found = [str(e)]
        # Each entry on its own too (without the tasks' own schedules, whose error would
        # stand for every entry): a project with several broken ones learns of them all at
        # once, not one per run of check.
        for name, entry in listed.items() if isinstance(listed, dict) else ():
            try:
                listed_schedules(alias, {name: entry})
            except InvalidSchedule as each:
                if str(each) not in found:
                    found.append(str(each))
        where = "['OPTIONS']['SCHEDULES']" if listed else " (its tasks' schedules)"
        return [
            checks.Error(
                f"TASKS[{alias!r}]{where}: {message}",
                obj=f"TASKS[{alias!r}]",
                id="django_leases.E020",
            )
            for message in found
        ]
    return []


def _time_zone_messages(alias: str) -> list[checks.CheckMessage]:
    """With USE_TZ = False a job can still be enqueued and run, but no time a caller gives
    (run_after, deadline) is taken: say so before an enqueue refuses one."""
    from django.conf import settings

    from .enqueue_options import USE_TZ_NEEDED

    if settings.USE_TZ:
        return []
    return [
        checks.Warning(
            f"TASKS[{alias!r}]: run_after and deadline each {USE_TZ_NEEDED}; an enqueue "
            "given either raises InvalidTask.",
            hint="Set USE_TZ = True (Django's default).",
            obj=f"TASKS[{alias!r}]",
            id="django_leases.W003",
        )
    ]


def _same_database(alias: str, mine: LeaseOptions) -> list[tuple[str, LeaseOptions]]:
    """The other lease backends whose jobs are in ``alias``'s database, with their options
    (one whose OPTIONS do not read is left to its own check)."""
    found = []
    for other in lease_backend_aliases():
        if other == alias:
            continue
        try:
            theirs = get_options(other)
        except InvalidLeaseOption:
            continue  # its own check reports it
        if theirs.database == mine.database:
            found.append((other, theirs))
    return found


def _shared_retention_messages(alias: str, mine: LeaseOptions) -> list[checks.CheckMessage]:
    """A job records no backend, so `leases_prune --backend X` deletes every finished job
    of X's database past X's RETENTION_DAYS: a backend sharing that database with one of a
    shorter retention keeps its jobs only as long as that one's."""
    shorter = [
        f"TASKS[{other!r}] ({theirs.retention_days:g} days)"
        for other, theirs in _same_database(alias, mine)
        if theirs.retention_days < mine.retention_days
    ]
    if not shorter:
        return []
    return [
        checks.Warning(
            f"TASKS[{alias!r}] keeps finished jobs {mine.retention_days:g} days "
            f"(RETENTION_DAYS), but its database {mine.database!r} also holds the jobs of "
            f"{', '.join(shorter)}. A job records no backend: `leases_prune` for a backend "
            "deletes every finished job of its database past that backend's retention.",
            hint="Give the backends that share a database the same RETENTION_DAYS, or run "
            "leases_prune only for the one with the longest.",
            obj=f"TASKS[{alias!r}]",
            id="django_leases.W002",
        )
    ]


def _shared_queue_messages(alias: str, mine: LeaseOptions) -> list[checks.CheckMessage]:
    """A job records its queue, not its backend: two backends of one database that take
    the same queue run each other's jobs (a worker of either claims them), whatever
    options or task modules each was meant to have."""
    from django.conf import settings

    ours = served_queues(alias)
    shared = []
    for other, _ in _same_database(alias, mine):
        if not isinstance(settings.TASKS[other].get("QUEUES", []), list | tuple | set):
            continue  # a QUEUES that is no list of names: its own E022 reports it
        their_queues = served_queues(other)
        if ours is None or their_queues is None:
            both = their_queues if ours is None else ours
            said = "every queue" if both is None else ", ".join(map(repr, both))
        else:
            said = ", ".join(repr(q) for q in ours if q in their_queues)
        if said:
            shared.append(f"TASKS[{other!r}] ({said})")
    if not shared:
        return []
    return [
        checks.Warning(
            f"TASKS[{alias!r}] takes queues that {', '.join(shared)} "
            f"{'takes' if len(shared) == 1 else 'take'} too, in the same database "
            f"{mine.database!r}: a job records its queue, not its backend, so the workers "
            "of each run the other's jobs of those queues.",
            hint="Give each backend its own QUEUES (an empty list takes every queue), or "
            "its own OPTIONS['DATABASE']; silence django_leases.W005 if they are meant to "
            "share their jobs.",
            obj=f"TASKS[{alias!r}]",
            id="django_leases.W005",
        )
    ]


def _shared_schedule_messages(
    alias: str, mine: LeaseOptions, listed: Any
) -> list[checks.CheckMessage]:
    """A schedule is one row per name in its database, owned by one backend: two backends
    of one database declaring the same name (the task's path, unless a Periodic names it)
    take the row from each other at every worker start, and only the last one's ticks."""
    from .schedules import declared_names

    names = declared_names(alias, listed)
    if not names:
        return []
    clashes = []
    for other, _ in _same_database(alias, mine):
        shared = sorted(names & declared_names(other))
        if shared:
            clashes.append(f"TASKS[{other!r}] ({', '.join(map(repr, shared))})")
    if not clashes:
        return []
    return [
        checks.Error(
            f"TASKS[{alias!r}] declares schedules of the names that {', '.join(clashes)} "
            f"{'declares' if len(clashes) == 1 else 'declare'} too, in the same database {mine.database!r}: a schedule's name is "
            "its row, and each backend's workers would take it over at their start.",
            hint="Give one of each pair its own name (Periodic(..., name=...) or another "
            "SCHEDULES key), or declare the schedule for one backend only.",
            obj=f"TASKS[{alias!r}]",
            id="django_leases.E021",
        )
    ]


def _discovery_failed(alias: str, error: Exception) -> list[checks.CheckMessage]:
    """A module discovery imports raised: a worker cannot start, and enqueue() raises the
    same error. A TASK_MODULES entry that cannot be found is E016's to report instead.
    Every lease backend reports it: discovery imports the modules of them all."""
    from . import registry
    from .conf import _task_module_problems
    from .storable import first_line

    try:
        hidden = bool(_task_module_problems(registry.task_modules()))
    except Exception:  # noqa: BLE001 -- find_spec() runs a package's __init__, which may raise
        hidden = False
    if hidden:
        return []
    return [
        checks.Error(
            f"TASKS[{alias!r}]: importing the modules that declare tasks (each installed "
            f"app's tasks module or package, and TASK_MODULES) raised "
            f"{type(error).__name__}: {first_line(error).rstrip('.')}. No worker can start.",
            hint="Fix what the error names (a task's option, a queue missing from QUEUES), "
            "or move the module out of the tasks package if it holds no task.",
            obj=f"TASKS[{alias!r}]",
            id="django_leases.E023",
        )
    ]


def check_task_modules(alias: str) -> list[checks.CheckMessage]:
    """@tasks of backend ``alias`` declared (imported so far, after discovery) that a
    worker's discovery does not declare: enqueue() refuses them, and a worker would not
    know them. Not those of test modules: ``manage.py test`` imports them before it runs
    the checks, and an error stopped the whole run over a task a test declared for itself
    (one it runs under ImmediateBackend, say)."""
    from . import registry

    try:
        registry.discover()
    except Exception as e:  # noqa: BLE001 -- whatever a tasks module raises at import
        return _discovery_failed(alias, e)
    stray = [
        task
        for task in registry.declared_tasks(alias)
        if not registry.is_discovered(task) and not registry.is_test_module(task.func.__module__)
    ]
    modules = sorted({task.func.__module__ for task in stray})
    if not stray:
        return []
    return [
        checks.Error(
            f"TASKS[{alias!r}] has tasks declared in modules no worker imports: "
            f"{', '.join(task.module_path for task in stray)}. enqueue() refuses them.",
            hint=f"Move them into (or import them from) an installed app's tasks module, or add "
            f"{', '.join(map(repr, modules))} to TASKS[{alias!r}]['OPTIONS']['TASK_MODULES'].",
            obj=f"TASKS[{alias!r}]",
            id="django_leases.E018",
        )
    ]


def check_database(alias: str, database: str) -> list[checks.CheckMessage]:
    connection = connections[database]
    if connection.vendor == "sqlite":
        mode = connection.settings_dict.get("OPTIONS", {}).get("transaction_mode")
        if str(mode).upper() != "IMMEDIATE":
            return [
                checks.Warning(
                    f"TASKS[{alias!r}] keeps jobs in SQLite database {database!r} without "
                    "DATABASES[...]['OPTIONS']['transaction_mode'] = 'IMMEDIATE'.",
                    hint="Several worker processes then fail with 'database is locked' instead "
                    "of waiting; also set 'timeout' (e.g. 20) and WAL journal mode.",
                    obj=f"TASKS[{alias!r}]",
                    id="django_leases.W001",
                )
            ]
        return []
    messages: list[checks.CheckMessage] = []
    options = connection.settings_dict.get("OPTIONS", {})
    isolation = str(options.get("isolation_level") or "")
    # Given but empty, Django sets none: the server's own, REPEATABLE READ by default.
    if connection.vendor == "mysql" and (
        isolation.lower() == "repeatable read" or ("isolation_level" in options and not isolation)
    ):
        messages.append(
            checks.Warning(
                f"TASKS[{alias!r}] keeps jobs in MySQL/MariaDB database {database!r} with "
                f"DATABASES[{database!r}]['OPTIONS']['isolation_level'] = "
                f"{options.get('isolation_level')!r}.",
                hint="Inside such a transaction a plain read sees the jobs of when it began: "
                "enqueue with a unique_key another transaction took since then takes a "
                "locking read (held to the commit) to find the job holding it. Leave "
                "isolation_level out (Django's 'read committed') for the jobs' database.",
                obj=f"TASKS[{alias!r}]",
                id="django_leases.W006",
            )
        )
    if not connection.features.has_select_for_update_skip_locked:
        messages.append(
            checks.Error(
                f"TASKS[{alias!r}]['OPTIONS']['DATABASE'] is {database!r}, a "
                f"{connection.display_name} database without SELECT ... FOR UPDATE SKIP LOCKED.",
                hint="Use PostgreSQL, MySQL, MariaDB or SQLite for the job table.",
                obj=f"TASKS[{alias!r}]",
                id="django_leases.E004",
            )
        )
    return messages


def session_clock_offset(database: str) -> float:
    """Seconds between the database's Now() and UTC, as this connection sees them.

    Django writes datetimes to MySQL/MariaDB as UTC (USE_TZ), while Now() there is
    CURRENT_TIMESTAMP in the session's time zone: any offset moves every lease, delay and
    deadline by that much. PostgreSQL and SQLite store instants, so their offset is 0.
    """
    connection = connections[database]
    if connection.vendor != "mysql":
        return 0.0
    with connection.cursor() as cursor:
        cursor.execute("SELECT TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), NOW(6))")
        offset: float = cursor.fetchone()[0] / 1e6
        return offset


def utc_session_problem(database: str) -> str | None:
    """Why lease arithmetic on ``database`` would be off, or None."""
    from django.conf import settings

    offset = session_clock_offset(database)
    if abs(offset) < 1:
        return None
    why = (
        "there disagrees with the UTC times Django writes by that much: leases, delays "
        "and deadlines would all be off"
        if settings.USE_TZ
        # USE_TZ = False: NOW() in local time jumps at each daylight-saving change (every
        # lease at once at the spring one), and the job times read back as TIME_ZONE's are
        # converted from UTC, the clock of the other databases (backends.py).
        else "there is the session's local time: a daylight-saving change would move every "
        "lease by an hour at once, and the job times Django reads would be off"
    )
    return (
        f"database {database!r} runs its sessions {offset / 3600:+g} h from UTC, so Now() "
        f'{why}. Add "init_command": "SET time_zone = \'+00:00\'" to '
        f"DATABASES[{database!r}]['OPTIONS']."
    )


@checks.register(checks.Tags.database)
def check_session_clocks(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Run by ``check --database`` and migrate: a query, so only with database checks."""
    from .conf import get_options, lease_backend_aliases

    messages: list[checks.CheckMessage] = []
    seen: set[str] = set()
    for alias in lease_backend_aliases():
        try:
            database = get_options(alias).database
        except Exception:  # noqa: BLE001 -- reported by the backend's own check
            continue
        if databases and database in databases and database not in seen:
            seen.add(database)  # one error per database, however many backends use it
            problem = utc_session_problem(database)
            if problem:
                messages.append(
                    checks.Error(problem, obj=f"TASKS[{alias!r}]", id="django_leases.E015")
                )
    return messages
