"""django.tasks backend: @task functions enqueue as job rows in the caller's transaction."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import UTC
from typing import Any, cast

from django.conf import settings
from django.db import connections
from django.tasks import Task, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TaskError
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued
from django.utils import timezone

from . import conf, registry
from .conf import LeaseOptions
from .enqueue import insert_job_row, insert_job_rows, insert_or_merge_job, migrated
from .enqueue_options import (
    USE_TZ_NEEDED,
    EnqueueOptions,
    JobFields,
    check_task_options,
    checked_arguments,
    checked_priority,
    checked_text,
)
from .exceptions import InvalidJobArgument, InvalidLeaseOption, InvalidTaskArguments
from .fits import task_misfit
from .jsonsafe import MAX_INT, shown
from .states import FailureKind, JobState, LeaseLostPolicy
from .task import LeaseTask, UndeclaredTask

logger = logging.getLogger("django_leases.enqueue")

_STATUS = {
    # Due, waiting for its run_after or retry delay, or parked (available_at NULL) until a
    # person releases it: in every case not running and not finished.
    JobState.PENDING: TaskResultStatus.READY,
    # A claimed job whose lease ran out stays RUNNING until it is claimed again or buried.
    JobState.CLAIMED: TaskResultStatus.RUNNING,
    JobState.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    JobState.DEAD: TaskResultStatus.FAILED,
    # Stopped by an operator: finished without success (errors holds only real failures).
    JobState.CANCELLED: TaskResultStatus.FAILED,
}


def _times_as_django_gives(database: str) -> Callable[[Any], Any]:
    """A function giving a job's database-clock time as Django hands datetimes out.

    With USE_TZ = True (aware, UTC) and on PostgreSQL (whose session Django runs in
    TIME_ZONE) it is the time as read. With USE_TZ = False on SQLite, whose clock is UTC,
    and on MySQL/MariaDB, whose sessions must run in UTC (check E015), a time is read as
    naive UTC: given as TIME_ZONE's naive local time, what USE_TZ = False means
    (ImmediateBackend's timezone.now()). The rows keep UTC: lease arithmetic in local time
    would jump at each daylight-saving change."""
    if settings.USE_TZ or connections[database].vendor not in ("sqlite", "mysql"):
        return _as_read
    zone = timezone.get_default_timezone()

    def local(value: Any) -> Any:
        if value is None or value.tzinfo is not None:
            return value
        return value.replace(tzinfo=UTC).astimezone(zone).replace(tzinfo=None)

    return local


def _as_read(value: Any) -> Any:
    return value


def _exception_path(failure: Any) -> str:
    """A dotted path TaskError.exception_class can import: the recorded class where it
    imports, else its nearest base class that does (a class nested in another), else
    Exception (a class defined inside a function; the recorded path stays in the admin
    and the traceback), or the recorded path where its module is not loaded in this
    process (storable.readable_class_path()); an expired claim reads as LeaseLost, a
    failure without a class as Exception."""
    from .storable import readable_class_path

    if failure.exception_class_path:
        return readable_class_path(failure.exception_class_path)
    if failure.kind == FailureKind.LEASE_EXPIRED:
        return "django_leases.exceptions.LeaseLost"
    return "builtins.Exception"


# The app registry's configs when the app was last found installed: while the registry
# holds the same dict (override_settings(INSTALLED_APPS) swaps it), it still is.
_installed_in: list[Any] = [None]


def _job_model(alias: str) -> Any:
    """The Job model; ImproperlyConfigured saying what to add when the app is not installed
    (importing the model would fail with a RuntimeError about its app_label)."""
    from django.apps import apps
    from django.core.exceptions import ImproperlyConfigured

    if apps.app_configs is _installed_in[0]:
        from .models import Job

        return Job
    if not apps.is_installed("django_leases"):
        raise ImproperlyConfigured(
            f"TASKS[{alias!r}] uses django_leases.backends.LeaseBackend: add 'django_leases' to "
            "INSTALLED_APPS, then run `python manage.py migrate` (check id django_leases.E017)."
        )
    from .models import Job

    _installed_in[0] = apps.app_configs
    return Job


def _check_fits(task: Any, args: list[Any], kwargs: dict[str, Any], path: str = "") -> None:
    """Refuse arguments ``task``'s function cannot take (InvalidJobArgument naming
    ``args/kwargs``), as the worker would refuse the row: a job that can never run."""
    if (why := task_misfit(task, args, kwargs)) is not None:
        raise InvalidJobArgument(f"{path}args/kwargs", why)


def _as_enqueued(task: Any, job: Any) -> Any:
    """``task`` with the queue, priority and run_after its job was enqueued with."""
    if (task.queue_name, task.priority, task.run_after) == (
        job.queue_name,
        job.priority,
        job.run_after,
    ):
        return task
    # Not replace(): a Task made anew is validated and declared, and this copy describes
    # one job, not what the backend runs.
    return registry.copied_task(
        task, queue_name=job.queue_name, priority=job.priority, run_after=job.run_after
    )


def _check_compared_fields(task: Any) -> None:
    """Django's validate_task compares ``priority`` with numbers, asks ``run_after`` for
    its offset and looks ``queue_name`` up in a set, so a value of another type escaped it
    as TypeError or AttributeError (``using(priority="5")``,
    ``using(run_after=timedelta(...))``, ``using(queue_name=["x"])``): InvalidTask, naming
    the field, as check_task_options() says it of a value out of range."""
    from datetime import datetime

    try:
        checked_text("queue_name", task.queue_name, 100)
        checked_priority(task.priority)
        if task.run_after is not None and not isinstance(task.run_after, datetime):
            raise InvalidLeaseOption(
                "run_after", f"must be an aware datetime or None, got {shown(task.run_after)}"
            )
    except InvalidLeaseOption as e:
        raise InvalidTask(f"{task.module_path}: {e}") from e


def _check_schedule_option(task: Any) -> None:
    """A task's ``schedule`` must be a Periodic or a list of them (each checked when made),
    each making a call the task's function takes."""
    from .schedules import Periodic, call_misfit

    option = getattr(task, "schedule", None)
    if option is None:
        return
    items = option if isinstance(option, list | tuple) else [option]
    if not items or not all(isinstance(p, Periodic) for p in items):
        raise InvalidTask(
            f"{task.module_path}: schedule must be a django_leases.schedules.Periodic or a "
            f"list of them, got {option!r}"
        )
    for p in items:
        if (why := call_misfit(task, p)) is not None:
            raise InvalidTask(f"{task.module_path}: schedule args/kwargs {why}")


