"""The statements on periodic schedules: sync from code, the tick decision, the operator's
pause, resume and run-now, and the pruning of their run records.

A tick becomes a job only through one conditional UPDATE of the schedule's row (its
revision and last tick as read, on the database clock): the worker whose UPDATE touched
the row inserts the job in the same transaction; every other worker touched nothing and
inserts nothing. No leader, no extra process: any worker may decide, one of them does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.db import IntegrityError, connections, models, router, transaction
from django.db.models import F, Q, Value
from django.db.models.functions import Now

from .enqueue import insert_job
from .enqueue_options import JobFields
from .exceptions import DuplicateJob, InvalidSchedule
from .jsonsafe import shown
from .schedules import Periodic, ScheduleSpec, first_tick, plan
from .states import ACTIVE_STATES

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .models import Schedule, ScheduleRun  # noqa: F401 -- ScheduleRun: a base class's string


# How long a decision's transaction may sit idle (its worker stopped, SIGSTOP) before the
# server ends it and frees the row for the other workers: PostgreSQL and MariaDB.
IDLE_DECISION_SECONDS = 5


class RunKind(models.TextChoices):
    TICK = "tick", "tick"
    SKIPPED = "skipped", "skipped (previous job still active)"
    RUN_NOW = "run_now", "run now"


@dataclass
class SyncReport:
    """What a sync changed, by schedule name. ``taken``: the changed rows another backend
    held (not removed), by the backend they were taken from."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    taken: dict[str, str] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TickOutcome:
    """One decision this process won: the jobs it made, the ticks it skipped or missed."""

    name: str
    jobs: list[Any]
    skipped: int
    misfired: int


def _utc(value: datetime) -> datetime:
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


@contextmanager
def _bounded_idle(db: str, outer: bool) -> Iterator[None]:
    """Inside a decision's transaction: if this process stops (SIGSTOP, a debugger), the
    server ends the transaction after IDLE_DECISION_SECONDS, rolling it back and freeing
    the row; on SQLite one writer holds the whole database anyway. Not inside a caller's
    own transaction (``outer``), whose idle time is the caller's business."""
    if outer:
        yield
        return
    vendor = connections[db].vendor
    mariadb = getattr(connections[db], "mysql_is_mariadb", False)
    with connections[db].cursor() as cursor:
        if vendor == "postgresql":
            cursor.execute(
                f"SET LOCAL idle_in_transaction_session_timeout = '{IDLE_DECISION_SECONDS}s'"
            )
        elif mariadb:
            cursor.execute(f"SET SESSION idle_transaction_timeout = {IDLE_DECISION_SECONDS}")
    try:
        yield
    finally:
        if mariadb:
            with connections[db].cursor() as cursor:
                cursor.execute("SET SESSION idle_transaction_timeout = DEFAULT")


