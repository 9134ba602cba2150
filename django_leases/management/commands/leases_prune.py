"""Dead-letter pending jobs past their deadline, then delete finished jobs past the
backend's retention, and the schedule run records left without a job, in batches, and the
rows of workers gone that long. Run it from cron (hourly is plenty)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError
from django.db.models.functions import Now

from django_leases.conf import MAX_INTERVAL_DAYS, checked_number, get_options, lease_backend
from django_leases.enqueue import migrated
from django_leases.exceptions import InvalidLeaseOption
from django_leases.management import LeasesCommand, require_migrated
from django_leases.models import Job, ScheduleRun, WorkerProcess
from django_leases.states import JobState

# The most jobs one of its statements deletes.
MAX_BATCH_SIZE = 10_000


class Command(LeasesCommand):
    help = (
        "Dead-letter pending jobs past their deadline, then delete succeeded and cancelled "
        "jobs (and with --include-dead, dead ones) that finished more than RETENTION_DAYS "
        "ago on the database clock, and schedule run records left without a job (skipped "
        "ticks, runs of deleted jobs) recorded more than RETENTION_DAYS ago, and the rows of "
        "workers stopped or silent more than RETENTION_DAYS (and a day) ago."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--backend",
            default=None,
            help="TASKS alias (default: the first django_leases backend).",
        )
        parser.add_argument(
            "--older-than-days",
            type=float,
            default=None,
            help="Override the backend's RETENTION_DAYS.",
        )
        parser.add_argument(
            "--include-dead",
            action="store_true",
            help="Also delete dead-lettered jobs past retention.",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=1000,
            help="Jobs (or schedule runs) deleted per statement (default 1000, at most "
            f"{MAX_BATCH_SIZE:,}).",
        )
        parser.add_argument("--dry-run", action="store_true", help="Count, delete nothing.")

    verbosity = 1

    def _say(self, line: str) -> None:
        """A line of the report, unless -v 0 (cron: no mail for a run that went as usual)."""
        if self.verbosity:
            self.stdout.write(line)

    def handle(
        self,
        *args: Any,
        backend: str | None,
        older_than_days: float | None,
        include_dead: bool,
        batch_size: int,
        dry_run: bool,
        **options: Any,
    ) -> None:
        self.verbosity = options["verbosity"]
        try:
            lease_options = get_options(lease_backend(backend, "--backend"))
        except InvalidLeaseOption as e:
            raise CommandError(str(e)) from e
        days = lease_options.retention_days if older_than_days is None else older_than_days
        try:
            checked_number("--older-than-days", days, low=0, high=MAX_INTERVAL_DAYS)
        except InvalidLeaseOption as e:
            raise CommandError(str(e)) from e
        if not 1 <= batch_size <= MAX_BATCH_SIZE:
            # Above it a DataError traceback (a LIMIT past bigint), or one statement holding
            # its locks for long and more ids than SQLite binds.
            raise CommandError(
                f"--batch-size: must be at least 1 and at most {MAX_BATCH_SIZE:,}, got {batch_size}"
            )
        # Checked before anything is written: a missing table met halfway would leave jobs
        # pruned and the run reported as failed.
        with migrated(Job, lease_options.database, CommandError):
            require_migrated(lease_options.database)
            self._prune(lease_options.database, days, include_dead, batch_size, dry_run)

    def _prune(
        self, database: str, days: float, include_dead: bool, batch_size: int, dry_run: bool
    ) -> None:
        jobs = Job.objects.using(database)
        runs = ScheduleRun.objects.using(database)
        workers = WorkerProcess.objects.using(database)
        if dry_run:
            late = jobs.filter(state=JobState.PENDING, deadline__lt=Now()).count()
            prunable = jobs.all().prunable(days, include_dead=include_dead)
            count = prunable.count()
            self._say(f"Would dead-letter {_count(late, 'pending job')} past their deadline.")
            self._say(f"Would delete {_count(count, 'job')} finished more than {_days(days)} ago.")
            count = runs.prunable(days, jobs=prunable).count()
            self._say(
                f"Would delete {_count(count, 'schedule run')} recorded more than "
                f"{_days(days)} ago, of those jobs or without a job."
            )
            count = workers.prunable(days).count()
            self._say(
                f"Would delete {_count(count, 'worker row')} gone more than "
                f"{_days(max(days, 1.0))} ago."
            )
            return
        late = jobs.all().dead_letter_past_deadline(batch_size=batch_size)
        self._say(f"Dead-lettered {_count(late, 'pending job')} past their deadline.")
        deleted = jobs.all().prune(days, include_dead=include_dead, batch_size=batch_size)
        self._say(f"Deleted {_count(deleted, 'job')} finished more than {_days(days)} ago.")
        deleted = runs.prune(days, batch_size=batch_size)
        self._say(
            f"Deleted {_count(deleted, 'schedule run')} without a job recorded more than "
            f"{_days(days)} ago."
        )
        deleted = workers.prune(days)  # a day at least: a worker silent for less may be alive
        self._say(
            f"Deleted {_count(deleted, 'worker row')} gone more than {_days(max(days, 1.0))} ago."
        )


def _count(n: int, noun: str) -> str:
    """ "1 job", "2 jobs": a line a person reads in a cron mail."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _days(days: float) -> str:
    return "1 day" if days == 1 else f"{days:g} days"
