"""The backend's task class: django.tasks' Task plus per-task lease options.

On Django 6.1+ ``@task(lease=120, max_attempts=10, retry=[10, 60])`` reaches these fields;
Django 6.0's decorator passes no extra arguments, so there the options come from
``OPTIONS["QUEUE_OPTIONS"]`` per queue, or from ``my_task.using_lease(...)`` on both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from django.tasks import Task, TaskContext
from django.tasks.exceptions import InvalidTask

if TYPE_CHECKING:
    from .api import JobHandle
    from .backends import LeaseBackend

    # Generic in django-stubs, plain classes at run time.
    _TaskBase = Task[..., Any]
    _TaskContextBase = TaskContext[..., Any]
else:
    _TaskBase = Task
    _TaskContextBase = TaskContext


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseTask(_TaskBase):
    # Seconds a claim of this task's jobs stays valid without renewal (None: queue/backend).
    lease: float | None = None
    # Claims a job may use before it is dead-lettered (None: queue/backend default).
    max_attempts: int | None = None
    # Retry ladder for ordinary failures: a Retry, a list of delays or a dict (None: default).
    # Left out of the hash (a list or dict has none), as schedule and non_retryable are: a
    # task stays usable as a dict key or in a set, as Django's Task is.
    retry: Any = field(default=None, hash=False)
    # What an expired claim means for this task's jobs: "retry", "dead" or "park".
    on_lease_lost: str = "retry"
    # Exception classes that dead-letter the job at once instead of retrying it.
    non_retryable: tuple[type[BaseException], ...] = field(default=(), hash=False)
    # At most one pending or claimed job per key; a second enqueue raises DuplicateJob
    # ("refuse"), or answers the job that holds the key ("merge").
    unique_key: str | None = None
    on_duplicate: str = "refuse"
    # When a job that has not run by then is dead-lettered instead: an absolute deadline
    # (the caller's aware datetime), or max_age seconds after the job is due (Now() + delay,
    # or the later of run_after and Now()) on the database clock
    # (None for both: the backend's MAX_AGE_DAYS).
    deadline: datetime | None = None
    max_age: float | None = None
    # Seconds a handler of this task may run before the worker stops it and fails the
    # attempt (None: the queue's or backend's TIMEOUT_SECONDS). Read by the worker from the
    # task as declared, as non_retryable is: changed by a deploy, not per job.
    timeout: float | None = None
    # Run by itself: a schedules.Periodic (or a list of them), enqueued by the workers, each
    # tick exactly once (docs/periodic.md).
    schedule: Any = field(default=None, hash=False)

    def enqueue_many(self, calls: Any) -> list[Any]:
        """Enqueue one job per ``(args, kwargs)`` pair in bulk INSERTs, in the caller's
        transaction; nothing is written if any call's arguments are refused."""
        # A LeaseTask's backend is a LeaseBackend: validate_task() is the backend's own.
        return cast("LeaseBackend", self.get_backend()).enqueue_many(self, calls)

    def using_lease(self, **changes: Any) -> LeaseTask:
        """A copy with other lease options (lease, max_attempts, retry, on_lease_lost,
        unique_key, on_duplicate, deadline, max_age, schedule); validated at once, like
        ``using()``. Not ``non_retryable`` nor ``timeout``: the worker reads those from the
        task as declared, never from a job, so a copy's would be ignored."""
        if "non_retryable" in changes:
            raise InvalidTask(
                f"{self.module_path}: using_lease() cannot change non_retryable: the worker "
                "reads it from the task as declared (@task(non_retryable=...), Django 6.1 "
                "and later), not from each job, so a copy's would be ignored. Raise "
                "django_leases.exceptions.NonRetryable from the handler instead (any Django)."
            )
        if "timeout" in changes:
            raise InvalidTask(
                f"{self.module_path}: using_lease() cannot change timeout: the worker reads "
                "it from the task as declared (@task(timeout=...), Django 6.1 and later), not "
                "from each job, so a copy's would be ignored. Set TIMEOUT_SECONDS in the "
                "backend's OPTIONS or per queue in QUEUE_OPTIONS instead (any Django)."
            )
        allowed = LEASE_OPTIONS
        unknown = set(changes) - allowed
        if unknown:
            raise TypeError(
                f"using_lease() got unknown options {sorted(unknown)}; use {sorted(allowed)}"
            )
        return replace(self, **changes)


# The options using_lease() changes: the fields LeaseTask adds to Django's Task, but those
# the worker reads from the declaration alone.
LEASE_OPTIONS = frozenset(
    {f.name for f in fields(LeaseTask)}
    - {f.name for f in fields(Task)}
    - {"non_retryable", "timeout"}
)


def _not_runnable(*args: Any, **kwargs: Any) -> Any:
    raise InvalidTask("This stands in for a task this process does not declare; it cannot run.")


@dataclass(frozen=True, slots=True, kw_only=True)
class UndeclaredTask(LeaseTask):
    """What ``get_result()`` puts on a result whose job names a task this process does not
    declare (after importing every module the project lists), so that the result can
    still be read. ``module_path`` is the path the job names; the stand-in cannot be
    enqueued or called, and is never declared, so no worker runs it."""

    func: Any = _not_runnable
    path: str = ""

    def __post_init__(self) -> None:
        """Not validated, so never declared to the registry."""

    def __reduce__(self) -> Any:
        # Task's own pickles the function's path and imports it back, which is what an
        # undeclared path cannot do: this stand-in is rebuilt from its fields.
        return (_undeclared_task, ({f.name: getattr(self, f.name) for f in fields(self)},))

    @property
    def module_path(self) -> str:
        return self.path

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    def _refuse(self) -> InvalidTask:
        return InvalidTask(
            f"{self.path!r} is not a task declared for backend {self.backend!r}; "
            "this result's task can be read, not enqueued or called."
        )

    def enqueue(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()

    async def aenqueue(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()

    def enqueue_many(self, calls: Any) -> list[Any]:
        raise self._refuse()

    def call(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()


@dataclass(frozen=True, slots=True, kw_only=True)
# django-stubs declares TaskContext a plain dataclass; Django makes it frozen, as this is.
class LeaseTaskContext(_TaskContextBase):  # type: ignore[misc]
    """What ``run_lease_worker`` passes to a ``takes_context=True`` task: Django's
    TaskContext (``task_result``, ``attempt``) plus ``job``, the claim's JobHandle (fence,
    lease_remaining, lost, checkpoint()): the same object as ``current_job()``, kept here
    too so that code the handler hands the context to (another thread) still reaches it."""

    job: JobHandle | None = None


def _undeclared_task(values: dict[str, Any]) -> UndeclaredTask:
    """An UndeclaredTask back from its pickled fields."""
    return UndeclaredTask(**values)