class ScheduleQuerySet(models.QuerySet["Schedule"]):
    """Schedules, and every statement that moves one."""

    if TYPE_CHECKING:
        _db: str | None

    def _db_name(self) -> str:
        return self._db or router.db_for_write(self.model)

    def live(self, alias: str | None = None) -> ScheduleQuerySet:
        """Declared in code (not removed) and not paused."""
        qs = self.filter(removed_at__isnull=True, paused=False)
        return qs if alias is None else qs.filter(backend=alias)

    def due(self, alias: str) -> ScheduleQuerySet:
        """Live schedules whose next tick has come on the database clock, or that have no
        next tick yet (new, resumed or changed: planned from the database's now)."""
        return (
            self.live(alias)
            .filter(Q(next_tick_at__isnull=True) | Q(next_tick_at__lte=Now()))
            .annotate(db_now=Now())
            .order_by("next_tick_at", "pk")
        )

    # -- sync from code ----------------------------------------------------------------

    def sync(self, alias: str, specs: Iterable[ScheduleSpec]) -> SyncReport:
        """Make the rows of backend ``alias`` say what the code declares: add new
        schedules, update changed ones (re-planned from the next decision), mark the ones
        no longer declared as removed (they stop ticking; their history stays). Pause
        switches and last ticks are kept. Safe to run from many workers at once."""
        wanted = {spec.name: spec for spec in specs}
        for _ in range(2):
            # Another worker may add a schedule between this one's locking read (which
            # locks no row that is not there yet) and its insert: read again, and the row
            # is there to lock and compare.
            with suppress(IntegrityError):
                return self._sync_once(alias, wanted)
        return self._sync_once(alias, wanted)

    def _sync_once(self, alias: str, wanted: dict[str, ScheduleSpec]) -> SyncReport:
        db = self._db_name()
        manager = self.model._default_manager.using(db)
        report = SyncReport()
        with transaction.atomic(using=db):
            rows = {s.name: s for s in manager.select_for_update().filter(name__in=list(wanted))}
            for name, spec in wanted.items():
                row = rows.get(name)
                if row is None:
                    manager.create(
                        name=name, backend=alias, task_path=spec.task_path, spec=spec.to_json()
                    )
                    report.added.append(name)
                elif (
                    row.spec != spec.to_json()
                    or row.task_path != spec.task_path
                    or row.backend != alias
                    or row.removed_at is not None
                ):
                    manager.filter(pk=row.pk).update(
                        backend=alias,
                        task_path=spec.task_path,
                        spec=spec.to_json(),
                        removed_at=None,
                        next_tick_at=None,
                        revision=F("revision") + 1,
                        synced_at=Now(),
                    )
                    report.changed.append(name)
                    if row.backend != alias and row.removed_at is None:
                        report.taken[name] = row.backend
                else:
                    report.unchanged.append(name)
            gone = manager.filter(backend=alias, removed_at__isnull=True).exclude(
                name__in=list(wanted)
            )
            report.removed = sorted(gone.values_list("name", flat=True))
            gone.update(removed_at=Now(), next_tick_at=None, revision=F("revision") + 1)
        return report

    # -- the tick ----------------------------------------------------------------------

    def enqueue_due(
        self,
        alias: str,
        fields_for: Callable[[Schedule], JobFields | None],
        left_alone: Callable[[Schedule, InvalidSchedule], None] | None = None,
        failed: Callable[[Schedule, Exception], None] | None = None,
        decided: Callable[[Schedule], None] | None = None,
    ) -> list[TickOutcome]:
        """Decide every due schedule of backend ``alias``: for each, one conditional
        UPDATE of its row decides whether this process makes its ticks' jobs. Return the
        decisions this process won (those that made or skipped ticks).

        ``fields_for(schedule)`` answers what its task's jobs get, or None when this
        process cannot enqueue that task (code of another version): the schedule is left
        to the workers that can. A row whose stored schedule this version cannot read is
        left too, and told to ``left_alone(schedule, error)``; a decision that raises is
        rolled back alone and told to ``failed(schedule, error)`` (the worker logs both);
        one this process made, ticks or not, is told to ``decided(schedule)``."""
        db = self._db_name()
        outcomes = []
        for row in list(self.using(db).due(alias)):
            fields = fields_for(row)
            if fields is None:
                continue
            try:
                # decide() is its own transaction (a savepoint inside a caller's): a
                # schedule that fails rolls back alone and the pass goes on to the others.
                outcome = self.using(db).decide(row, fields)
            except InvalidSchedule as e:
                if left_alone is not None:
                    left_alone(row, e)
                continue
            except Exception as e:  # one schedule's failure is its own
                if failed is not None:
                    failed(row, e)
                continue
            if outcome is not None and decided is not None:
                decided(row)
            if outcome is not None and (outcome.jobs or outcome.skipped or outcome.misfired):
                outcomes.append(outcome)
        return outcomes

    def decide(self, row: Schedule, fields: JobFields) -> TickOutcome | None:
        """The due ticks of ``row`` (as read, with the database's now in ``db_now``),
        enqueued if this process's conditional UPDATE touches the row; None when another
        worker decided first (0 rows: discard), or the row is locked by one deciding now."""
        db = self._db_name()
        manager = self.model._default_manager.using(db)
        periodic = Periodic.from_json(row.spec, name=row.name)
        now = _utc(row.db_now)  # type: ignore[attr-defined]
        as_read = Q(pk=row.pk, revision=row.revision, paused=False, removed_at__isnull=True)
        as_read &= (
            Q(last_tick_at__isnull=True)
            if row.last_tick_at is None
            else Q(last_tick_at=row.last_tick_at)
        )
        outer = connections[db].in_atomic_block
        with transaction.atomic(using=db), _bounded_idle(db, outer):
            # A row another worker is deciding is left to it (no waiting behind a stopped
            # process); the UPDATE's rowcount still decides on databases without SKIP LOCKED.
            skip_locked = connections[db].features.has_select_for_update_skip_locked
            if skip_locked and not list(
                manager.select_for_update(skip_locked=True).filter(as_read).values_list("pk")
            ):
                return None
            if row.next_tick_at is None:
                # New, resumed or changed: plan the first tick after the database's now.
                touched = manager.filter(as_read).update(
                    next_tick_at=first_tick(periodic, now), revision=F("revision") + 1
                )
                return None if touched != 1 else TickOutcome(row.name, [], 0, 0)
            the_plan = plan(periodic, _utc(row.next_tick_at), now)
            touched = manager.filter(as_read).update(
                last_tick_at=the_plan.latest,
                next_tick_at=the_plan.next,
                decided_at=Now(),
                ticks=F("ticks") + the_plan.due,
                misfires=F("misfires") + the_plan.misfired,
                revision=F("revision") + 1,
            )
            if touched != 1:
                return None  # another worker decided these ticks
            return self._make_jobs(row, periodic, the_plan.run, the_plan.misfired, fields)

    def _make_jobs(
        self,
        row: Schedule,
        periodic: Periodic,
        ticks: list[datetime],
        misfired: int,
        fields: JobFields,
    ) -> TickOutcome:
        """The jobs of the ticks this process owns, in the decision's transaction."""
        db = self._db_name()
        Job = apps.get_model("django_leases", "Job")
        Run = apps.get_model("django_leases", "ScheduleRun")
        manager = self.model._default_manager.using(db)
        if fields.unique_key is not None:
            # A held key skips the tick: merging would hand back a job some other call made.
            fields = replace(fields, on_duplicate="refuse")
        jobs: list[Any] = []
        skipped = 0
        last_job_id = row.last_job_id
        for tick in ticks:
            if periodic.overlap == "skip" and last_job_id is not None:
                active = (
                    Job._default_manager.using(db)
                    .filter(pk=last_job_id, state__in=ACTIVE_STATES)
                    .exists()
                )
                if active:
                    Run._default_manager.using(db).create(
                        schedule_id=row.pk, tick_at=tick, kind=RunKind.SKIPPED
                    )
                    skipped += 1
                    continue
            try:
                job = insert_job(Job, db, fields, list(periodic.args), dict(periodic.kwargs))
            except DuplicateJob:
                # The task's unique_key is held: the tick is skipped, as an overlap is.
                Run._default_manager.using(db).create(
                    schedule_id=row.pk, tick_at=tick, kind=RunKind.SKIPPED
                )
                skipped += 1
                continue
            Run._default_manager.using(db).create(
                schedule_id=row.pk, tick_at=tick, kind=RunKind.TICK, job_id=job.pk
            )
            jobs.append(job)
            last_job_id = job.pk
        if jobs or skipped:
            changes: dict[str, Any] = {"skipped": F("skipped") + skipped}
            if jobs:
                # Only a job made here: what was read may have been deleted since.
                changes["last_job_id"] = last_job_id
            manager.filter(pk=row.pk).update(**changes)
        return TickOutcome(row.name, jobs, skipped, misfired)

    # -- the operator's verbs ----------------------------------------------------------

    def pause(self) -> int:
        """Stop these schedules ticking; they keep their place (last tick, history)."""
        return self.filter(paused=False).update(paused=True, revision=F("revision") + 1)

    def resume(self) -> int:
        """Tick again from the next tick after the database's now: ticks that fell while
        paused are not run, nor counted as misfires."""
        return self.filter(paused=True).update(
            paused=False, next_tick_at=None, revision=F("revision") + 1
        )

    def run_now(self, schedule: Schedule, fields: JobFields | None = None) -> Any:
        """Enqueue one job of ``schedule`` now, with its arguments; not a tick (the
        schedule's last tick and next tick stay as they are). ``fields``: what the job is
        enqueued with, by default what its task's backend gives it (fields_for()). A held
        ``unique_key`` raises DuplicateJob whatever the task's on_duplicate: merging would
        link a job some other call made to this schedule. A schedule the code no longer
        declares (removed_at set) raises ValueError: what it would run is no longer asked
        for; LookupError when this process declares no such task."""
        if not isinstance(schedule, self.model):
            raise TypeError(
                f"schedule: must be a {self.model.__name__} row "
                f"(Schedule.objects.get(name=...)), got {shown(schedule)}"
            )
        if schedule.removed_at is not None:
            raise ValueError("removed from the code: it runs no more, even by hand")
        if fields is None:
            fields = fields_for(schedule)
        db = self._db_name()
        if fields.unique_key is not None:
            fields = replace(fields, on_duplicate="refuse")
        Job = apps.get_model("django_leases", "Job")
        Run = apps.get_model("django_leases", "ScheduleRun")
        periodic = Periodic.from_json(schedule.spec, name=schedule.name)
        with transaction.atomic(using=db):
            job = insert_job(Job, db, fields, list(periodic.args), dict(periodic.kwargs))
            Run._default_manager.using(db).create(
                schedule_id=schedule.pk, tick_at=None, kind=RunKind.RUN_NOW, job_id=job.pk
            )
        return job