class LeaseBackend(BaseTaskBackend):
    """Stores tasks as jobs claimed under leases by ``manage.py run_lease_worker``."""

    supports_async_task = True
    supports_get_result = True
    supports_priority = True
    task_class = LeaseTask

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        # What each task's jobs get, checked once per task (see _job_fields).
        self._checked_tasks: dict[Any, JobFields] = {}

    @property
    def supports_defer(self) -> bool:  # type: ignore[override]  # Django's: a class attribute
        """run_after is taken only with USE_TZ = True: a naive datetime names no instant
        to compare with the database clock (check W003)."""
        return bool(settings.USE_TZ)

    @property
    def lease_options(self) -> LeaseOptions:
        """This backend's validated OPTIONS, read where every other reader gets them."""
        return conf.get_options(self.alias)

    @property
    def database(self) -> str:
        return cast(str, self.options.get("DATABASE", "default"))

    def validate_task(self, task: Any) -> None:
        _check_compared_fields(task)
        if task.run_after is not None and not self.supports_defer:
            # Before Django's own "does not support run_after": this one says why.
            raise InvalidTask(f"{task.module_path}: run_after: {USE_TZ_NEEDED}")
        if self.queues and task.queue_name not in self.queues:
            # Before Django's own "Queue ... is not valid for backend.": this one names the
            # task, the setting to change and what it holds.
            raise InvalidTask(
                f"{task.module_path}: Queue {task.queue_name!r} is not valid for backend "
                f"{self.alias!r}: queue_name must be one of TASKS[{self.alias!r}]['QUEUES'] "
                f"({', '.join(sorted(map(repr, self.queues)))}); add it there, and start a "
                f"worker that serves it"
            )
        super().validate_task(task)
        try:
            check_task_options(task)
        except InvalidLeaseOption as e:
            raise InvalidTask(f"{task.module_path}: {e}") from e
        _check_schedule_option(task)
        registry.declare(self.alias, task)

    def job_fields(self, task: Any) -> JobFields:
        """What a job of ``task`` gets, checked: what the scheduled ticks enqueue with."""
        return self._job_fields(task)

    def job_options(self, task: Any) -> tuple[float, int]:
        """Lease and max attempts for ``task``'s jobs: the task's, else its queue's, else the
        backend's."""
        lease, attempts = self.lease_options.for_queue(task.queue_name)
        return (
            getattr(task, "lease", None) or lease,
            getattr(task, "max_attempts", None) or attempts,
        )

    def enqueue[**P, R](self, task: Task[P, R], args: Any, kwargs: Any) -> TaskResult[P, R]:
        Job = _job_model(self.alias)
        try:
            fields = self._job_fields(task)
            # As Django's TaskResult normalizes them (django.utils.json.normalize_json).
            args, kwargs = checked_arguments(args, kwargs, as_django_stores=True)
            _check_fits(task, args, kwargs)
            if fields.on_duplicate == "merge" and fields.unique_key is not None:
                job, merged = insert_or_merge_job(Job, self.database, fields, args, kwargs)
                row = job.pk, job.enqueued_at, job.args, job.kwargs
            else:
                row, merged = insert_job_row(Job, self.database, fields, args, kwargs), False
        except InvalidJobArgument as e:
            raise InvalidTaskArguments(f"Cannot enqueue {task.module_path}: {e}") from e
        except InvalidLeaseOption as e:
            raise InvalidTask(f"Cannot enqueue {task.module_path}: {e}") from e
        if merged:
            # Nothing was enqueued: the job holding the key, as it stands (running, say,
            # and of another task if that one holds the key), and no task_enqueued.
            holder = task if job.task_path == task.module_path else self._task_of(job)
            return cast("TaskResult[P, R]", self._to_result(job, holder))
        result = self._enqueued_result(task, fields.priority, *row)
        self._send_enqueued([result])
        return result

    def enqueue_many(self, task: Any, calls: Any) -> list[TaskResult[..., Any]]:
        """Enqueue one job per ``(args, kwargs)`` pair in bulk INSERTs (all or nothing)."""
        Job = _job_model(self.alias)

        if getattr(task, "unique_key", None) is not None:
            self.validate_task(task)
            raise InvalidTask(f"Cannot enqueue {task.module_path} in bulk with a unique_key")
        try:
            fields = self._job_fields(task)
            rows = insert_job_rows(
                Job,
                self.database,
                fields,
                calls,
                batch_size=1000,
                fits=lambda args, kwargs, path: _check_fits(task, args, kwargs, path),
            )
        except InvalidJobArgument as e:
            raise InvalidTaskArguments(f"Cannot enqueue {task.module_path}: {e}") from e
        except InvalidLeaseOption as e:
            raise InvalidTask(f"Cannot enqueue {task.module_path}: {e}") from e
        results: list[TaskResult[..., Any]] = [
            self._enqueued_result(task, fields.priority, *row) for row in rows
        ]
        self._send_enqueued(results)
        return results

    def _send_enqueued(self, results: list[TaskResult[..., Any]]) -> None:
        """Send task_enqueued for each result, to every receiver. In the caller's
        transaction a receiver's error is raised once all are sent, as Django's backends
        do: the caller's rollback takes the jobs with it (and a receiver's failed query
        has left the transaction unusable on PostgreSQL). Outside one the rows are already
        committed, so the error is logged and the call returns: a call that raises must
        have written nothing, and the caller learns the ids."""
        errors: list[Exception] = []
        for result in results:
            for receiver, response in task_enqueued.send_robust(type(self), task_result=result):
                if isinstance(response, Exception):
                    errors.append(response)
                    logger.error(
                        "Receiver %r of task_enqueued raised for job=%s",
                        receiver,
                        result.id,
                        exc_info=response,
                        extra={"event": "receiver_raised", "job_id": result.id},
                    )
        if errors and connections[self.database].in_atomic_block:
            raise errors[0]

    def _job_fields(self, task: Any) -> JobFields:
        """What a job of ``task`` gets (the task's options, else its queue's, else the
        backend's), checked, after validate_task(). Tasks are frozen, so both are done once
        per task and backend; a task that cannot be hashed (a list as retry) is checked on
        every enqueue."""
        try:
            return self._checked_tasks[task]
        except (KeyError, TypeError):
            pass
        self.validate_task(task)
        self._check_discovered(task)
        fields = self._job_options(task).check(task.module_path)
        try:
            if len(self._checked_tasks) >= 1024:  # tasks made per call, e.g. using(run_after=...)
                self._checked_tasks.clear()
            self._checked_tasks[task] = fields
        except TypeError:
            pass
        return fields

    def _check_discovered(self, task: Any) -> None:
        """Refuse a task declared in a module no worker imports: its jobs could only be
        dead-lettered as UnknownTask. Discovery runs first, so the answer is the worker's
        whichever modules this process imported before."""
        if not registry.is_discovered(task):
            registry.discover()
        if not registry.is_discovered(task):
            module = task.func.__module__
            raise InvalidTask(
                f"Cannot enqueue {task.module_path}: workers never import {module!r}, so they "
                f"would not know this task. Declare it in an installed app's tasks module (or "
                f"import it there), or add {module!r} to TASKS[{self.alias!r}]['OPTIONS']['TASK_MODULES']."
            )

    def _job_options(self, task: Any) -> EnqueueOptions:
        lease, max_attempts = self.job_options(task)
        options = self.lease_options
        return EnqueueOptions(
            queue_name=task.queue_name,
            priority=task.priority,
            run_after=task.run_after,
            lease_seconds=lease,
            max_attempts=max_attempts,
            retry=getattr(task, "retry", None) or options.retry_for_queue(task.queue_name),
            on_lease_lost=getattr(task, "on_lease_lost", LeaseLostPolicy.RETRY),
            # The backend's MAX_AGE_DAYS only where the task sets neither.
            deadline=getattr(task, "deadline", None),
            max_age=(
                options.max_age_days * 86400
                if getattr(task, "max_age", None) is None
                and getattr(task, "deadline", None) is None
                else getattr(task, "max_age", None)
            ),
            unique_key=getattr(task, "unique_key", None),
            on_duplicate=getattr(task, "on_duplicate", "refuse"),
        )

    def get_result(self, result_id: Any) -> TaskResult[..., Any]:
        pk = _job_id(result_id)
        if pk is None:
            raise TaskResultDoesNotExist(result_id)
        results = self._results_of([pk])
        if not results:
            raise TaskResultDoesNotExist(result_id)
        return results[0]

    def get_results(self, result_ids: Iterable[Any]) -> dict[str, TaskResult[..., Any]]:
        """TaskResults of the jobs ``result_ids`` names (two statements however many), by
        TaskResult id; an id that names no job (as get_result() reads ids) is left out. A
        job naming a task this project does not declare reads with an UndeclaredTask
        stand-in."""
        if isinstance(result_ids, str | bytes) or not isinstance(result_ids, Iterable):
            raise TypeError(
                f"result_ids must be an iterable of result ids, got {shown(result_ids)}"
            )
        pks = {pk for pk in map(_job_id, result_ids) if pk is not None}
        return {result.id: result for result in self._results_of(sorted(pks))}

    def _results_of(self, pks: list[int]) -> list[TaskResult[..., Any]]:
        Job = _job_model(self.alias)
        with migrated(Job, self.database):
            jobs = Job.objects.using(self.database).with_failures(pks)
        return [self._to_result(job, self._task_of(job)) for job in jobs]

    def results_of_claims(self, jobs: list[Any]) -> dict[Any, TaskResult[..., Any]]:
        """TaskResults of the rows a claim just returned (ClaimedJob), built from them: only
        jobs claimed before (a retry, a takeover, a requeue) have failures to read, in one
        statement for all of them."""
        # A first claim stamps started_at and last_attempted_at in one statement.
        seen_before = [j.pk for j in jobs if j.started_at != j.last_attempted_at]
        failures: dict[Any, list[Any]] = {pk: [] for pk in seen_before}
        if seen_before:
            JobFailure = _job_model(self.alias)._meta.get_field("failures").related_model
            for failure in JobFailure.objects.using(jobs[0].database).filter(
                job_id__in=seen_before
            ):
                failures[failure.job_id].append(failure)
        return {j.pk: self._to_result(j, self._task_of(j), failures.get(j.pk, [])) for j in jobs}

    def _task_of(self, job: Any) -> Any:
        """The task ``job`` names, found where a worker finds it (each app's tasks module
        and TASK_MODULES, never the row's own path); an UndeclaredTask stand-in when the
        project declares no such task, so the result can still be read."""
        task = registry.runnable(self.alias, job.task_path, job.queue_name)
        if task is None:
            registry.discover()
            task = registry.runnable(self.alias, job.task_path, job.queue_name)
        if task is None:
            return UndeclaredTask(
                path=job.task_path,
                backend=self.alias,
                queue_name=job.queue_name,
                priority=job.priority,
                run_after=job.run_after,
            )
        return task

    def _enqueued_result[**P, R](
        self,
        task: Task[P, R],
        priority: int,
        pk: Any,
        enqueued_at: Any,
        args: list[Any],
        kwargs: dict[str, Any],
    ) -> TaskResult[P, R]:
        """The TaskResult of a job just inserted: READY, not started, no errors; its task
        (with the ``priority`` stored) and arguments as get_result() will read them back."""
        if type(task.priority) is not int:  # 5.0 or Decimal(5), stored as 5
            task = cast("Task[P, R]", registry.copied_task(task, priority=priority))
        return TaskResult(
            task=task,
            id=str(pk),
            status=TaskResultStatus.READY,
            enqueued_at=_times_as_django_gives(self.database)(enqueued_at),
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )

    def _to_result(
        self, job: Any, task: Any, failures: list[Any] | None = None
    ) -> TaskResult[..., Any]:
        if failures is None:
            # A requeued job has its attempts back at 0, and its failures still.
            claimed_before = job.attempts or job.started_at is not None
            failures = list(job.failures.all()) if job.pk and claimed_before else []
        when = _times_as_django_gives(self.database)
        worker_ids = [f.worker_id for f in failures]
        # The current or last claim is one more attempt unless it failed: each failure
        # carries the fence of its claim, and each claim has a fence of its own.
        if job.attempts and job.claimed_by and all(f.fence != job.fence for f in failures):
            worker_ids.append(job.claimed_by)
        result: TaskResult[..., Any] = TaskResult(
            task=_as_enqueued(task, job),
            id=str(job.pk),
            status=_STATUS[JobState(job.state)],
            enqueued_at=when(job.enqueued_at),
            started_at=when(job.started_at),
            finished_at=when(job.finished_at),
            last_attempted_at=when(job.last_attempted_at),
            args=job.args,
            kwargs=job.kwargs,
            backend=self.alias,
            errors=[
                TaskError(
                    exception_class_path=_exception_path(f), traceback=f.traceback or f.message
                )
                for f in failures
            ],
            worker_ids=worker_ids,
        )
        if job.state == JobState.SUCCEEDED:
            object.__setattr__(result, "_return_value", job.result)
        return result

    def check(self, **kwargs: Any) -> list[Any]:
        from .checks import check_backend, check_task_modules

        messages = check_backend(self.alias, self.options)
        if not any(m.is_serious() for m in messages):  # warnings only (W001, W002)
            messages.extend(check_task_modules(self.alias))
        return messages


# A job's primary key is a BigAutoField: its ids are 1 .. 2**63 - 1 on every database.
_LARGEST_JOB_ID = MAX_INT


def _job_id(result_id: Any) -> int | None:
    """The job a TaskResult id names: the id as this backend hands it out (``str(pk)``),
    or the int itself. Anything else (``" 2 "``, ``"+2"``, ``"02"``, other scripts'
    digits, an id past what a job's key can hold, which the driver would refuse) names
    no job: a polling view that passes a user's text on gets TaskResultDoesNotExist."""
    if isinstance(result_id, int) and not isinstance(result_id, bool):
        pk = result_id
    elif isinstance(result_id, str) and result_id.isascii() and result_id.isdigit():
        if len(result_id) > len(str(_LARGEST_JOB_ID)) or str(int(result_id)) != result_id:
            return None
        pk = int(result_id)
    else:
        return None
    return pk if 0 < pk <= _LARGEST_JOB_ID else None
