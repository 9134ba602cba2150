"""What an enqueue may ask for, checked once: ``EnqueueOptions`` (the manager's, the
backend's and a task's own options) turned into the ``JobFields`` every job of the call
gets, and the checks of a call's arguments, its queue and a task's declared options.

Nothing here writes; a refusal names the field (InvalidLeaseOption, InvalidJobArgument)
before any statement is sent. Times are the caller's own absolute ones or intervals the
INSERT adds to the database clock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, cast

from django.utils import timezone

from . import conf
from .jsonsafe import SENT_LIMIT, ensure_json, shown, size_as_sent, too_large
from .lease_statements import after_now, json_param
from .states import LeaseLostPolicy

if TYPE_CHECKING:
    from .models import Job


# Why a time given with USE_TZ = False is refused (enqueue) and warned of (check W003).
USE_TZ_NEEDED = (
    "needs USE_TZ = True: with USE_TZ = False, Django stores no aware datetime, and a naive "
    "one names no instant to compare with the database clock"
)


def _aware(name: str, value: Any) -> datetime:
    """``value`` in UTC, if it is an aware datetime within what every supported database
    stores (conf.EARLIEST_TIME to conf.LATEST_TIME: MySQL's DATETIME range), else
    InvalidLeaseOption."""
    from django.conf import settings

    from .exceptions import InvalidLeaseOption

    if not settings.USE_TZ:
        raise InvalidLeaseOption(name, USE_TZ_NEEDED)
    if not isinstance(value, datetime) or timezone.is_naive(value):
        raise InvalidLeaseOption(name, f"must be an aware datetime, got {shown(value)}")
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        utc = None
    if utc is None or not conf.EARLIEST_TIME <= utc <= conf.LATEST_TIME:
        raise InvalidLeaseOption(
            name,
            f"must lie from {conf.EARLIEST_TIME:%Y-%m-%d} to "
            f"{conf.LATEST_TIME:%Y-%m-%d} (UTC), got {shown(value)}",
        )
    # In UTC: PostgreSQL refuses a UTC offset past 15:59, which Python allows.
    return utc


def checked_seconds(name: str, value: Any) -> float:
    """A duration in seconds (a number or a timedelta) from 0 to conf.MAX_INTERVAL_SECONDS,
    so that Now() plus it is a time every supported database stores."""
    from .exceptions import InvalidLeaseOption

    if isinstance(value, timedelta):
        value = value.total_seconds()
    # Compared as it is: math.isfinite() of an int past a float's range raises OverflowError.
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= conf.MAX_INTERVAL_SECONDS
    ):
        raise InvalidLeaseOption(
            name,
            f"must be from 0 to {conf.MAX_INTERVAL_DAYS:,} days "
            f"({conf.MAX_INTERVAL_SECONDS:,} seconds), got {shown(value)}",
        )
    return float(value)


def checked_text(name: str, value: Any, longest: int) -> str:
    """A name stored in a character column: 1 to ``longest`` characters, none that a
    database refuses (PostgreSQL: NUL; any: a lone surrogate)."""
    from .exceptions import InvalidLeaseOption

    # str's own methods, and a plain str back: a caller's subclass may answer for itself.
    if not isinstance(value, str) or not 0 < str.__len__(value) <= longest:
        raise InvalidLeaseOption(name, f"must be 1-{longest} characters, got {shown(value)}")
    if str.__contains__(value, "\x00"):
        raise InvalidLeaseOption(name, "contains a NUL character, which PostgreSQL cannot store")
    try:
        str.encode(value, "utf-8")
    except UnicodeEncodeError:
        raise InvalidLeaseOption(name, f"is not valid Unicode, got {shown(value)}") from None
    return str.__str__(value)


# The length of Job.task_path (models.py uses it): a longer path would be refused by the
# database, which would also abort the caller's transaction.
TASK_PATH_LENGTH = 255


@dataclass(frozen=True, slots=True, kw_only=True)
class EnqueueOptions:
    """The keyword options of ``enqueue()`` (``enqueue_many()`` takes them all but
    ``unique_key``). ``check()`` turns them into the JobFields every job of the call gets,
    so a bulk enqueue validates its options once, not once per row."""

    queue_name: str = "default"
    priority: int = 0
    run_after: datetime | None = None
    delay: float | timedelta | None = None
    lease_seconds: float | None = None
    max_attempts: int | None = None
    retry: Any = None
    on_lease_lost: str = LeaseLostPolicy.RETRY
    deadline: datetime | None = None
    max_age: float | timedelta | None = None
    unique_key: str | None = None
    on_duplicate: str = "refuse"

    @classmethod
    def of(cls, options: dict[str, Any]) -> EnqueueOptions:
        """The options of a call given as keywords; an unknown one is a TypeError naming it,
        as for any Python call, with the known ones."""
        try:
            return cls(**options)
        except TypeError:
            from dataclasses import fields

            known = [f.name for f in fields(cls)]
            unknown = sorted(str(name) for name in options if name not in known)
            raise TypeError(
                f"enqueue() got unknown options {unknown}; use {', '.join(known)}"
            ) from None

    def check(self, task_path: str) -> JobFields:
        """The validated fields; raise InvalidLeaseOption naming the first bad option.
        Missing lease, attempts and age come from the backend OPTIONS."""
        return cast(JobFields, self._checked(task_path, conf.get_options(None), "lease_seconds"))

    def check_declared(self, task_path: str, lease_name: str = "lease_seconds") -> None:
        """Refuse (InvalidLeaseOption) an option given here that check() would refuse,
        without reading the backend's defaults: a task's own options, checked when it is
        declared (the lease named ``lease_name``, as the task names it)."""
        self._checked(task_path, None, lease_name)

    def _checked(
        self, task_path: str, defaults: conf.LeaseOptions | None, lease_name: str
    ) -> JobFields | None:
        from .exceptions import InvalidLeaseOption
        from .retry import Retry, checked_ladder

        task_path = checked_text("task_path", task_path, TASK_PATH_LENGTH)
        self._check_choices()
        lease, attempts = self.lease_seconds, self.max_attempts
        if defaults is not None:
            lease = defaults.lease_seconds if lease is None else lease
            attempts = defaults.max_attempts if attempts is None else attempts
        if lease is not None:
            lease = conf.validate_lease(lease, lease_name)
        if attempts is not None:
            attempts = conf.validate_max_attempts(attempts, "max_attempts")
        try:
            retry = None if self.retry is None else checked_ladder(Retry.from_json(self.retry))
        except InvalidLeaseOption:
            raise
        except (
            TypeError,
            ValueError,
            OverflowError,
        ) as e:  # e.g. {"delays": 5}, {"base": 1, "cap": None, "x": ...}
            raise InvalidLeaseOption(
                "retry",
                f"is not a Retry, a list of delays or a dict of base/factor/cap/jitter: {e}",
            ) from None
        run_after = None if self.run_after is None else _aware("run_after", self.run_after)
        delay = (
            None if self.delay is None else timedelta(seconds=checked_seconds("delay", self.delay))
        )
        deadline = max_age = None
        if self.deadline is not None:
            deadline = _aware("deadline", self.deadline)
            if run_after is not None and deadline < run_after:
                raise InvalidLeaseOption(
                    "deadline",
                    f"is before run_after ({run_after.isoformat()}): the job could never run, "
                    f"got {deadline.isoformat()}",
                )
        elif self.max_age is not None:
            max_age = timedelta(seconds=checked_seconds("max_age", self.max_age))
        elif defaults is not None:
            max_age = timedelta(seconds=defaults.max_age_days * 86400)
        # The age counts from when the job is due, on the database clock: Now() + delay,
        # or the later of run_after and Now() (statements: GREATEST). A job deferred past
        # MAX_AGE_DAYS after enqueue was dead-lettered at its due time without running.
        if max_age is not None and delay is not None:
            max_age += delay
        elif (
            max_age is not None
            and run_after is not None
            and max_age >= conf.LATEST_TIME - run_after
        ):
            deadline, max_age = conf.LATEST_TIME, None  # stops at the storable range's end
        if defaults is None:
            return None
        # The defaults filled both in when they were None.
        # Names as plain str (checked_text()): a caller's subclass could answer the
        # driver's encode() for itself.
        return JobFields(
            task_path,
            checked_text("queue_name", self.queue_name, 100),
            checked_priority(self.priority),
            cast(float, lease),
            cast(int, attempts),
            retry,
            self.on_lease_lost,
            None if self.unique_key is None else checked_text("unique_key", self.unique_key, 200),
            self.on_duplicate,
            run_after,
            delay,
            deadline,
            max_age,
        )

    def _check_choices(self) -> None:
        from .exceptions import InvalidLeaseOption

        queue, priority, key = self.queue_name, self.priority, self.unique_key
        checked_text("queue_name", queue, 100)
        checked_priority(priority)
        if self.run_after is not None and self.delay is not None:
            raise InvalidLeaseOption("run_after", "give run_after or delay, not both")
        if self.deadline is not None and self.max_age is not None:
            raise InvalidLeaseOption("deadline", "give deadline or max_age, not both")
        if self.on_lease_lost not in LeaseLostPolicy.values:
            raise InvalidLeaseOption(
                "on_lease_lost",
                f"must be one of {LeaseLostPolicy.values}, got {shown(self.on_lease_lost)}",
            )
        if self.on_duplicate not in ("refuse", "merge"):
            raise InvalidLeaseOption(
                "on_duplicate", f"must be 'refuse' or 'merge', got {shown(self.on_duplicate)}"
            )
        if key is not None:
            checked_text("unique_key", key, 200)


def checked_priority(priority: Any) -> int:
    """``priority`` as the int stored, if it is a whole number from -100 to 100 (5.0 too,
    as Django's validate_task accepts it; not a bool); else InvalidLeaseOption naming it."""
    from .exceptions import InvalidLeaseOption

    whole = None
    if not isinstance(priority, bool) and isinstance(priority, int | float | Decimal):
        with contextlib.suppress(ValueError, OverflowError):  # NaN, infinities
            whole = int(priority)
    if whole is None or whole != priority or not -100 <= whole <= 100:
        raise InvalidLeaseOption(
            "priority", f"must be a whole number from -100 to 100, got {shown(priority)}"
        )
    return whole


def check_task_options(task: Any) -> None:
    """Refuse (InvalidLeaseOption naming the option) what a task declares (``@task(...)``,
    ``using_lease(...)``) that an enqueue would refuse: EnqueueOptions checks every option
    an enqueue() call also takes; ``non_retryable`` and ``timeout`` only a task has."""
    from .exceptions import InvalidLeaseOption

    non_retryable = getattr(task, "non_retryable", ())
    if not isinstance(non_retryable, tuple | list):
        raise InvalidLeaseOption(
            "non_retryable", f"must be a tuple of exception classes, got {non_retryable!r}"
        )
    for cls in non_retryable:
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise InvalidLeaseOption("non_retryable", f"must hold exception classes, got {cls!r}")
    conf.validate_timeout(getattr(task, "timeout", None), "timeout")
    EnqueueOptions(
        lease_seconds=getattr(task, "lease", None),
        max_attempts=getattr(task, "max_attempts", None),
        retry=getattr(task, "retry", None),
        on_lease_lost=getattr(task, "on_lease_lost", LeaseLostPolicy.RETRY),
        deadline=getattr(task, "deadline", None),
        max_age=getattr(task, "max_age", None),
        unique_key=getattr(task, "unique_key", None),
        on_duplicate=getattr(task, "on_duplicate", "refuse"),
    ).check_declared(task.module_path, lease_name="lease")


@dataclass(frozen=True, slots=True)
class JobFields:
    """The checked columns of one enqueue call's jobs. The due time and the deadline are
    either the caller's own absolute time or an interval that the INSERT adds to the
    database clock: nothing here holds a "now" computed in Python."""

    task_path: str
    queue_name: str
    priority: int
    lease_seconds: float
    max_attempts: int
    retry: Any  # a Retry, or None for the default ladder
    on_lease_lost: str
    unique_key: str | None
    on_duplicate: str
    run_after: datetime | None
    delay: timedelta | None  # None with no run_after: due at Now()
    deadline: datetime | None
    max_age: timedelta | None  # set exactly when deadline is None

    def columns(self) -> dict[str, Any]:
        """The columns every job of the call shares (retry as its own fresh JSON)."""
        return {
            "task_path": self.task_path,
            "queue_name": self.queue_name,
            "priority": self.priority,
            "lease_seconds": self.lease_seconds,
            "max_attempts": self.max_attempts,
            "retry": self.retry_json(),
            "on_lease_lost": self.on_lease_lost,
            "unique_key": self.unique_key,
            "run_after": self.run_after,
        }

    def retry_json(self) -> dict[str, Any] | None:
        return None if self.retry is None else self.retry.to_json()

    def new_job(self, model: type[Job], args: list[Any], kwargs: dict[str, Any]) -> Job:
        """An unsaved job for the ORM path, its intervals as Now() + interval (the max age
        from the later of run_after and Now())."""
        from django.db.models import DateTimeField, Value
        from django.db.models.functions import Greatest, Now

        deadline: Any = self.deadline
        if self.max_age is not None and self.run_after is not None:
            due = Greatest(
                Value(self.run_after, DateTimeField()), Now(), output_field=DateTimeField()
            )
            deadline = due + Value(self.max_age)
        elif self.max_age is not None:
            deadline = after_now(self.max_age)
        timing: dict[str, Any] = {"deadline": deadline}
        if self.run_after is not None:
            timing["available_at"] = self.run_after
        elif self.delay is not None:
            timing["available_at"] = after_now(self.delay)
        return model(args=args, kwargs=kwargs, **self.columns(), **timing)

    def pg_params(self) -> dict[str, Any]:
        """Parameters of enqueue.py's _PG_ENQUEUE and _PG_BOUND_ONE but the per-job args
        and kwargs (one job's ``args`` and ``kwargs``, or a batch's ``calls``)."""
        params = self.columns()
        params["retry"] = json_param(params["retry"])
        params.update(
            run_after=self.run_after,
            delay=self.delay or timedelta(0),
            deadline=self.deadline,
            max_age=self.max_age,
        )
        return params


def checked_arguments(
    args: Any,
    kwargs: Any,
    path: str = "",
    bound: list[int] | None = None,
    *,
    as_django_stores: bool = False,
) -> tuple[list[Any], dict[str, Any]]:
    """JSON-safe copies of one call's ``args`` (a list or tuple) and ``kwargs`` (a dict with
    str keys, or None); InvalidJobArgument names the argument, prefixed by ``path``.
    ``bound``, if given, has their size as sent appended: measured past MEASURED_PAST,
    ensure_json's upper bound of it below (jsonsafe.size_as_sent()). ``as_django_stores``:
    UTF-8 bytes, any sequence and any mapping inside them taken as Django's TaskResult
    normalizes them (a str, a list, a dict), as the Tasks API's enqueue() does."""
    from .exceptions import InvalidJobArgument

    if not isinstance(args, list | tuple):
        # A string or a dict is iterable too, and list() would quietly store its characters
        # or keys as the arguments.
        raise InvalidJobArgument(
            f"{path}args", f"must be a list or tuple of arguments, got {shown(args)}"
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidJobArgument(
            f"{path}kwargs", f"must be a dict of keyword arguments, got {shown(kwargs)}"
        )
    size = [0]
    lenient = as_django_stores
    call = (
        ensure_json(args, f"{path}args", size, as_django_stores=lenient),
        ensure_json(kwargs or {}, f"{path}kwargs", size, as_django_stores=lenient),
    )
    length = size_as_sent(size[0], *call)
    if length > SENT_LIMIT:
        raise InvalidJobArgument(
            f"{path}args/kwargs",
            f"{too_large(length, 'their')}; pass a reference to the data (an id, a file's path)",
        )
    if bound is not None:
        bound.append(length)
    return call


def checked_calls(
    calls: Iterable[tuple[Sequence[Any], dict[str, Any] | None]],
    batch_size: int | None = None,
    fits: Callable[[list[Any], dict[str, Any], str], None] | None = None,
    bounds: list[int] | None = None,
    *,
    as_django_stores: bool = False,
) -> list[tuple[list[Any], dict[str, Any]]]:
    """Every call's (args, kwargs) as JSON-safe copies; InvalidJobArgument names the call.
    A ``batch_size`` that bulk_create would refuse is refused first. ``fits(args, kwargs,
    path)`` may refuse a call's checked arguments too (the backend: the task's signature).
    ``bounds``, if given, has each call's upper bound of its size as sent appended;
    ``as_django_stores`` as for checked_arguments()."""
    from .exceptions import InvalidJobArgument

    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    if isinstance(calls, str | bytes | dict) or not isinstance(calls, Iterable):
        raise InvalidJobArgument(
            "calls", f"must be an iterable of (args, kwargs) pairs, got {shown(calls)}"
        )
    checked = []
    for i, call in enumerate(calls):
        if not isinstance(call, list | tuple) or len(call) != 2:
            raise InvalidJobArgument(
                f"calls[{i}]", f"must be an (args, kwargs) pair, got {shown(call)}"
            )
        checked.append(
            checked_arguments(
                *call, path=f"calls[{i}].", bound=bounds, as_django_stores=as_django_stores
            )
        )
        if fits is not None:
            fits(*checked[-1], f"calls[{i}].")
    return checked


def check_queue(queue_name: Any, db: str) -> None:
    """Refuse (InvalidLeaseOption naming ``queue_name``) a queue that no lease backend on
    ``db`` accepts: no worker could serve its jobs (run_lease_worker serves only its
    backend's QUEUES)."""
    from .exceptions import InvalidLeaseOption

    allowed = conf.queues_served_on(db)
    if allowed is not None and queue_name not in allowed:
        raise InvalidLeaseOption(
            "queue_name",
            f"{shown(queue_name)} is not in the QUEUES of the task backends on database "
            f"{db!r} ({', '.join(sorted(allowed))}), so no worker would serve it",
        )
