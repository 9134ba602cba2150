"""The job record, its failure history and the worker processes that hold leases.

Models know nothing of workers: every transition is a JobQuerySet verb (query.py and
the mixins it is composed from).
"""

from __future__ import annotations

from django.db import models
from django.db.models import Case, F, When
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from .conf import DEFAULT_LEASE_SECONDS, MAX_LEASE_SECONDS, MIN_LEASE_SECONDS
from .enqueue_options import TASK_PATH_LENGTH
from .lookups import case_blind
from .query import JobQuerySet
from .schedule_query import RunKind, ScheduleQuerySet, ScheduleRunQuerySet
from .schedules import NAME_LENGTH as SCHEDULE_NAME_LENGTH
from .states import ACTIVE_STATES, DeadReason, FailureKind, JobState, LeaseLostPolicy
from .worker_registry import WorkerQuerySet


class Job(models.Model):
    """One call of a registered task. Lease fields are written only by JobQuerySet verbs."""

    queue_name = models.CharField(_("queue"), max_length=100, default="default")
    task_path = models.CharField(_("task"), max_length=TASK_PATH_LENGTH)
    args = models.JSONField(_("args"), default=list, blank=True)
    kwargs = models.JSONField(_("kwargs"), default=dict, blank=True)
    # Higher runs first, as in django.tasks (-100..100).
    priority = models.SmallIntegerField(_("priority"), default=0)
    state = models.CharField(
        _("state"), max_length=10, choices=JobState.choices, default=JobState.PENDING
    )

    # The caller's own run_after (Django Tasks' Task.run_after), kept as given: available_at
    # starts there but moves with retries and releases. NULL: due at enqueue (or a delay).
    run_after = models.DateTimeField(_("run after"), null=True, blank=True)
    # NULL: parked, waiting for a person to release (retry now) or cancel it.
    available_at = models.DateTimeField(_("available at"), db_default=Now(), null=True, blank=True)
    lease_seconds = models.FloatField(_("lease (s)"), default=DEFAULT_LEASE_SECONDS)
    lease_expires_at = models.DateTimeField(_("lease expires at"), null=True, blank=True)
    claim_token = models.UUIDField(_("claim token"), null=True, blank=True)
    # Grows by one at every claim; handed to the handler to fence writes outside the queue.
    fence = models.BigIntegerField(_("fence"), default=0)
    attempts = models.PositiveIntegerField(_("attempts"), default=0)
    max_attempts = models.PositiveIntegerField(_("max attempts"), default=5)
    # Claims that ended because the lease ran out, counted apart from handler failures.
    leases_lost = models.PositiveIntegerField(_("leases lost"), default=0)
    # Claims given back at a worker's stop, their attempt not counted, since a checkpoint
    # last moved the cursor: past UNCOUNTED_RELEASES a release counts (a handler that stops
    # its own worker would otherwise run forever). A database default: raw INSERTs leave
    # it out.
    releases = models.PositiveIntegerField(_("releases"), default=0, db_default=0)
    claimed_by = models.CharField(_("claimed by"), max_length=200, blank=True, default="")
    heartbeat_at = models.DateTimeField(_("last heartbeat"), null=True, blank=True)

    # Database clock: past it the job is dead-lettered whatever attempts it has left.
    deadline = models.DateTimeField(_("deadline"), null=True, blank=True)
    # Retry.to_json() of the ladder for ordinary failures; NULL means the default ladder.
    retry = models.JSONField(_("retry ladder"), null=True, blank=True)
    on_lease_lost = models.CharField(
        _("when a lease is lost"),
        max_length=10,
        choices=LeaseLostPolicy.choices,
        default=LeaseLostPolicy.RETRY,
    )
    dead_reason = models.CharField(
        _("dead because"), max_length=20, choices=DeadReason.choices, blank=True, default=""
    )
    # At most one pending or claimed job per key (enqueue refuses or merges a second one).
    # NULL, not "", means "no key": only keyed active jobs may collide on active_key.
    unique_key = models.CharField(_("unique key"), max_length=200, null=True, blank=True)  # noqa: DJ001
    active_key = models.GeneratedField(
        expression=Case(When(state__in=list(ACTIVE_STATES), then=F("unique_key"))),
        output_field=models.CharField(max_length=200, null=True),
        db_persist=True,
        unique=True,
    )

    cursor = models.JSONField(_("checkpoint cursor"), null=True, blank=True)
    result = models.JSONField(_("result"), null=True, blank=True)

    enqueued_at = models.DateTimeField(_("enqueued at"), db_default=Now())
    started_at = models.DateTimeField(_("first claimed at"), null=True, blank=True)
    last_attempted_at = models.DateTimeField(_("last claimed at"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)

    objects = JobQuerySet.as_manager()

    # What a claim (claiming.py) sets on the jobs it returns: the state, owner, fence and granted
    # lease each had before the claim. Not fields: never saved.
    was_state: str
    was_claimed_by: str
    was_fence: int
    was_lease: float | None

    class Meta:
        verbose_name = _("job")
        verbose_name_plural = _("jobs")
        indexes = [
            # The claim's two halves: pending jobs in claim order (an ordered scan, whatever the
            # queues), and expired claims.
            models.Index(
                fields=["-priority", "available_at", "id"],
                name="leases_job_due_idx",
                condition=models.Q(state=JobState.PENDING),
            ),
            models.Index(
                fields=["lease_expires_at"],
                name="leases_job_claimed_idx",
                condition=models.Q(state=JobState.CLAIMED),
            ),
            models.Index(
                fields=["claim_token"],
                name="leases_job_token_idx",
                condition=models.Q(claim_token__isnull=False),
            ),
            models.Index(fields=["state", "finished_at"], name="leases_job_finished_idx"),
            # The admin: its per-queue/task/state counts become an index-only scan, and the
            # queue filter an index range instead of a walk over every job.
            models.Index(fields=["queue_name", "task_path", "state"], name="leases_job_census_idx"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=~models.Q(state=JobState.CLAIMED)
                | (models.Q(lease_expires_at__isnull=False) & models.Q(claim_token__isnull=False)),
                name="leases_job_claimed_has_lease",
            ),
            models.CheckConstraint(
                condition=models.Q(priority__gte=-100, priority__lte=100),
                name="leases_job_priority_range",
            ),
            # A row written straight into the table with a lease of zero, a negative one or
            # NaN would be taken over the moment it is claimed; the database refuses it.
            models.CheckConstraint(
                condition=models.Q(
                    lease_seconds__gte=MIN_LEASE_SECONDS, lease_seconds__lte=MAX_LEASE_SECONDS
                ),
                name="leases_job_lease_range",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.task_path} #{self.pk} ({self.state})"


class JobFailure(models.Model):
    """One attempt that did not succeed: an exception, an expired lease, an unrunnable row."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="failures")
    attempt = models.PositiveIntegerField(_("attempt"))
    fence = models.BigIntegerField(_("fence"))
    worker_id = models.CharField(_("worker"), max_length=200, blank=True, default="")
    kind = models.CharField(_("kind"), max_length=20, choices=FailureKind.choices)
    exception_class_path = models.CharField(_("exception"), max_length=255, blank=True, default="")
    message = models.TextField(_("message"), blank=True, default="")
    traceback = models.TextField(_("traceback"), blank=True, default="")
    recorded_at = models.DateTimeField(_("recorded at"), db_default=Now())

    class Meta:
        verbose_name = _("job failure")
        verbose_name_plural = _("job failures")
        # In the order they happened: a requeue numbers the attempts from 1 again.
        ordering = ["job", "id"]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.attempt}: {self.kind}"


class WorkerProcess(models.Model):
    """A run_lease_worker process, as it last reported itself (times on the DB clock)."""

    worker_id = models.CharField(_("worker id"), max_length=200, unique=True)
    # A token of the process that holds the id now: a second process started under the same
    # id neither marks this one stopped nor passes for it (WorkerQuerySet.register()). The
    # database fills both for a worker of an earlier release, which writes neither.
    instance = models.CharField(_("instance"), max_length=32, db_default="", editable=False)
    # Where /proc finds that process: boot id, pid namespace, pid, start time and user
    # (worker/identity.py). A process of the same boot, pid namespace and user tells a
    # holder that died (kill -9) from a live one at once, instead of waiting out its
    # silence; "" where /proc cannot tell (not Linux), and for a worker of an earlier release.
    process_key = models.CharField(_("process key"), max_length=200, db_default="", editable=False)
    # Its renewal period: silent for conf.silent_after() of it, it is taken for gone.
    heartbeat_seconds = models.FloatField(
        _("heartbeat (s)"), db_default=DEFAULT_LEASE_SECONDS / 3, editable=False
    )
    hostname = models.CharField(_("host"), max_length=255)
    pid = models.PositiveIntegerField(_("pid"))
    queues = models.JSONField(_("queues"), default=list)
    started_at = models.DateTimeField(_("started at"), db_default=Now())
    last_seen_at = models.DateTimeField(_("last seen"), db_default=Now())
    stopped_at = models.DateTimeField(_("stopped at"), null=True, blank=True)

    objects = WorkerQuerySet.as_manager()

    class Meta:
        verbose_name = _("worker process")
        verbose_name_plural = _("worker processes")

    def __str__(self) -> str:
        return self.worker_id


class JobEffect(models.Model):
    """A side effect a job recorded as done, in the same transaction as the effect itself,
    so that a later attempt of the same job can skip it."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="effects")
    key = models.CharField(_("effect"), max_length=200)
    fence = models.BigIntegerField(_("fence"))
    recorded_at = models.DateTimeField(_("recorded at"), db_default=Now())

    class Meta:
        verbose_name = _("job effect")
        verbose_name_plural = _("job effects")
        constraints = [models.UniqueConstraint(fields=["job", "key"], name="leases_effect_once")]

    def __str__(self) -> str:
        return f"job {self.job_id}: {self.key}"


class Schedule(models.Model):
    """A periodic schedule declared in code (``@task(schedule=...)`` or
    ``OPTIONS["SCHEDULES"]``), synced here at worker start, and where it stands: the tick
    last decided and the job it made, the next tick, on the database clock. Moved only by
    ScheduleQuerySet verbs (schedule_query.py)."""

    name = models.CharField(_("name"), max_length=SCHEDULE_NAME_LENGTH, unique=True)
    backend = models.CharField(_("backend"), max_length=100, default="default")
    task_path = models.CharField(_("task"), max_length=TASK_PATH_LENGTH)
    # Periodic.to_json(): cron or every, timezone, args, kwargs, misfire, grace, overlap.
    spec = models.JSONField(_("schedule"))
    paused = models.BooleanField(_("paused"), default=False)
    # Set when the code no longer declares it: it stops ticking, its history stays.
    removed_at = models.DateTimeField(_("removed from code at"), null=True, blank=True)
    # NULL: planned from the database's now at the next decision (new, resumed, changed).
    next_tick_at = models.DateTimeField(_("next tick"), null=True, blank=True)
    last_tick_at = models.DateTimeField(_("last tick"), null=True, blank=True)
    last_job = models.ForeignKey(
        Job,
        verbose_name=_("last job"),
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    decided_at = models.DateTimeField(_("last decided at"), null=True, blank=True)
    # Ticks decided, ticks missed (workers down past the grace) and not run, ticks skipped
    # because the previous job was still active.
    ticks = models.PositiveBigIntegerField(_("ticks"), default=0)
    misfires = models.PositiveBigIntegerField(_("misfires"), default=0)
    skipped = models.PositiveBigIntegerField(_("skipped"), default=0)
    # Grows at every write: a decision's UPDATE is conditional on the revision it read.
    revision = models.PositiveBigIntegerField(_("revision"), default=0)
    created_at = models.DateTimeField(_("created at"), db_default=Now())
    synced_at = models.DateTimeField(_("synced at"), db_default=Now())

    objects = ScheduleQuerySet.as_manager()

    class Meta:
        verbose_name = _("schedule")
        verbose_name_plural = _("schedules")
        ordering = ["name"]
        indexes = [models.Index(fields=["next_tick_at"], name="leases_schedule_next_idx")]

    def __str__(self) -> str:
        return self.name


class ScheduleRun(models.Model):
    """One tick a schedule decided (a job, or skipped while the previous one was active),
    or one "run now": how a job links back to the schedule that made it."""

    schedule = models.ForeignKey(Schedule, on_delete=models.CASCADE, related_name="runs")
    # The tick's time; NULL for "run now", which is not a tick.
    tick_at = models.DateTimeField(_("tick"), null=True, blank=True)
    kind = models.CharField(_("kind"), max_length=10, choices=RunKind.choices)
    job = models.OneToOneField(
        Job, null=True, blank=True, on_delete=models.SET_NULL, related_name="schedule_run"
    )
    recorded_at = models.DateTimeField(_("recorded at"), db_default=Now())

    objects = ScheduleRunQuerySet.as_manager()

    class Meta:
        verbose_name = _("schedule run")
        verbose_name_plural = _("schedule runs")
        ordering = ["-id"]
        constraints = [
            # Belt and braces under the conditional UPDATE: one record per tick.
            models.UniqueConstraint(
                fields=["schedule", "tick_at"], name="leases_schedule_tick_once"
            )
        ]

    def __str__(self) -> str:
        return f"{self.schedule_id} {self.kind} {self.tick_at or ''}"


# The columns migration 0009 gives a binary collation on MySQL: icontains (the admin's
# search) still ignores case there.
case_blind(Job, "queue_name", "unique_key", "claimed_by")
case_blind(JobFailure, "worker_id")
case_blind(Schedule, "name")
case_blind(WorkerProcess, "worker_id")
case_blind(JobEffect, "key")