def fields_for(schedule: Schedule) -> JobFields:
    """What the schedule's task enqueues with, as its backend says; LookupError when this
    process declares no such task (the code no longer has it)."""
    from django.conf import settings
    from django.tasks import task_backends

    from . import registry

    if schedule.backend not in getattr(settings, "TASKS", {}):
        raise LookupError(f"its backend {schedule.backend!r} is no longer in settings.TASKS")
    task = registry.lookup(schedule.backend, schedule.task_path)
    if task is None:
        registry.discover()
        task = registry.lookup(schedule.backend, schedule.task_path)
    if task is None:
        raise LookupError(f"no task {schedule.task_path!r} is declared")
    fields: JobFields = task_backends[schedule.backend].job_fields(task)  # type: ignore[attr-defined]
    return fields


class ScheduleRunQuerySet(models.QuerySet["ScheduleRun"]):
    """A schedule's run records: kept while their job is, and a while after."""

    if TYPE_CHECKING:
        _db: str | None

    def prunable(self, older_than_days: float, *, jobs: Any = None) -> ScheduleRunQuerySet:
        """Records with no job (skipped ticks, runs whose job was pruned or deleted)
        recorded more than N days ago on the database clock. A record whose job still
        exists stays, however old: it is how that job names its schedule. With ``jobs``
        (the jobs a prune is about to delete), also their records, as a dry run counts."""
        without = Q(job__isnull=True) if jobs is None else Q(job__isnull=True) | Q(job__in=jobs)
        return self.filter(without, recorded_at__lt=Now() - Value(timedelta(days=older_than_days)))

    def prune(self, older_than_days: float, *, batch_size: int = 1000) -> int:
        """Delete the prunable records in batches of ``batch_size`` in primary-key order,
        each one short statement that re-checks the condition; return how many went. The
        schedule's counters (ticks, skipped, misfires) keep the totals."""
        db = self._db or router.db_for_write(self.model)
        old = self.using(db).prunable(older_than_days)
        deleted, after = 0, 0
        while True:
            ids = list(
                old.filter(pk__gt=after).order_by("pk").values_list("pk", flat=True)[:batch_size]
            )
            if not ids:
                return deleted
            n, _ = old.filter(pk__in=ids).delete()
            deleted += n
            after = ids[-1]
