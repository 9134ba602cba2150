"""Every statement that decides who owns a job lives here.

A write out of ``claimed`` is an UPDATE filtered on id, claim token and state; its rowcount
is the answer (1: still the owner, 0: the claim is lost). Every timestamp written comes from
the database clock (``Now()``); no datetime computed in Python is ever compared with a lease.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from django.db import (
    IntegrityError,
    OperationalError,
    ProgrammingError,
    connections,
    models,
    router,
    transaction,
)
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Now
from django.utils import timezone

from . import conf
from .deadlocks import retry_deadlock_victims
from .jsonsafe import ensure_json, shown
from .states import DeadReason, FailureKind, JobState, LeaseLostPolicy

if TYPE_CHECKING:
    from .models import Job


class ClaimRef(Protocol):
    """What proves a claim: the job's id and the token its claim was given."""

    pk: Any
    claim_token: uuid.UUID | None


def _checked_lease(lease: float | None) -> float | None:
    """A caller's lease override, refused (InvalidLeaseOption naming ``lease``) when zero,
    negative, NaN or past 12 h: a claim given such a lease would be open to takeover at once."""
    return None if lease is None else conf.validate_lease(lease, "lease")


def _lease_end(lease: float) -> Any:
    return _after_now(timedelta(seconds=lease))


def _lease_end_by_job(claims: Iterable[Any], override: float | None) -> Any:
    """Now() + each claim's lease (its ``lease_seconds``), on the database clock.

    Claims are grouped by lease, so the CASE has one branch per distinct lease however many
    claims there are.
    """
    if override is not None:
        return _lease_end(override)
    by_lease: dict[float, list[Any]] = {}
    for c in claims:
        by_lease.setdefault(float(getattr(c, "lease_seconds", conf.DEFAULT_LEASE_SECONDS)), []).append(c.pk)
    if len(by_lease) == 1:
        return _lease_end(next(iter(by_lease)))
    whens = [When(pk__in=pks, then=_lease_end(v)) for v, pks in sorted(by_lease.items())]
    return Case(*whens, default=_lease_end(max(by_lease)))


def _aware(name: str, value: Any) -> datetime:
    """``value`` in UTC, if it is an aware datetime within what every supported database
    stores (conf.EARLIEST_TIME to conf.LATEST_TIME: MySQL's DATETIME range), else
    InvalidLeaseOption."""
    from .exceptions import InvalidLeaseOption

    if not isinstance(value, datetime) or timezone.is_naive(value):
        raise InvalidLeaseOption(name, f"must be an aware datetime, got {shown(value)}")
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        utc = None
    if utc is None or not conf.EARLIEST_TIME <= utc <= conf.LATEST_TIME:
        raise InvalidLeaseOption(name, f"must lie from {conf.EARLIEST_TIME:%Y-%m-%d} to "
                                       f"{conf.LATEST_TIME:%Y-%m-%d} (UTC), got {shown(value)}")
    # In UTC: PostgreSQL refuses a UTC offset past 15:59, which Python allows.
    return utc


def _seconds(name: str, value: Any) -> float:
    """A duration in seconds (a number or a timedelta) from 0 to conf.MAX_INTERVAL_SECONDS,
    so that Now() plus it is a time every supported database stores."""
    from .exceptions import InvalidLeaseOption

    if isinstance(value, timedelta):
        value = value.total_seconds()
    # Compared as it is: math.isfinite() of an int past a float's range raises OverflowError.
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 <= value <= conf.MAX_INTERVAL_SECONDS):
        raise InvalidLeaseOption(name, f"must be from 0 to {conf.MAX_INTERVAL_DAYS:,} days "
                                       f"({conf.MAX_INTERVAL_SECONDS:,} seconds), got {shown(value)}")
    return float(value)


def _text_option(name: str, value: Any, longest: int) -> str:
    """A name stored in a character column: 1 to ``longest`` characters, none that a
    database refuses (PostgreSQL: NUL; any: a lone surrogate)."""
    from .exceptions import InvalidLeaseOption

    if not isinstance(value, str) or not 0 < len(value) <= longest:
        raise InvalidLeaseOption(name, f"must be 1-{longest} characters, got {shown(value)}")
    if "\x00" in value:
        raise InvalidLeaseOption(name, "contains a NUL character, which PostgreSQL cannot store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidLeaseOption(name, f"is not valid Unicode, got {shown(value)}") from None
    return value


def _count_if_expired() -> Case:
    """leases_lost + 1 when the row is a claim (being taken over or ended), else unchanged."""
    return Case(When(state=JobState.CLAIMED, then=F("leases_lost") + 1), default=F("leases_lost"),
                output_field=models.PositiveIntegerField())


def _ending(job: Any) -> str | None:
    """How a claim candidate ends instead of being claimed: a dead reason, "park", or None."""
    if job.past_deadline:
        return DeadReason.DEADLINE
    if job.state != JobState.CLAIMED:
        return None
    if job.on_lease_lost == LeaseLostPolicy.DEAD:
        return DeadReason.LEASE_LOST
    if job.on_lease_lost == LeaseLostPolicy.PARK:
        return "park"
    if job.attempts >= job.max_attempts:
        return DeadReason.ATTEMPTS
    return None


def _granted_lease(job: Any) -> float | None:
    """The lease the claim's last claim or renewal granted: its end minus the heartbeat
    that set it, both written by one statement on the database clock. None if unknown."""
    if job.lease_expires_at is None or job.heartbeat_at is None:
        return None
    return round((job.lease_expires_at - job.heartbeat_at).total_seconds(), 1)


def _expiry_message(granted: float | None, owner: str) -> str:
    """The message of a lease_expired failure (the PostgreSQL claim writes the same)."""
    owner = owner or "its worker"
    if granted is None or granted < conf.MIN_LEASE_SECONDS:
        # No claim is granted less: the lease was ended early (expire_now, the admin).
        return f"lease was ended early, before {owner} acknowledged"
    return f"lease of {granted:g} s ran out before {owner} acknowledged"


def _token_case(tokens: dict[Any, uuid.UUID]) -> Case:
    return Case(
        *[When(pk=pk, then=Value(token, output_field=models.UUIDField()))
          for pk, token in tokens.items()],
        output_field=models.UUIDField(),
    )


# -- enqueue: the options of one call, checked once ----------------------------------------

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
            raise TypeError(f"enqueue() got unknown options {unknown}; use {', '.join(known)}") from None

    def check(self, task_path: str) -> JobFields:
        """The validated fields; raise InvalidLeaseOption naming the first bad option.
        Missing lease, attempts and age come from the backend OPTIONS."""
        from .exceptions import InvalidLeaseOption
        from .retry import Retry

        _text_option("task_path", task_path, TASK_PATH_LENGTH)
        self._check_choices()
        options = conf.get_options(None)
        lease = conf.validate_lease(
            options.lease_seconds if self.lease_seconds is None else self.lease_seconds, "lease_seconds")
        attempts = conf.validate_max_attempts(
            options.max_attempts if self.max_attempts is None else self.max_attempts, "max_attempts")
        try:
            retry = None if self.retry is None else Retry.from_json(self.retry)
        except InvalidLeaseOption:
            raise
        except (TypeError, ValueError, OverflowError) as e:  # e.g. {"delays": 5}, {"base": 1, "cap": None, "x": ...}
            raise InvalidLeaseOption("retry", f"is not a Retry, a list of delays or a dict of "
                                              f"base/factor/cap/jitter: {e}") from None
        run_after = None if self.run_after is None else _aware("run_after", self.run_after)
        delay = None if self.delay is None else timedelta(seconds=_seconds("delay", self.delay))
        deadline = max_age = None
        if self.deadline is not None:
            deadline = _aware("deadline", self.deadline)
        else:
            age = options.max_age_days * 86400 if self.max_age is None else _seconds("max_age", self.max_age)
            max_age = timedelta(seconds=age)
        return JobFields(task_path, self.queue_name, self.priority, lease, attempts, retry,
                         self.on_lease_lost, self.unique_key, self.on_duplicate,
                         run_after, delay, deadline, max_age)

    def _check_choices(self) -> None:
        from .exceptions import InvalidLeaseOption

        queue, priority, key = self.queue_name, self.priority, self.unique_key
        _text_option("queue_name", queue, 100)
        if isinstance(priority, bool) or not isinstance(priority, int) or not -100 <= priority <= 100:
            raise InvalidLeaseOption("priority", f"must be a whole number from -100 to 100, got {shown(priority)}")
        if self.run_after is not None and self.delay is not None:
            raise InvalidLeaseOption("run_after", "give run_after or delay, not both")
        if self.deadline is not None and self.max_age is not None:
            raise InvalidLeaseOption("deadline", "give deadline or max_age, not both")
        if self.on_lease_lost not in LeaseLostPolicy.values:
            raise InvalidLeaseOption(
                "on_lease_lost", f"must be one of {LeaseLostPolicy.values}, got {shown(self.on_lease_lost)}")
        if self.on_duplicate not in ("refuse", "merge"):
            raise InvalidLeaseOption("on_duplicate", f"must be 'refuse' or 'merge', got {shown(self.on_duplicate)}")
        if key is not None:
            _text_option("unique_key", key, 200)


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
        return {"task_path": self.task_path, "queue_name": self.queue_name, "priority": self.priority,
                "lease_seconds": self.lease_seconds, "max_attempts": self.max_attempts,
                "retry": self.retry_json(), "on_lease_lost": self.on_lease_lost,
                "unique_key": self.unique_key, "run_after": self.run_after}

    def retry_json(self) -> dict[str, Any] | None:
        return None if self.retry is None else self.retry.to_json()

    def new_job(self, model: Any, args: list[Any], kwargs: dict[str, Any]) -> Job:
        """An unsaved job for the ORM path, its intervals as Now() + interval."""
        timing: dict[str, Any] = {"deadline": self.deadline if self.max_age is None else _after_now(self.max_age)}
        if self.run_after is not None:
            timing["available_at"] = self.run_after
        elif self.delay is not None:
            timing["available_at"] = _after_now(self.delay)
        return model(args=args, kwargs=kwargs, **self.columns(), **timing)

    def pg_params(self) -> dict[str, Any]:
        """Parameters of _PG_ENQUEUE but the per-row args and kwargs."""
        params = self.columns()
        params["retry"] = _pg_json(params["retry"])
        params.update(run_after=self.run_after, delay=self.delay or timedelta(0),
                      deadline=self.deadline, max_age=self.max_age)
        return params


def _after_now(interval: timedelta) -> Any:
    return Now() + Value(interval)


def checked_arguments(args: Any, kwargs: Any, path: str = "") -> tuple[list, dict]:
    """JSON-safe copies of one call's ``args`` (a list or tuple) and ``kwargs`` (a dict with
    str keys, or None); InvalidJobArgument names the argument, prefixed by ``path``."""
    from .exceptions import InvalidJobArgument

    if not isinstance(args, list | tuple):
        # A string or a dict is iterable too, and list() would quietly store its characters
        # or keys as the arguments.
        raise InvalidJobArgument(f"{path}args", f"must be a list or tuple of arguments, got {shown(args)}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidJobArgument(f"{path}kwargs", f"must be a dict of keyword arguments, got {shown(kwargs)}")
    return ensure_json(args, f"{path}args"), ensure_json(kwargs or {}, f"{path}kwargs")


def _checked_calls(calls: Iterable[tuple[Sequence[Any], dict[str, Any] | None]],
                   batch_size: int | None = None,
                   fits: Callable[[list, dict, str], None] | None = None) -> list[tuple[list, dict]]:
    """Every call's (args, kwargs) as JSON-safe copies; InvalidJobArgument names the call.
    A ``batch_size`` that bulk_create would refuse is refused first. ``fits(args, kwargs,
    path)`` may refuse a call's checked arguments too (the backend: the task's signature)."""
    from .exceptions import InvalidJobArgument

    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    if isinstance(calls, str | bytes | dict) or not isinstance(calls, Iterable):
        raise InvalidJobArgument("calls", f"must be an iterable of (args, kwargs) pairs, got {shown(calls)}")
    checked = []
    for i, call in enumerate(calls):
        if not isinstance(call, list | tuple) or len(call) != 2:
            raise InvalidJobArgument(f"calls[{i}]", f"must be an (args, kwargs) pair, got {shown(call)}")
        checked.append(checked_arguments(*call, path=f"calls[{i}]."))
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
            "queue_name", f"{shown(queue_name)} is not in the QUEUES of the task backends on database "
                          f"{db!r} ({', '.join(sorted(allowed))}), so no worker would serve it")


# What each database says when a table or column a migration adds is missing: PostgreSQL's
# SQLSTATEs, MySQL's error numbers, SQLite's words.
_PG_UNDEFINED = {"42P01", "42703"}
_MYSQL_UNDEFINED = {1146, 1054}
_SQLITE_UNDEFINED = ("no such table", "no such column", "has no column named")


@contextmanager
def migrated(model: Any, db: str) -> Iterator[None]:
    """Turn the database's "no such table/column" into the same error saying what to run."""
    try:
        yield
    except (ProgrammingError, OperationalError) as e:
        cause = e.__cause__
        undefined = (getattr(cause, "sqlstate", None) in _PG_UNDEFINED
                     or (connections[db].vendor == "mysql" and e.args and e.args[0] in _MYSQL_UNDEFINED)
                     or any(words in str(e) for words in _SQLITE_UNDEFINED))
        if not undefined:
            raise
        raise type(e)(
            f"The job table {model._meta.db_table!r} is missing or out of date on database "
            f"{db!r} ({str(e).strip().splitlines()[0]}): run `python manage.py migrate django_leases "
            f"--database {db}`."
        ) from e


def insert_job(model: Any, db: str, fields: JobFields, args: list[Any], kwargs: dict[str, Any]) -> Job:
    """Insert one job of checked ``fields`` and JSON-safe arguments (see JobQuerySet.enqueue);
    a held unique key is refused (DuplicateJob) or merged per ``fields.on_duplicate``."""
    with migrated(model, db):
        return _insert_job(model, db, fields, args, kwargs)


def _insert_job(model: Any, db: str, fields: JobFields, args: list[Any], kwargs: dict[str, Any]) -> Job:
    insert = _pg_insert_one if _pg(db) else _insert_one
    if fields.unique_key is None:
        return insert(model, db, fields, args, kwargs)
    from .exceptions import DuplicateJob

    for _ in range(3):
        job = insert(model, db, fields, args, kwargs)
        if job is not None:
            return job
        # The key is held; unless its holder finished in the meantime, that is the answer.
        holder = model._default_manager.using(db).filter(
            unique_key=fields.unique_key, state__in=[JobState.PENDING, JobState.CLAIMED]).first()
        if holder is not None:
            if fields.on_duplicate == "merge":
                return holder
            raise DuplicateJob(fields.unique_key, holder.pk)
    raise IntegrityError(f"unique_key {fields.unique_key!r} kept conflicting; try again")


def insert_jobs(model: Any, db: str, fields: JobFields,
                calls: Iterable[tuple[Sequence[Any], dict[str, Any] | None]],
                batch_size: int | None) -> list[Job]:
    """Insert one job per call, all or none, ``batch_size`` rows per INSERT (see
    JobQuerySet.enqueue_many); every call is checked before the first INSERT."""
    checked = _checked_calls(calls, batch_size)
    with migrated(model, db):
        if not _pg(db):
            return _insert_many(model, db, fields, checked, batch_size)
        return _saved_jobs(model, db, fields, checked, _pg_insert_many(model, db, fields, checked, batch_size))


def insert_job_rows(model: Any, db: str, fields: JobFields,
                    calls: Iterable[tuple[Sequence[Any], dict[str, Any] | None]],
                    batch_size: int | None,
                    fits: Callable[[list, dict, str], None] | None = None) -> list[tuple[Any, datetime, list, dict]]:
    """insert_jobs(), answering (id, enqueued_at, args, kwargs) for each job: what a
    TaskResult needs. On PostgreSQL no model instance is built, which is most of the time
    a bulk enqueue of thousands of jobs would otherwise take. ``fits`` as for
    _checked_calls."""
    checked = _checked_calls(calls, batch_size, fits)
    with migrated(model, db):
        if not _pg(db):
            return [(j.pk, j.enqueued_at, j.args, j.kwargs)
                    for j in _insert_many(model, db, fields, checked, batch_size)]
        rows = _pg_insert_many(model, db, fields, checked, batch_size)
    return [(row[0], row[1], args, kwargs) for (args, kwargs), row in zip(checked, rows, strict=True)]


def _insert_many(model: Any, db: str, fields: JobFields, calls: list[tuple[list, dict]],
                 batch_size: int | None) -> list[Job]:
    """The ORM path (SQLite, MariaDB, MySQL): bulk_create, itself all or nothing."""
    manager = model._default_manager.using(db)
    jobs = [fields.new_job(model, args, kwargs) for args, kwargs in calls]
    if connections[db].features.can_return_rows_from_bulk_insert:
        return manager.bulk_create(jobs, batch_size=batch_size)
    # MySQL has no RETURNING: bulk_create would leave every id unset. One INSERT per job
    # (its id comes back as the last insert id), in one transaction, then one read of the
    # times the database gave them.
    with transaction.atomic(using=db):
        for job in jobs:
            job.save(using=db, force_insert=True)
    times = {pk: row for pk, *row in manager.filter(pk__in=[j.pk for j in jobs]).values_list(
        "pk", *_INSERT_CLOCK_FIELDS)}
    for job in jobs:
        for name, value in zip(_INSERT_CLOCK_FIELDS, times[job.pk], strict=True):
            setattr(job, name, value)
    return jobs


# What an INSERT leaves to the database clock (db_default Now(), Now() + an interval).
_INSERT_CLOCK_FIELDS = ("enqueued_at", "available_at", "deadline")


def _insert_one(model: Any, db: str, fields: JobFields, args: list[Any], kwargs: dict[str, Any]) -> Job | None:
    """The ORM path (SQLite, MariaDB): save(); None when the unique key is held."""
    job = fields.new_job(model, args, kwargs)
    if fields.unique_key is None:
        job.save(using=db, force_insert=True)
        return job
    try:
        # A savepoint, so a refused insert leaves the caller's transaction usable.
        with transaction.atomic(using=db):
            job.save(using=db, force_insert=True)
    except IntegrityError:
        return None
    return job


# Fields whose new values the claim sets on the database clock; dropped from the returned
# instances so that reading them loads the database's value instead of a guess.
_DB_CLOCK_FIELDS = ("lease_expires_at", "heartbeat_at", "last_attempted_at", "started_at")


class JobQuerySet(models.QuerySet):
    """Predicates and state transitions of jobs."""

    # -- lease views -------------------------------------------------------------------

    def claimable(self) -> JobQuerySet:
        """Pending and due, or claimed with a lease that has run out."""
        return self.filter(
            Q(state=JobState.PENDING, available_at__lte=Now())
            | Q(state=JobState.CLAIMED, lease_expires_at__lt=Now())
        )

    def claim_order(self, queues: Iterable[str] | None) -> JobQuerySet:
        """Claimable jobs of ``queues`` (None: of every queue) in the order a claim takes
        them (partial indexes on PostgreSQL the claim itself runs an ordered scan of
        leases_job_due_idx)."""
        jobs = self if queues is None else self.filter(queue_name__in=list(queues))
        return jobs.claimable().order_by("-priority", "available_at", "id")

    def expired(self) -> JobQuerySet:
        """Claimed, and the lease has passed: any worker may claim it again."""
        return self.filter(state=JobState.CLAIMED, lease_expires_at__lt=Now())

    def stalled(self, silent_for: float) -> JobQuerySet:
        """Claimed with a valid lease, but no heartbeat for ``silent_for`` seconds."""
        return self.filter(
            state=JobState.CLAIMED,
            lease_expires_at__gte=Now(),
            heartbeat_at__lt=Now() - Value(timedelta(seconds=silent_for)),
        )

    def healthy(self, silent_for: float) -> JobQuerySet:
        """Claimed with a valid lease and a heartbeat within ``silent_for`` seconds."""
        return self.filter(
            state=JobState.CLAIMED,
            lease_expires_at__gte=Now(),
            heartbeat_at__gte=Now() - Value(timedelta(seconds=silent_for)),
        )

    # -- enqueue -----------------------------------------------------------------------

    def enqueue(self, task_path: str, args: Sequence[Any] = (),
                kwargs: dict[str, Any] | None = None, **options: Any) -> Job:
        """Insert a pending job in the caller's transaction and return it.

        ``options`` are those of EnqueueOptions: queue_name, priority, run_after, delay,
        lease_seconds, max_attempts, retry, on_lease_lost, deadline, max_age, unique_key,
        on_duplicate. Raise InvalidJobArgument (naming the argument) or InvalidLeaseOption
        before anything is written. ``delay`` and ``max_age`` count from the database clock;
        ``run_after`` and ``deadline`` are the caller's own absolute times. With
        ``unique_key``, a second pending or claimed job with the same key is refused
        (DuplicateJob) or, with ``on_duplicate="merge"``, the existing job is returned instead.
        """
        args, kwargs = checked_arguments(args, kwargs)
        fields = EnqueueOptions.of(options).check(task_path)
        db = self._db or router.db_for_write(self.model)
        check_queue(fields.queue_name, db)
        return insert_job(self.model, db, fields, args, kwargs)

    def enqueue_many(
        self,
        task_path: str,
        calls: Iterable[tuple[Sequence[Any], dict[str, Any] | None]],
        *,
        batch_size: int = 1000,
        **options: Any,
    ) -> list[Job]:
        """Insert one pending job per ``(args, kwargs)`` call in as few INSERTs as possible
        (``batch_size`` rows each), in the caller's transaction; the options are those of
        ``enqueue()`` except ``unique_key``, checked once for every call. Every call is
        checked before anything is written: an argument that does not round-trip through
        JSON raises InvalidJobArgument naming the call (``calls[3].args[0]``) and nothing is
        inserted.
        """
        from .exceptions import InvalidLeaseOption

        if "unique_key" in options:
            raise InvalidLeaseOption("unique_key", "enqueue_many() takes no unique_key; use enqueue()")
        fields = EnqueueOptions.of(options).check(task_path)
        db = self._db or router.db_for_write(self.model)
        check_queue(fields.queue_name, db)
        return insert_jobs(self.model, db, fields, calls, batch_size)

    # -- the claim and its owner's writes ----------------------------------------------

    @retry_deadlock_victims
    def claim(
        self,
        worker_id: str,
        queues: Iterable[str] | None = ("default",),
        limit: int = 1,
        lease: float | None = None,
        *,
        settle: bool = True,
    ) -> list[Job]:
        """Claim up to ``limit`` due or expired jobs of ``queues`` (None: of every queue),
        by priority then due time.

        Each claimed job gets a fresh claim token, fence + 1, attempts + 1 and a lease ending
        at Now() + lease (its own lease_seconds unless ``lease`` is given). Candidates that
        must not run again end here instead: past their deadline, or an expired claim with no
        attempts left or whose task says a lost lease means dead-letter or park. Where the
        database has SKIP LOCKED, rows another worker is claiming are passed over; elsewhere
        (SQLite) the UPDATE re-checks the claim predicate, so two workers never both win a row.

        On PostgreSQL one statement claims; the candidates that end instead of running are
        settled by a second, portable pass when the first claimed fewer than ``limit``.
        ``settle=False`` skips that pass (a worker woken by NOTIFY settles on its next poll).

        Each job carries the row as it was before the claim: ``was_state`` ("claimed" for a
        takeover of an expired claim), ``was_claimed_by``, ``was_fence`` and ``was_lease``
        (the seconds its last claim or renewal granted, from the row's own database times).
        """
        if limit < 1:
            return []
        lease = _checked_lease(lease)
        db = self._db or router.db_for_write(self.model)
        queues = None if queues is None else list(queues)
        claimed: list[Job] = []
        if _pg(db):
            claimed = _pg_claim(self.model, db, worker_id, queues, limit, lease)
            if len(claimed) == limit or not settle:
                return claimed
            limit -= len(claimed)
        return claimed + self._claim_portable(db, worker_id, queues, limit, lease)

    def _claim_portable(self, db: str, worker_id: str, queues: list[str] | None, limit: int,
                        lease: float | None) -> list[Job]:
        features = connections[db].features
        candidates_qs = self.model._default_manager.using(db).claim_order(queues).annotate(
            past_deadline=Case(When(deadline__lt=Now(), then=Value(True)), default=Value(False),
                               output_field=models.BooleanField()))
        if features.has_select_for_update_skip_locked:
            with transaction.atomic(using=db):
                candidates = list(candidates_qs.select_for_update(skip_locked=True)[:limit])
                return self._take(db, candidates, worker_id, lease)
        candidates = list(candidates_qs[:limit])
        return self._take(db, candidates, worker_id, lease)

    def _take(self, db: str, candidates: list[Job], worker_id: str, lease: float | None) -> list[Job]:
        if not candidates:
            return []
        manager = self.model._default_manager.using(db)
        endings = {j.pk: _ending(j) for j in candidates}
        ending = {pk: e for pk, e in endings.items() if e is not None}
        if ending:
            self._settle(db, [j for j in candidates if j.pk in ending], ending)
        wanted = [j for j in candidates if j.pk not in ending]
        if not wanted:
            return []
        tokens = {j.pk: uuid.uuid4() for j in wanted}
        # Each row must still be as it was read (fence and state): without SKIP LOCKED the
        # read took no lock, and a row taken over and expired again meanwhile would be won
        # with the previous owner's fence and attempt, so two owners would share a fence.
        as_read = Q()
        for j in wanted:
            as_read |= Q(pk=j.pk, fence=j.fence, state=j.state)
        claimed_count = manager.filter(as_read).claimable().update(
            # MySQL assigns left to right and later expressions see earlier assignments:
            # read the old state before it is overwritten.
            leases_lost=_count_if_expired(),
            state=JobState.CLAIMED,
            claim_token=_token_case(tokens),
            fence=F("fence") + 1,
            attempts=F("attempts") + 1,
            claimed_by=worker_id,
            lease_expires_at=_lease_end_by_job(wanted, lease),
            heartbeat_at=Now(),
            last_attempted_at=Now(),
            started_at=Case(When(started_at__isnull=True, then=Now()), default=F("started_at"),
                            output_field=models.DateTimeField()),
        )
        if claimed_count != len(wanted):
            # Lost a race for some rows (only possible without SKIP LOCKED): keep the ones
            # that carry our tokens.
            won = set(manager.filter(claim_token__in=tokens.values()).values_list("pk", flat=True))
            wanted = [j for j in wanted if j.pk in won]
        taken_over = [j for j in wanted if j.state == JobState.CLAIMED]
        if taken_over:
            self._record_expired(db, taken_over)
        for job in wanted:
            job.was_state, job.was_claimed_by, job.was_fence = job.state, job.claimed_by, job.fence
            job.was_lease = _granted_lease(job) if job.state == JobState.CLAIMED else None
            job.state = JobState.CLAIMED
            job.claim_token = tokens[job.pk]
            job.fence += 1
            job.attempts += 1
            job.claimed_by = worker_id
            for name in _DB_CLOCK_FIELDS:
                job.__dict__.pop(name, None)
        return wanted

    def _record_expired(self, db: str, jobs: list[Job]) -> None:
        from .models import JobFailure

        JobFailure.objects.using(db).bulk_create([
            JobFailure(job_id=j.pk, attempt=j.attempts, fence=j.fence, worker_id=j.claimed_by,
                       kind=FailureKind.LEASE_EXPIRED,
                       message=_expiry_message(_granted_lease(j), j.claimed_by))
            for j in jobs
        ])

    def _settle(self, db: str, jobs: list[Job], ending: dict[Any, str]) -> None:
        """End candidates that must not run again: dead-letter them, or park them."""
        manager = self.model._default_manager.using(db)
        with transaction.atomic(using=db):
            lost = []
            for job in jobs:
                reason = ending[job.pk]
                if reason == "park":
                    changes: dict[str, Any] = {"state": JobState.PENDING, "available_at": None}
                else:
                    changes = {"state": JobState.DEAD, "dead_reason": reason, "finished_at": Now()}
                # One conditional UPDATE per job: state and token pin the row as it was found.
                if manager.claimable().filter(
                    pk=job.pk, state=job.state, claim_token=job.claim_token
                ).update(leases_lost=_count_if_expired(), claim_token=None,
                         lease_expires_at=None, **changes) == 1 and job.state == JobState.CLAIMED:
                    lost.append(job)
            self._record_expired(db, lost)

    @retry_deadlock_victims
    def renew(self, claims: Iterable[ClaimRef], lease: float | None = None) -> set[Any]:
        """Push the lease of every claim forward in one statement; return the ids still held.

        An id missing from the answer is a lost claim: its handler must stop and its result
        be discarded.
        """
        claims = list(claims)
        if not claims:
            return set()
        lease = _checked_lease(lease)
        db = self._db or router.db_for_write(self.model)
        if _pg(db):
            return _pg_ids(self.model, db, _PG_RENEW, {
                "ids": [c.pk for c in claims], "tokens": [c.claim_token for c in claims],
                "leases": [float(getattr(c, "lease_seconds", conf.DEFAULT_LEASE_SECONDS)) for c in claims],
                "lease": lease})
        manager = self.model._default_manager.using(db)
        ids = [c.pk for c in claims]
        tokens = [c.claim_token for c in claims]
        held = manager.filter(pk__in=ids, claim_token__in=tokens, state=JobState.CLAIMED)
        renewed = held.update(
            lease_expires_at=_lease_end_by_job(claims, lease),
            heartbeat_at=Now(),
        )
        if renewed == len(claims):
            return set(ids)
        # Tokens are unique per claim and never return to 'claimed', so this read can only
        # shrink the answer (a job its owner just acknowledged), never grow it.
        return set(held.values_list("pk", flat=True))

    def _owned(self, claim: ClaimRef) -> JobQuerySet:
        db = self._db or router.db_for_write(self.model)
        return self.model._default_manager.using(db).filter(
            pk=claim.pk, claim_token=claim.claim_token, state=JobState.CLAIMED)

    @retry_deadlock_victims
    def ack(self, claim: ClaimRef, result: Any = None) -> bool:
        """Mark the job succeeded if ``claim`` still owns it. Raise InvalidJobArgument if
        ``result`` does not round-trip through JSON (nothing is written then)."""
        result = ensure_json(result, "result")
        return self._owned(claim).update(
            state=JobState.SUCCEEDED, result=result, finished_at=Now(),
            claim_token=None, lease_expires_at=None,
        ) == 1

    @retry_deadlock_victims
    def fail(
        self,
        claim: ClaimRef,
        *,
        exception_class_path: str = "",
        message: str = "",
        traceback: str = "",
        retry: bool = True,
        retry_in: float | None = None,
        kind: str = FailureKind.EXCEPTION,
    ) -> bool:
        """Record a failed attempt if ``claim`` still owns the job.

        The job goes back to pending while it has attempts left, its deadline has not passed
        and ``retry`` is true, due after ``retry_in`` seconds on the database clock (by
        default the next step of the job's retry ladder); otherwise it is dead-lettered with
        the reason. The class path, message and traceback are stored as storable.py makes
        them (lone surrogates and NUL escaped, cut at its limits), whoever calls.
        """
        from .models import JobFailure
        from .retry import DEFAULT_RETRY, Retry
        from .storable import (
            MESSAGE_LIMIT,
            TRACEBACK_LIMIT,
            storable_name,
            storable_text,
        )

        db = self._db or router.db_for_write(self.model)
        if retry_in is None:
            ladder = getattr(claim, "retry", None)
            retry_in = (Retry.from_json(ladder) if ladder else DEFAULT_RETRY).delay(
                getattr(claim, "attempts", 1) or 1)
        if retry:
            reason: Any = Case(
                When(deadline__lt=Now(), then=Value(DeadReason.DEADLINE)),
                When(attempts__gte=F("max_attempts"), then=Value(DeadReason.ATTEMPTS)),
                default=Value(""),
            )
            dead = Q(deadline__lt=Now()) | Q(attempts__gte=F("max_attempts"))
            state: Any = Case(When(dead, then=Value(JobState.DEAD)), default=Value(JobState.PENDING))
            finished: Any = Case(When(dead, then=Now()), default=Value(None),
                                 output_field=models.DateTimeField())
        else:
            reason = DeadReason.UNRUNNABLE if kind == FailureKind.UNRUNNABLE else DeadReason.NON_RETRYABLE
            state, finished = JobState.DEAD, Now()
        with transaction.atomic(using=db):
            # dead_reason and finished_at read attempts/deadline, which this UPDATE leaves
            # alone, so MySQL's left-to-right assignment cannot change their answers.
            if self._owned(claim).update(
                dead_reason=reason, finished_at=finished, state=state,
                available_at=_lease_end(max(retry_in, 0.0)),
                claim_token=None, lease_expires_at=None,
            ) != 1:
                return False
            job = self.model._default_manager.using(db).only("attempts", "fence", "claimed_by").get(pk=claim.pk)
            JobFailure.objects.using(db).create(
                job_id=claim.pk, attempt=job.attempts, fence=job.fence, worker_id=job.claimed_by,
                kind=kind, exception_class_path=storable_name(exception_class_path),
                message=storable_text(message, MESSAGE_LIMIT),
                traceback=storable_text(traceback, TRACEBACK_LIMIT, keep_tail=True),
            )
        return True

    @retry_deadlock_victims
    def release(self, claim: ClaimRef) -> bool:
        """Give the job back to pending at once without counting the attempt."""
        return self._owned(claim).update(
            state=JobState.PENDING, available_at=Now(), attempts=F("attempts") - 1,
            claim_token=None, lease_expires_at=None,
        ) == 1

    @retry_deadlock_victims
    def checkpoint(self, claim: ClaimRef, cursor: Any, lease: float | None = None) -> bool:
        """Commit ``cursor`` and renew the lease in one conditional UPDATE."""
        cursor = ensure_json(cursor, "cursor")
        lease = _checked_lease(lease)
        return self._owned(claim).update(
            cursor=cursor,
            lease_expires_at=_lease_end_by_job([claim], lease),
            heartbeat_at=Now(),
        ) == 1

    # -- operator actions: conditional on state, answering how many changed -------------

    def cancel(self) -> int:
        """Cancel pending and claimed jobs; a running handler learns at its next renewal."""
        return self.filter(state__in=[JobState.PENDING, JobState.CLAIMED]).update(
            state=JobState.CANCELLED, finished_at=Now(), claim_token=None, lease_expires_at=None)

    def requeue(self, *, reset_attempts: bool = True, max_age: float | None = None) -> int:
        """Put dead and cancelled jobs back to pending, due now, with a fresh deadline
        (``max_age`` seconds, default the backend's MAX_AGE_DAYS, from the database's Now()).

        A job whose unique key is held by another active job stays where it is.
        """
        age = conf.get_options(None).max_age_days * 86400 if max_age is None else _seconds("max_age", max_age)
        changes: dict[str, Any] = {"attempts": 0} if reset_attempts else {
            # Keep the count but leave room for one more try.
            "max_attempts": Case(When(attempts__gte=F("max_attempts"), then=F("attempts") + 1),
                                 default=F("max_attempts"),
                                 output_field=models.PositiveIntegerField())}
        taken = list(self.model._default_manager.using(self.db).filter(
            active_key__isnull=False).values_list("active_key", flat=True))
        return self.filter(state__in=[JobState.DEAD, JobState.CANCELLED]).exclude(
            unique_key__in=taken).update(
            state=JobState.PENDING, available_at=Now(), finished_at=None, dead_reason="",
            deadline=_lease_end(age), **changes)

    def retry_now(self) -> int:
        """Make pending jobs due now, parked ones included."""
        return self.filter(state=JobState.PENDING).update(available_at=Now())

    def expire_now(self) -> int:
        """End the lease of claimed jobs (a second ago, DB clock) so any worker may take them."""
        return self.filter(state=JobState.CLAIMED).update(
            lease_expires_at=Now() - Value(timedelta(seconds=1)))

    def prunable(self, older_than_days: float, *, include_dead: bool = False) -> JobQuerySet:
        """Finished jobs past retention: succeeded, cancelled, and dead ones if asked."""
        states = [JobState.SUCCEEDED, JobState.CANCELLED] + ([JobState.DEAD] if include_dead else [])
        return self.filter(
            state__in=states, finished_at__lt=Now() - Value(timedelta(days=older_than_days)))

    def prune(self, older_than_days: float, *, include_dead: bool = False,
              batch_size: int = 1000) -> int:
        """Delete finished jobs (succeeded and cancelled, and dead ones if asked) that finished
        more than N days ago on the database clock, ``batch_size`` at a time so no statement
        holds locks for long; return how many jobs were deleted."""
        old = self.prunable(older_than_days, include_dead=include_dead)
        manager = self.model._default_manager.using(self.db)
        deleted = 0
        while True:
            ids = list(old.order_by("pk").values_list("pk", flat=True)[:batch_size])
            if not ids:
                return deleted
            _, per_model = manager.filter(pk__in=ids).delete()
            deleted += per_model.get(self.model._meta.label, 0)

    def dead_letter_past_deadline(self, *, batch_size: int = 1000) -> int:
        """Dead-letter pending jobs whose deadline passed (database clock) although no claim
        came to settle them: parked jobs, jobs of a queue no worker serves, jobs scheduled
        past their own deadline. Return how many ended."""
        manager = self.model._default_manager.using(self.db)
        late = self.filter(state=JobState.PENDING, deadline__lt=Now())
        ended = 0
        while True:
            ids = list(late.order_by("pk").values_list("pk", flat=True)[:batch_size])
            if not ids:
                return ended
            # Conditional again: a job claimed since the read keeps running.
            ended += manager.filter(pk__in=ids, state=JobState.PENDING, deadline__lt=Now()).update(
                state=JobState.DEAD, dead_reason=DeadReason.DEADLINE, finished_at=Now())

    # -- admin views -------------------------------------------------------------------
    # Read-only views and conditional verbs for the admin. "Stalled" here is the design's
    # full definition: renewals stopped for more than two heartbeat periods, or the worker
    # that holds the claim is stopped or unseen for as long. Every comparison uses Now().

    def _stalled_q(self, heartbeat_seconds: float) -> Q:
        from .models import WorkerProcess

        gone = WorkerProcess.objects.using(self.db).gone(heartbeat_seconds).values("worker_id")
        return Q(state=JobState.CLAIMED, lease_expires_at__gte=Now()) & (
            Q(heartbeat_at__lt=Now() - Value(timedelta(seconds=2 * heartbeat_seconds)))
            | Q(claimed_by__in=gone)
        )

    def lease_valid(self) -> JobQuerySet:
        """Claimed with a lease that has not run out (healthy or stalled)."""
        return self.filter(state=JobState.CLAIMED, lease_expires_at__gte=Now())

    def stalled_claims(self, heartbeat_seconds: float) -> JobQuerySet:
        """Claimed with a valid lease, but silent for two heartbeat periods or its worker gone."""
        return self.filter(self._stalled_q(heartbeat_seconds))

    def with_lease_status(self, heartbeat_seconds: float) -> JobQuerySet:
        """Annotate ``db_now`` and ``lease_status`` (healthy, stalled, expired or None).

        ``db_now`` is the database clock of the same statement, so ages and countdowns shown
        from it never depend on the web server's clock.
        """
        return self.annotate(
            db_now=Now(),
            lease_status=Case(
                When(state=JobState.CLAIMED, lease_expires_at__lt=Now(), then=Value("expired")),
                When(self._stalled_q(heartbeat_seconds), then=Value("stalled")),
                When(state=JobState.CLAIMED, then=Value("healthy")),
                default=Value(None),
                output_field=models.CharField(),
            ),
        )

    def census(self) -> list[dict[str, Any]]:
        """Count jobs per (queue, task, state) in one GROUP BY: the admin's header and filters."""
        return list(
            self.order_by().values("queue_name", "task_path", "state")
            .annotate(n=models.Count("*")).order_by()
        )

    def expire_stalled_now(self, heartbeat_seconds: float) -> int:
        """End the lease of stalled claims only; the same UPDATE re-checks that each is stalled,
        so a claim whose worker renewed in the meantime keeps its lease."""
        return self.stalled_claims(heartbeat_seconds).expire_now()

    def purge_finished(self) -> int:
        """Delete succeeded and cancelled jobs (with their failure rows); return jobs deleted."""
        _, per_model = self.filter(
            state__in=[JobState.SUCCEEDED, JobState.CANCELLED]).delete()
        return per_model.get(self.model._meta.label, 0)

    def estimated_count(self) -> int | None:
        """The planner's row estimate for this queryset on PostgreSQL (None elsewhere).

        COUNT(*) reads every matching row; EXPLAIN reads statistics only, which is what a
        paginator over a million jobs can afford.
        """
        import json

        if connections[self.db].vendor != "postgresql":
            return None
        plan = json.loads(self.order_by().values("pk").explain(format="json"))
        if isinstance(plan, list):
            plan = plan[0]
        return int(plan["Plan"]["Plan Rows"])


    # -- worker verbs --

    @retry_deadlock_victims
    def ack_many(self, outcomes: Sequence[tuple[ClaimRef, Any]]) -> set[Any]:
        """Mark several jobs succeeded, each with its result, where the claim still owns
        the job; return the ids acknowledged. Raise InvalidJobArgument (nothing written) if
        a result does not round-trip through JSON.

        The owned rows are locked by a SELECT ... FOR UPDATE before the one UPDATE, so the
        answer names exactly the rows this call moved (the UPDATE clears the tokens that
        would otherwise tell them apart).
        """
        results = {c.pk: ensure_json(r, "result") for c, r in outcomes}
        if not results:
            return set()
        db = self._db or router.db_for_write(self.model)
        if _pg(db):
            return _pg_ids(self.model, db, _PG_ACK, {
                "ids": [c.pk for c, _ in outcomes], "tokens": [c.claim_token for c, _ in outcomes],
                "results": [_pg_json(results[c.pk]) for c, _ in outcomes]})
        owned = self.model._default_manager.using(db).filter(
            pk__in=list(results), claim_token__in=[c.claim_token for c, _ in outcomes],
            state=JobState.CLAIMED)
        with transaction.atomic(using=db):
            ids = set(owned.select_for_update().values_list("pk", flat=True))
            if not ids:
                return set()
            result: Any = None
            if any(results[pk] is not None for pk in ids):
                result = Case(
                    *[When(pk=pk, then=Value(results[pk], output_field=models.JSONField()))
                      for pk in ids],
                    output_field=models.JSONField(),
                )
            owned.filter(pk__in=ids).update(
                state=JobState.SUCCEEDED, result=result, finished_at=Now(),
                claim_token=None, lease_expires_at=None,
            )
        return ids

    def listen(self) -> Any:
        """Open a dedicated autocommit connection that LISTENs for enqueue wake-ups.

        Return the psycopg connection (iterate ``.notifies(timeout=...)``; payloads are
        queue names; ``.close()`` it when done), or None unless the database is PostgreSQL.
        It stands apart from Django's connections, so CONN_MAX_AGE and transactions never
        touch it.
        """
        db = self._db or router.db_for_write(self.model)
        if connections[db].vendor != "postgresql":
            return None
        wrapper = connections.create_connection(db)
        wrapper.ensure_connection()
        raw = wrapper.connection
        raw.autocommit = True
        raw.execute(f'LISTEN "{NOTIFY_CHANNEL}"')
        return raw

    # -- backend verbs --

    def with_failures(self, ids: Iterable[Any]) -> list[Job]:
        """The jobs ``ids`` with their failures loaded: what the Django Tasks backend turns
        into TaskResults, for any number of jobs in two statements."""
        return list(self.filter(pk__in=list(ids)).prefetch_related("failures"))

    # -- advisor --

    def handler_durations(self, since_days: float | None = None) -> models.QuerySet:
        """(task_path, lease_seconds, duration) of succeeded jobs, finished in the last
        ``since_days`` days if given. ``duration`` is finished_at - last_attempted_at, the
        last attempt from claim to acknowledgement: both stamps come from the database
        clock, so the difference holds whatever the workers' clocks say."""
        finished = self.filter(state=JobState.SUCCEEDED, last_attempted_at__isnull=False,
                               finished_at__isnull=False)
        if since_days is not None:
            finished = finished.filter(
                finished_at__gte=Now() - Value(timedelta(days=_seconds("since_days", since_days))))
        return finished.order_by().annotate(
            duration=models.ExpressionWrapper(F("finished_at") - F("last_attempted_at"),
                                              output_field=models.DurationField()),
        ).values_list("task_path", "lease_seconds", "duration")


# -- PostgreSQL: one round trip per claim, renewal and batch of acks -----------------------
# The same predicates as the ORM verbs above, written as single UPDATE ... RETURNING
# statements so a worker pays one round trip where the portable path pays four
# (BEGIN, SELECT ... FOR UPDATE, UPDATE, COMMIT). statement_timestamp() is what Django's
# Now() compiles to on PostgreSQL: the same database clock.

_PG_CLAIM = """
WITH due AS (
    -- An ordered scan of leases_job_due_idx: the first rows in claim order, not a sort
    -- of every pending job.
    SELECT id, priority, available_at FROM {job}
    WHERE state = 'pending' AND available_at <= statement_timestamp(){queue_filter}
      AND (deadline IS NULL OR deadline >= statement_timestamp())
    ORDER BY priority DESC, available_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), expired AS (
    -- Claims whose lease ran out (leases_job_claimed_idx); usually none. Those that end
    -- instead of running again (past deadline, no attempts left, a task that must not run
    -- twice) are left to the portable path, which settles them.
    SELECT id, priority, available_at FROM {job}
    WHERE state = 'claimed' AND lease_expires_at < statement_timestamp(){queue_filter}
      AND (deadline IS NULL OR deadline >= statement_timestamp())
      AND on_lease_lost = 'retry' AND attempts < max_attempts
    ORDER BY lease_expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT c.id, j.state AS was_state, j.claimed_by AS was_claimed_by, j.fence AS was_fence,
           j.attempts AS was_attempts,
           -- The lease its last claim or renewal granted (both times from one statement).
           round(extract(epoch FROM j.lease_expires_at - j.heartbeat_at), 1)::float8
               AS was_lease
    FROM (SELECT * FROM due UNION ALL SELECT * FROM expired) AS c JOIN {job} AS j ON j.id = c.id
    ORDER BY c.priority DESC, c.available_at, c.id
    LIMIT %(limit)s
), claimed AS (
    UPDATE {job} AS j SET
        leases_lost = j.leases_lost + CASE WHEN j.state = 'claimed' THEN 1 ELSE 0 END,
        state = 'claimed',
        claim_token = gen_random_uuid(),
        fence = j.fence + 1,
        attempts = j.attempts + 1,
        claimed_by = %(worker)s,
        lease_expires_at = statement_timestamp()
            + make_interval(secs => COALESCE(%(lease)s::float8, j.lease_seconds)),
        heartbeat_at = statement_timestamp(),
        last_attempted_at = statement_timestamp(),
        started_at = COALESCE(j.started_at, statement_timestamp())
    FROM picked AS c
    WHERE j.id = c.id
    RETURNING j.*, c.was_state, c.was_claimed_by, c.was_fence, c.was_attempts, c.was_lease
), lost AS (
    -- A takeover records the expired claim as a spent attempt, in the same statement.
    INSERT INTO {failure} (job_id, attempt, fence, worker_id, kind, exception_class_path,
                           message, traceback, recorded_at)
    SELECT id, was_attempts, was_fence, was_claimed_by, 'lease_expired', '',
           -- As _expiry_message() words it.
           CASE WHEN was_lease >= {min_lease}
                THEN format('lease of %%s s ran out before %%s acknowledged',
                            trim_scale(was_lease::numeric),
                            COALESCE(NULLIF(was_claimed_by, ''), 'its worker'))
                ELSE format('lease was ended early, before %%s acknowledged',
                            COALESCE(NULLIF(was_claimed_by, ''), 'its worker')) END,
           '', statement_timestamp()
    FROM claimed WHERE was_state = 'claimed'
)
SELECT * FROM claimed ORDER BY priority DESC, available_at, id
"""

_PG_RENEW = """
UPDATE {job} AS j SET
    lease_expires_at = statement_timestamp()
        + make_interval(secs => COALESCE(%(lease)s::float8, v.lease)),
    heartbeat_at = statement_timestamp()
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(leases)s::float8[]) AS v(id, token, lease)
WHERE j.id = v.id AND j.claim_token = v.token AND j.state = 'claimed'
RETURNING j.id
"""

_PG_ACK = """
UPDATE {job} AS j SET
    state = 'succeeded', result = v.result, finished_at = statement_timestamp(),
    claim_token = NULL, lease_expires_at = NULL
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(results)s::jsonb[]) AS v(id, token, result)
WHERE j.id = v.id AND j.claim_token = v.token AND j.state = 'claimed'
RETURNING j.id
"""


def _pg(db: str) -> bool:
    return connections[db].vendor == "postgresql"


def _pg_sql(template: str, model: Any, db: str, *, all_queues: bool = False) -> str:
    """``template`` for ``model``'s tables; the claim's queue filter left out for a claim
    of every queue (the due half is then the same ordered index scan, unfiltered)."""
    from .models import JobFailure

    quote = connections[db].ops.quote_name
    return template.format(job=quote(model._meta.db_table), failure=quote(JobFailure._meta.db_table),
                           queue_filter="" if all_queues else "\n      AND queue_name = ANY(%(queues)s)",
                           min_lease=f"{conf.MIN_LEASE_SECONDS:g}")


def _pg_ids(model: Any, db: str, template: str, params: dict[str, Any]) -> set[Any]:
    with connections[db].cursor() as cursor:
        cursor.execute(_pg_sql(template, model, db), params)
        return {row[0] for row in cursor.fetchall()}


def _pg_claim(model: Any, db: str, worker_id: str, queues: list[str] | None, limit: int,
              lease: float | None) -> list[Any]:
    """Claim in one statement; the jobs carry their state before the claim on ``was_*``."""
    sql = _pg_sql(_PG_CLAIM, model, db, all_queues=queues is None)
    return list(model._default_manager.using(db).raw(
        sql, {"worker": worker_id, "queues": queues, "limit": limit, "lease": lease}))


def _pg_json(value: Any) -> str | None:
    import json

    return None if value is None else json.dumps(value)


# -- PostgreSQL: enqueue in one constant statement ------------------------------------------
# The ORM's INSERT is compiled anew for every row (and for every batch of a bulk_create, a
# statement with one placeholder per row and column); this one is a constant string whatever
# the row count: the options every job of a call shares are scalars, the args and kwargs are
# one array each. The due time and the deadline are the caller's absolute time or the
# database clock plus an interval, as Now() + interval is on the ORM path. The statement
# trigger of migration 0007 sends the NOTIFY, as for any INSERT.

_PG_ENQUEUE = """
INSERT INTO {job} (task_path, queue_name, priority, lease_seconds, max_attempts, retry,
                   on_lease_lost, unique_key, run_after, available_at, deadline,
                   state, fence, attempts, leases_lost, claimed_by, dead_reason, args, kwargs)
{rows}
{on_conflict}RETURNING id, enqueued_at, available_at, deadline, active_key
"""
# What every job of one call gets: the call's options, the due time and deadline from the
# caller's own time or the database clock plus an interval, the model's defaults.
_PG_SHARED = """%(task_path)s::varchar, %(queue_name)s::varchar, %(priority)s::smallint,
    %(lease_seconds)s::float8, %(max_attempts)s::integer, %(retry)s::jsonb,
    %(on_lease_lost)s::varchar, %(unique_key)s::varchar, %(run_after)s::timestamptz,
    COALESCE(%(run_after)s::timestamptz, statement_timestamp() + %(delay)s::interval),
    COALESCE(%(deadline)s::timestamptz, statement_timestamp() + %(max_age)s::interval),
    'pending', 0, 0, 0, '', ''"""
# One job: plain VALUES, which the server plans in half the time of a SELECT.
_PG_ONE_ROW = f"VALUES ({_PG_SHARED}, %(args)s::jsonb, %(kwargs)s::jsonb)"
# Many: unnest() yields the rows in array order.
_PG_ROWS = f"""SELECT {_PG_SHARED}, v.args, v.kwargs
FROM unnest(%(args)s::jsonb[], %(kwargs)s::jsonb[]) AS v(args, kwargs)"""
# ... answered in one row: the ids, drawn from the sequence in the order of insertion, and
# the times, which are the same for every row of one statement (statement_timestamp() and
# the call's own options), so that the client parses one row, not three times per job.
_PG_MANY = """WITH inserted AS ({insert})
SELECT array_agg(id ORDER BY id), min(enqueued_at), min(available_at), min(deadline) FROM inserted"""
# A held unique key inserts nothing and returns no row: no error, so no savepoint either.
_PG_KEY_HELD = "ON CONFLICT (active_key) DO NOTHING\n"
# The columns of Job the INSERT returns, in the order of its RETURNING.
_RETURNED = ("id", "enqueued_at", "available_at", "deadline", "active_key")

_pg_enqueue_cache: dict[tuple[str, str, bool], str] = {}


def _pg_enqueue_sql(model: Any, db: str, rows: str, unique: bool) -> str:
    key = (model._meta.db_table, rows, unique)
    if key not in _pg_enqueue_cache:
        table = connections[db].ops.quote_name(model._meta.db_table)
        insert = _PG_ENQUEUE.format(job=table, rows=rows, on_conflict=_PG_KEY_HELD if unique else "")
        _pg_enqueue_cache[key] = insert if rows == _PG_ONE_ROW else _PG_MANY.format(insert=insert)
    return _pg_enqueue_cache[key]


def _json_text(value: Any) -> str:
    import json

    return json.dumps(value) if value else ("[]" if isinstance(value, list) else "{}")


def _pg_insert_one(model: Any, db: str, fields: JobFields, args: list[Any],
                   kwargs: dict[str, Any]) -> Job | None:
    """One INSERT ... RETURNING; None when an active job holds the unique key."""
    params = fields.pg_params()
    params["args"], params["kwargs"] = _json_text(args), _json_text(kwargs)
    sql = _pg_enqueue_sql(model, db, _PG_ONE_ROW, fields.unique_key is not None)
    with connections[db].cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return None if row is None else _saved_jobs(model, db, fields, [(args, kwargs)], [row])[0]


def _pg_insert_many(model: Any, db: str, fields: JobFields, calls: list[tuple[list, dict]],
                    batch_size: int | None) -> list[tuple]:
    """One INSERT ... SELECT FROM unnest(args[], kwargs[]) per ``batch_size`` calls, in one
    transaction (as bulk_create): all the jobs or none. Answer the RETURNING columns of
    each job, in the order of the calls."""
    if not calls:
        return []
    sql = _pg_enqueue_sql(model, db, _PG_ROWS, False)
    params = fields.pg_params()
    rows: list[tuple] = []
    with transaction.atomic(using=db, savepoint=False), connections[db].cursor() as cursor:
        for batch in _batches(calls, batch_size):
            params["args"] = [_json_text(args) for args, _ in batch]
            params["kwargs"] = [_json_text(kwargs) for _, kwargs in batch]
            cursor.execute(sql, params)
            ids, enqueued_at, available_at, deadline = cursor.fetchone()
            rows.extend((pk, enqueued_at, available_at, deadline, None) for pk in ids)
    return rows


def _batches(calls: list[tuple[list, dict]], batch_size: int | None) -> Iterable[list[tuple[list, dict]]]:
    """``calls`` in slices of ``batch_size`` (None: one slice), as bulk_create takes it."""
    size = batch_size or len(calls)
    return (calls[start:start + size] for start in range(0, len(calls), size))


def _saved_jobs(model: Any, db: str, fields: JobFields, calls: list[tuple[list, dict]],
                rows: list[tuple]) -> list[Job]:
    """The jobs as saved, without a second query: what the call wrote, the model's defaults
    for the columns it left alone, and what the database computed (RETURNING)."""
    layout = _job_layout(model)
    template = [*layout.defaults]
    for name, value in fields.columns().items():
        template[layout.slot[name]] = value
    jobs = []
    for (args, kwargs), row in zip(calls, rows, strict=True):
        values = template.copy()
        for slot, value in zip(layout.per_row, (args, kwargs, fields.retry_json(), *row), strict=True):
            values[slot] = value
        jobs.append(model.from_db(db, layout.names, values))
    return jobs


@dataclass(frozen=True)
class _Layout:
    """A model's concrete columns in order, their defaults, the position of each, and where
    each job's own values go (args, kwargs, its fresh retry JSON, the RETURNING columns)."""

    names: list[str]
    defaults: list[Any]  # callable defaults (args, kwargs) are always replaced
    slot: dict[str, int]
    per_row: tuple[int, ...]


_layouts: dict[Any, _Layout] = {}


def _job_layout(model: Any) -> _Layout:
    if model not in _layouts:
        fields = model._meta.concrete_fields
        slot = {f.attname: i for i, f in enumerate(fields)}
        _layouts[model] = _Layout([f.attname for f in fields], [f.get_default() for f in fields], slot,
                                  tuple(slot[n] for n in ("args", "kwargs", "retry", *_RETURNED)))
    return _layouts[model]


# Enqueue wake-ups on PostgreSQL (sent by the trigger of migration 0007): the payload is the
# queue name.
NOTIFY_CHANNEL = "django_leases"


class WorkerQuerySet(models.QuerySet):
    """The worker processes' own rows (times on the database clock)."""

    def register(self, worker_id: str, *, hostname: str, pid: int, queues: list[str]) -> None:
        self.update_or_create(
            worker_id=worker_id,
            defaults={"hostname": hostname, "pid": pid, "queues": queues,
                      "started_at": Now(), "last_seen_at": Now(), "stopped_at": None},
        )

    def seen(self, worker_id: str) -> int:
        return self.filter(worker_id=worker_id).update(last_seen_at=Now())

    def stopped(self, worker_id: str) -> int:
        return self.filter(worker_id=worker_id).update(last_seen_at=Now(), stopped_at=Now())

    # -- admin views -------------------------------------------------------------------

    def _gone_q(self, heartbeat_seconds: float) -> Q:
        return Q(stopped_at__isnull=False) | Q(
            last_seen_at__lt=Now() - Value(timedelta(seconds=2 * heartbeat_seconds)))

    def gone(self, heartbeat_seconds: float) -> WorkerQuerySet:
        """Stopped, or not seen for more than two heartbeat periods (database clock)."""
        return self.filter(self._gone_q(heartbeat_seconds))

    def with_claims(self, heartbeat_seconds: float) -> WorkerQuerySet:
        """Annotate ``db_now``, ``claims_held``, ``claims_expired`` and ``looks_gone``."""
        from django.db.models.functions import Coalesce

        from .models import Job

        def count(**lookups: Any) -> Any:
            held = (Job.objects.using(self.db)
                    .filter(state=JobState.CLAIMED, claimed_by=models.OuterRef("worker_id"), **lookups)
                    .order_by().values("claimed_by").annotate(n=models.Count("*")).values("n"))
            return Coalesce(models.Subquery(held), 0)

        return self.annotate(
            db_now=Now(),
            claims_held=count(),
            claims_expired=count(lease_expires_at__lt=Now()),
            looks_gone=Case(When(self._gone_q(heartbeat_seconds), then=Value(True)),
                            default=Value(False), output_field=models.BooleanField()),
        )
