"""Pruning finished jobs deletes only finished jobs past retention, in batches that lock
nothing a worker or an operator holds."""

from __future__ import annotations

import re
import threading
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from io import StringIO

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection, connections, transaction
from django.db.models import F
from django.db.models.functions import Now
from django.db.models.signals import post_delete
from django.test.utils import CaptureQueriesContext, override_settings

from django_leases.enqueue_options import EnqueueOptions
from django_leases.models import Job, JobEffect, JobFailure, Schedule, ScheduleRun
from django_leases.schedule_query import RunKind
from django_leases.schedules import Periodic, ScheduleSpec
from django_leases.states import FailureKind, JobState
from tests.reportapp.models import (
    Approval,
    Audit,
    BillingHold,
    BillingJob,
    FailureAudit,
    FailureNote,
    FailureTicket,
    Invoice,
    JobDigest,
    LedgerHold,
    LedgerJob,
    PriorityAudit,
    PriorityBillingJob,
    ProjectJob,
    Report,
    ReportAudit,
    ReportHold,
    ReportLock,
    ReportPage,
)
from tests.worker_helpers import held_open

pytestmark = pytest.mark.django_db(transaction=True)

TASK = "tests.testapp.tasks.add"
WRITES = ("UPDATE", "DELETE", "INSERT", "WITH")


def job(state=JobState.PENDING, *, days_ago=None, failures=0, effects=0):
    queue = "claimed-here" if state == JobState.CLAIMED else "default"
    row = Job.objects.create(task_path=TASK, args=[1, 2], queue_name=queue)
    if state == JobState.CLAIMED:
        [row] = Job.objects.claim("w", [queue])
    elif state != JobState.PENDING:
        Job.objects.filter(pk=row.pk).update(
            state=state, finished_at=Now() - timedelta(days=days_ago or 0)
        )
    for n in range(failures):
        JobFailure.objects.create(job=row, attempt=n + 1, fence=n + 1, kind=FailureKind.EXCEPTION)
    for n in range(effects):
        JobEffect.objects.create(job=row, key=f"effect-{n}", fence=1)
    return row


@contextmanager
def held(rows, count):
    """Another transaction holds ``rows()`` (``count`` of them) with SELECT ... FOR UPDATE,
    as a worker's claim or tick decision does; statements here give up after 20 s of
    waiting meanwhile, so that a wait fails the test rather than hanging it. A no-op
    without row locks (SQLite)."""
    if not connection.features.has_select_for_update_skip_locked:
        yield
        return
    locked, release, errors = threading.Event(), threading.Event(), []

    def holder():
        try:
            with transaction.atomic():
                assert len(list(rows().select_for_update())) == count
                locked.set()
                release.wait(120)
        except Exception as e:  # surfaced below
            errors.append(e)
            locked.set()
        finally:
            connections.close_all()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert locked.wait(60)
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SET lock_timeout = '20s'")
            else:
                cursor.execute("SET SESSION innodb_lock_wait_timeout = 20")
        yield
    finally:
        release.set()
        thread.join(60)
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("RESET lock_timeout")
            else:
                cursor.execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")
    assert errors == []


def test_prune_deletes_old_finished_jobs_with_their_history_a_batch_at_a_time():
    """Invariant 3: what is deleted is finished and past retention, with its failures and
    effects; active jobs and young finished ones stay. Each batch is a statement (or a
    transaction) of its own, so a batch size of 2 over 5 jobs takes at least 3 of them."""
    old = [job(JobState.SUCCEEDED, days_ago=20 + n, failures=1, effects=1) for n in range(4)]
    old.append(job(JobState.CANCELLED, days_ago=30))
    dead = job(JobState.DEAD, days_ago=40, failures=2)
    young = job(JobState.SUCCEEDED, days_ago=1)
    pending = job()
    claimed = job(JobState.CLAIMED)
    with CaptureQueriesContext(connection) as sent:
        assert Job.objects.all().prune(14, batch_size=2) == 5
    deletes = [q for q in sent.captured_queries if "DELETE" in q["sql"].upper()]
    assert len({q["sql"] for q in deletes}) >= 1 and len(deletes) >= 3, deletes
    assert set(Job.objects.values_list("pk", flat=True)) == {
        dead.pk,
        young.pk,
        pending.pk,
        claimed.pk,
    }
    gone = [j.pk for j in old]
    assert not JobFailure.objects.filter(job_id__in=gone).exists()
    assert not JobEffect.objects.filter(job_id__in=gone).exists()
    assert Job.objects.all().prune(14, include_dead=True, batch_size=2) == 1
    assert not JobFailure.objects.filter(job_id=dead.pk).exists()
    assert Job.objects.get(pk=claimed.pk).state == JobState.CLAIMED


def test_prune_passes_over_rows_other_transactions_hold_and_never_waits_for_them():
    """Invariant 3 and the claim's latency: prune locks only the finished rows it deletes,
    with SKIP LOCKED. Another transaction holds a lock on one old finished job and on
    every pending and claimed job; prune, with a lock timeout so that waiting would be an
    error rather than a hang, deletes the others and leaves the held one for next time."""
    if not connection.features.has_select_for_update_skip_locked:
        pytest.skip("needs SKIP LOCKED (PostgreSQL, MySQL 8, MariaDB 10.6)")
    held_job = job(JobState.SUCCEEDED, days_ago=20)
    others = [job(JobState.SUCCEEDED, days_ago=20 + n) for n in range(3)]
    active = [job(), job(JobState.CLAIMED)]
    pks = [held_job.pk, *(j.pk for j in active)]
    with held(lambda: Job.objects.filter(pk__in=pks), 3):
        assert Job.objects.all().prune(14, batch_size=1) == 3
    assert not Job.objects.filter(pk__in=[j.pk for j in others]).exists()
    assert set(Job.objects.values_list("pk", flat=True)) == {held_job.pk, *(j.pk for j in active)}
    assert Job.objects.all().prune(14) == 1


def test_prune_keeps_a_job_requeued_between_its_read_and_its_delete():
    """Invariant 3: the DELETE re-checks the state. On the portable path a batch reads the
    ids first; a job an operator requeues before the delete is pending again and stays.
    (On PostgreSQL the read and the delete are one statement holding the row's lock.)"""
    if connection.vendor == "postgresql":
        pytest.skip("one statement there: nothing can happen between read and delete")
    requeued = job(JobState.DEAD, days_ago=30)
    other = job(JobState.DEAD, days_ago=31)

    def requeue_first(execute, sql, params, many, context):
        if sql.lstrip().upper().startswith("DELETE") and "django_leases_job" in sql:
            # The operator's requeue, in the pruning transaction's place in line.
            Job.objects.filter(pk=requeued.pk).update(state=JobState.PENDING, finished_at=None)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(requeue_first):
        assert Job.objects.all().prune(14, include_dead=True, batch_size=10) == 1
    assert Job.objects.get(pk=requeued.pk).state == JobState.PENDING
    assert not Job.objects.filter(pk=other.pk).exists()


def ticked(*names):
    """Schedules that ticked once through the worker's verbs: {name: (row, its job)}."""
    specs = [ScheduleSpec(name, TASK, Periodic(every=60, args=[1, 2])) for name in names]
    Schedule.objects.sync("default", specs)
    Schedule.objects.enqueue_due("default", _fields)  # plans the first ticks
    return tick_again(*names)


def tick_again(*names):
    """Make the named schedules due and let them decide: {name: (row, the job made)}."""
    Schedule.objects.filter(name__in=names).update(
        next_tick_at=Now() - timedelta(seconds=1), revision=F("revision") + 1
    )
    made = {o.name: o.jobs[0] for o in Schedule.objects.enqueue_due("default", _fields)}
    return {name: (Schedule.objects.get(name=name), made[name]) for name in names}


def _fields(row):
    return EnqueueOptions.of({}).check(TASK)


@pytest.mark.parametrize("days", ["1000000", "1e308", "nan", "-1"])
def test_older_than_days_out_of_range_is_refused_naming_it(days):
    """(6) Before: 1000000 was a DataError traceback and 1e308 an OverflowError one."""
    with pytest.raises(
        CommandError, match=r"--older-than-days: must be at least 0 and at most 36500, got"
    ):
        call_command("leases_prune", "--older-than-days", days, stdout=StringIO())


@pytest.mark.parametrize("size", ["0", "-1", "10001", "99999999999999999999"])
def test_a_batch_size_out_of_range_is_refused_naming_it(size):
    """(6) Before: 99999999999999999999 was a DataError traceback (bigint out of range)."""
    with pytest.raises(
        CommandError, match=r"--batch-size: must be at least 1 and at most 10,000, got"
    ):
        call_command("leases_prune", "--older-than-days", "0", "--batch-size", size)


@pytest.mark.parametrize("command", ["leases_prune", "lease_report"])
def test_a_backend_alias_that_is_no_lease_backend_is_refused_naming_the_flag(command):
    """(3) Before, another backend's alias (or none at all) read the default options:
    prune deleted jobs under the default 14 days where the lease backend kept 90."""
    other = {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"}
    tasks = {**settings.TASKS, "other": other}
    finished = job(JobState.SUCCEEDED, days_ago=30)
    with override_settings(TASKS=tasks):
        for alias, names in (("other", "'other'"), ("nope", "'nope'")):
            with pytest.raises(CommandError, match=rf"--backend: {names} is not a django_leases"):
                call_command(command, "--backend", alias, stdout=StringIO())
    no_lease_backend = override_settings(TASKS={"other": other})
    with no_lease_backend, pytest.raises(CommandError, match=r"None is not .*backends: none"):
        call_command(command, stdout=StringIO())
    assert Job.objects.filter(pk=finished.pk).exists()


def test_prune_counts_one_job_as_one_job():
    """A line a person reads in a cron mail (before: "Deleted 1 jobs ... 1 days ago")."""
    job(JobState.SUCCEEDED, days_ago=3)
    out = StringIO()
    call_command("leases_prune", "--older-than-days", "1", "--dry-run", stdout=out)
    assert "Would delete 1 job finished more than 1 day ago." in out.getvalue()
    call_command("leases_prune", "--older-than-days", "1", stdout=out)
    assert "Deleted 1 job finished more than 1 day ago." in out.getvalue()
    assert "Deleted 0 schedule runs" in out.getvalue()


class _ReadsFromTheQueueDatabase:
    """A router sending reads to a replica (here "queue") and writes to "default"."""

    def db_for_read(self, model, **hints):
        return "queue"

    def db_for_write(self, model, **hints):
        return "default"


@pytest.mark.django_db(transaction=True, databases=["default", "queue"])
def test_worker_rows_are_pruned_on_the_database_writes_go_to_not_a_replica():
    """WorkerProcess.objects.prune() with a router that reads from a replica: its DELETE
    went to the read database (the replica refuses it, or another database loses rows)."""
    from django_leases.models import WorkerProcess

    WorkerProcess.objects.create(worker_id="gone", hostname="h", pid=1, queues=["*"])
    WorkerProcess.objects.filter(worker_id="gone").update(
        last_seen_at=Now() - timedelta(days=10), stopped_at=Now() - timedelta(days=10)
    )
    router = f"{__name__}._ReadsFromTheQueueDatabase"
    with override_settings(DATABASE_ROUTERS=[router]):
        assert WorkerProcess.objects.prune(7) == 1
    assert not WorkerProcess.objects.using("default").filter(worker_id="gone").exists()
    assert WorkerProcess.objects.using("default").none().prune(7) == 0


def test_prune_says_nothing_at_verbosity_0():
    """Run hourly from cron, a run that went as usual mails nothing (before: three lines
    at -v 0 too)."""
    quiet, told = StringIO(), StringIO()
    call_command("leases_prune", verbosity=0, stdout=quiet)
    call_command("leases_prune", "--dry-run", verbosity=0, stdout=quiet)
    call_command("leases_prune", stdout=told)
    assert quiet.getvalue() == ""
    assert told.getvalue().count("\n") == 4, told.getvalue()


def test_prune_deletes_the_rows_of_workers_gone_longer_than_the_retention_and_a_day():
    """Each restart under the default id (hostname-pid) or a pod's name left a worker row
    for good, and the admin cannot delete one: prune deletes those stopped, or silent,
    more than the days ago and at least a day. A worker silent for hours may be alive
    (paused, cut off from the database): its row stays, or it would stop at its next
    heartbeat."""
    from django_leases.models import WorkerProcess

    def worker(worker_id, *, stopped_days=None, seen_days=0.0):
        WorkerProcess.objects.create(worker_id=worker_id, hostname="h", pid=1, queues=["*"])
        WorkerProcess.objects.filter(worker_id=worker_id).update(
            last_seen_at=Now() - timedelta(days=seen_days),
            stopped_at=None if stopped_days is None else Now() - timedelta(days=stopped_days),
        )

    def left():
        return set(WorkerProcess.objects.values_list("worker_id", flat=True))

    worker("stopped-long-ago", stopped_days=10, seen_days=10)
    worker("crashed-long-ago", seen_days=10)
    worker("stopped-days-ago", stopped_days=3, seen_days=3)
    worker("stopped-lately", stopped_days=0.5, seen_days=0.5)
    worker("silent-for-hours", seen_days=0.1)
    worker("alive")
    out = StringIO()
    call_command("leases_prune", "--older-than-days", "7", "--dry-run", stdout=out)
    assert "Would delete 2 worker rows gone more than 7 days ago." in out.getvalue()
    call_command("leases_prune", "--older-than-days", "7", stdout=out)
    assert "Deleted 2 worker rows gone more than 7 days ago." in out.getvalue()
    assert left() == {"stopped-days-ago", "stopped-lately", "silent-for-hours", "alive"}
    call_command("leases_prune", "--older-than-days", "0", stdout=out)
    assert left() == {"stopped-lately", "silent-for-hours", "alive"}


def test_prune_deletes_old_jobs_a_schedule_made_and_unlinks_its_records():
    """Invariant 3: a job a schedule made is pruned like any other (its run record pointed
    at it, and the foreign key refused the raw DELETE of every such job until prune
    followed it) and its run record loses its job; a schedule's last job stays, however
    old, so that prune never writes to (nor waits for) a schedule row a worker's decision
    holds. ScheduleRun.objects.prune() then deletes the records left without a job once
    they are past retention, never one whose job still exists."""
    first = ticked("nightly", "hourly")
    _, made = first["nightly"]
    live_schedule, live = first["hourly"]  # its job still pending: nothing of it goes
    schedule, last = tick_again("nightly")["nightly"]
    assert (schedule.last_job_id, live_schedule.last_job_id) == (last.pk, live.pk)
    Job.objects.filter(pk__in=[made.pk, last.pk]).update(
        state=JobState.SUCCEEDED, finished_at=Now() - timedelta(days=20)
    )
    skipped_old = ScheduleRun.objects.create(schedule=schedule, kind=RunKind.SKIPPED)
    skipped_young = ScheduleRun.objects.create(schedule=schedule, kind=RunKind.SKIPPED)
    ScheduleRun.objects.filter(pk=skipped_old.pk).update(recorded_at=Now() - timedelta(days=20))
    ScheduleRun.objects.filter(job__isnull=False).update(recorded_at=Now() - timedelta(days=20))
    assert list(Job.objects.all().prunable(14).values_list("pk", flat=True)) == [made.pk]
    out = StringIO()
    call_command("leases_prune", "--dry-run", stdout=out)
    assert "Would delete 1 job finished" in out.getvalue()
    assert "Would delete 2 schedule runs" in out.getvalue()  # made's, and the old skip

    with held(Schedule.objects.all, 2):  # as the schedules' tick decisions do
        assert Job.objects.all().prune(14, batch_size=1) == 1
    assert set(Job.objects.values_list("pk", flat=True)) == {last.pk, live.pk}
    schedule.refresh_from_db()
    assert (schedule.last_job_id, schedule.ticks) == (last.pk, 2)
    runs = ScheduleRun.objects.filter(schedule=schedule, kind=RunKind.TICK)
    assert set(runs.values_list("job_id", flat=True)) == {None, last.pk}

    with held(Schedule.objects.all, 2):
        assert ScheduleRun.objects.prune(14, batch_size=1) == 2  # made's, and the old skip
    left = ScheduleRun.objects.filter(job__isnull=True).values_list("pk", flat=True)
    assert list(left) == [skipped_young.pk]
    assert set(ScheduleRun.objects.filter(job__isnull=False).values_list("job_id", flat=True)) == {
        last.pk,
        live.pk,
    }
    assert ScheduleRun.objects.prune(14) == 0


def test_prune_follows_a_projects_own_models_by_their_on_delete():
    """Invariant 3: a project's models pointing at jobs, or at their failures, no longer
    make prune fail on a foreign key. A job they point at with CASCADE or SET_NULL goes,
    Django's collector applying those to the project's rows (a report and its pages
    deleted, an invoice's link set NULL, a note on a failure deleted). One they PROTECT,
    RESTRICT or point at with DO_NOTHING under a constraint, on the job or its failure,
    stays, and is left out of prunable(); so does one whose report or failure a further
    model protects, restricts or points at under a constraint (the collector or the
    database refuses it; the rest of its batch goes). Once nothing holds them, they go.
    Runs the PostgreSQL statement too, which leaves the jobs pointed at to the
    collector."""
    olds = [job(JobState.SUCCEEDED, days_ago=20 + n, failures=1) for n in range(13)]
    (reported, held_back, invoiced, retry, plain, audited, approved, noted, ticketed) = olds[:9]
    locked, report_audited, failure_audited, _ = olds[9:]
    young = job(JobState.SUCCEEDED, days_ago=1)
    report = Report.objects.create(job=reported)
    ReportPage.objects.create(report=report)
    keepers = [
        ReportHold.objects.create(report=Report.objects.create(job=held_back)),
        Invoice.objects.create(job=invoiced, retried_by=retry),
        Audit.objects.create(job=audited),
        Approval.objects.create(job=approved),
        FailureTicket.objects.create(failure=ticketed.failures.get()),
        ReportLock.objects.create(report=Report.objects.create(job=locked)),
        ReportAudit.objects.create(report=Report.objects.create(job=report_audited)),
        FailureAudit.objects.create(failure=failure_audited.failures.get()),
    ]
    FailureNote.objects.create(failure=noted.failures.get())
    Report.objects.create(job=young)
    protected = {invoiced.pk, audited.pk, approved.pk, ticketed.pk, failure_audited.pk}
    assert (
        set(Job.objects.all().prunable(14).values_list("pk", flat=True))
        == {j.pk for j in olds} - protected
    )

    assert Job.objects.all().prune(14, batch_size=2) == 5  # reported, retry, plain, noted, _
    kept = {held_back.pk, locked.pk, report_audited.pk, *protected}
    assert set(Job.objects.values_list("pk", flat=True)) == kept | {young.pk}
    assert not ReportPage.objects.exists() and not FailureNote.objects.exists()
    assert set(Report.objects.values_list("job_id", flat=True)) == {
        held_back.pk,
        locked.pk,
        report_audited.pk,
        young.pk,
    }
    keepers[1].refresh_from_db()
    assert (keepers[1].job_id, keepers[1].retried_by_id) == (invoiced.pk, None)
    assert set(JobFailure.objects.values_list("job_id", flat=True)) == kept

    for keeper in keepers:
        keeper.delete()
    assert Job.objects.all().prune(14) == len(kept)
    assert list(Job.objects.values_list("pk", flat=True)) == [young.pk]
    assert list(Report.objects.values_list("job_id", flat=True)) == [young.pk]


def test_prune_in_the_callers_transaction_keeps_what_the_database_refuses():
    """Invariant 3: called inside the caller's atomic block, where each batch is only a
    savepoint and PostgreSQL and SQLite would check the foreign keys at the caller's
    commit, a job whose report the database holds to (DO_NOTHING under a constraint) is
    still kept at its batch, the others go, and the caller's transaction commits."""
    audited, reported = (job(JobState.SUCCEEDED, days_ago=20 + n) for n in range(2))
    ReportAudit.objects.create(report=Report.objects.create(job=audited))
    Report.objects.create(job=reported)
    with transaction.atomic():
        assert Job.objects.all().prune(14) == 1
    assert list(Job.objects.values_list("pk", flat=True)) == [audited.pk]
    assert list(Report.objects.values_list("job_id", flat=True)) == [audited.pk]


def deleted_ids(sql, params):
    """The parameters of a statement's list of job ids (``"id" IN (%s, ...)``), none if
    it has no such list: not any other parameter that happens to equal a job's id."""
    found = re.search(r'[`"]id[`"] IN \(((?:%s, )*%s)\)', sql)
    if not found:
        return ()
    first = sql[: found.start()].count("%s")
    return tuple(params[first : first + found.group(1).count("%s")])


@pytest.mark.parametrize("in_transaction", [False, True], ids=["own", "callers"])
def test_prune_keeps_a_job_the_database_keeps_refusing_and_prunes_the_others(in_transaction):
    """Invariant 3: prune never stops at a job it cannot delete. A project's row pointing at
    the oldest job appears in each transaction that deletes it, before the commit (as a
    reference committed while the batch ran would, or a row a database-level cascade
    reaches): the batch fails on the foreign key, is sent again, then goes a job at a
    time. That job is kept for this run, left out of the batches after it (one job each
    here); the three after it go, on every database's path (PostgreSQL's one statement
    included: there the row comes just after it). Inside a caller's transaction the same,
    the refusal met at the batch, and the caller commits."""
    stuck, *others = (job(JobState.SUCCEEDED, days_ago=30 - n) for n in range(4))
    referring = []

    def refer():
        referring.append(True)  # the wrapper's own statements pass through it too
        try:
            Report.objects.create(job_id=stuck.pk)
        finally:
            referring.clear()

    def refer_to_stuck(execute, sql, params, many, context):
        deletes = sql.lstrip().upper().startswith(("DELETE", "WITH"))
        if referring or not deletes or "django_leases_job" not in sql:
            return execute(sql, params, many, context)
        if isinstance(params, dict):  # PostgreSQL's one statement
            result = execute(sql, params, many, context)
            referring.append(True)
            try:
                gone = not Job.objects.filter(pk=stuck.pk).exists()
            finally:
                referring.clear()
            if gone:
                refer()
            return result
        if stuck.pk in deleted_ids(sql, params):
            refer()
        return execute(sql, params, many, context)

    callers = transaction.atomic() if in_transaction else nullcontext()
    with connection.execute_wrapper(refer_to_stuck), callers:
        assert Job.objects.all().prune(14, batch_size=1) == 3
    assert list(Job.objects.values_list("pk", flat=True)) == [stuck.pk]
    assert not Report.objects.exists()  # each went with the transaction that failed
    assert Job.objects.all().prune(14) == 1


def test_prune_of_jobs_a_project_points_at_never_writes_to_a_schedule():
    """Invariant 3: the collector's batches, like the others, never write to (nor wait
    for) a schedule row a worker's decision holds: a schedule's old job with a report goes
    while every schedule is locked, no statement names the schedule table, and the
    schedule's last job stays although a report points at it too."""
    _, made = ticked("reported")["reported"]
    schedule, last = tick_again("reported")["reported"]
    Job.objects.filter(pk__in=[made.pk, last.pk]).update(
        state=JobState.SUCCEEDED, finished_at=Now() - timedelta(days=20)
    )
    Report.objects.create(job=made)
    Report.objects.create(job=last)
    table = connection.ops.quote_name(Schedule._meta.db_table)
    with held(Schedule.objects.all, 1), CaptureQueriesContext(connection) as sent:
        assert Job.objects.all().prune(14) == 1
    writes = [q["sql"] for q in sent.captured_queries if q["sql"].lstrip().startswith(WRITES)]
    assert writes and not [sql for sql in writes if table in sql.split(" WHERE")[0]], writes
    assert list(Job.objects.values_list("pk", flat=True)) == [last.pk]
    assert list(Report.objects.values_list("job_id", flat=True)) == [last.pk]
    schedule.refresh_from_db()
    assert schedule.last_job_id == last.pk


class KeepProjectsOffTheQueue:
    """docs/operations.md's QueueRouter, as far as prune is concerned: the project's apps
    have no tables on the queue database."""

    def allow_migrate(self, db, app_label, **hints):
        return None if app_label == "django_leases" else db != "queue"


@pytest.mark.django_db(transaction=True, databases=["default", "queue"])
def test_prune_reads_no_table_that_is_not_on_the_jobs_database():
    """Invariant 3: a project's model with no table of Django's on the jobs' database is
    not read. JobDigest, unmanaged (a view, say; no table here), points at jobs with
    DO_NOTHING: prunable() and prune() work as if it were not there (they read its
    missing table before). On the queue database, where a router keeps the project's
    apps away, prune reads none of their tables, though on the default database it
    follows them."""
    assert not JobDigest._meta.managed
    old = job(JobState.SUCCEEDED, days_ago=20)
    assert list(Job.objects.all().prunable(14).values_list("pk", flat=True)) == [old.pk]
    assert Job.objects.all().prune(14) == 1

    queued = Job.objects.using("queue").create(task_path=TASK, args=[1, 2])
    Job.objects.using("queue").filter(pk=queued.pk).update(
        state=JobState.SUCCEEDED, finished_at=Now() - timedelta(days=20)
    )
    with override_settings(DATABASE_ROUTERS=[KeepProjectsOffTheQueue()]):
        with CaptureQueriesContext(connections["queue"]) as sent:
            assert Job.objects.using("queue").all().prunable(14).count() == 1
            assert Job.objects.using("queue").all().prune(14) == 1
        read = [q["sql"] for q in sent.captured_queries]
        assert read and not [sql for sql in read if "reportapp_" in sql], read
        with CaptureQueriesContext(connection) as sent:
            assert Job.objects.all().prune(14) == 0
        assert [q for q in sent.captured_queries if Report._meta.db_table in q["sql"]]
    assert not Job.objects.using("queue").exists()


def test_prune_through_a_proxy_and_of_a_projects_subclasses_of_job():
    """Invariant 3: prune called through a project's proxy of Job follows the project's
    models as through Job (a report deleted with its job; it failed on the report's
    foreign key before). A project's subclass of Job (multi-table inheritance), and a
    subclass of that, lose their rows with their jobs; the jobs go by prune's own DELETE,
    after their history, counted once, with no delete signal for them (the collector
    deleted the parent jobs before, and the count came short), and no statement names the
    schedule table (the collector's own walk of a job's relations would unlink a
    schedule's last job). Prune through a subclass's own manager is refused."""
    reported = job(JobState.SUCCEEDED, days_ago=20, failures=1)
    Report.objects.create(job=reported)
    billed = BillingJob.objects.create(task_path=TASK, args=[1, 2], customer="acme")
    urgent = PriorityBillingJob.objects.create(task_path=TASK, args=[1, 2], customer="vip")
    Job.objects.filter(pk__in=[billed.pk, urgent.pk]).update(
        state=JobState.SUCCEEDED, finished_at=Now() - timedelta(days=21)
    )
    for row in (billed, urgent):
        JobFailure.objects.create(job=row, attempt=1, fence=1, kind=FailureKind.EXCEPTION)
    young = BillingJob.objects.create(task_path=TASK, args=[1, 2], customer="young")
    signalled = []

    def deleted(sender, instance, **kwargs):
        signalled.append(sender)

    with pytest.raises(TypeError, match="Job.objects"):
        BillingJob.objects.all().prune(14)
    with pytest.raises(TypeError, match="Job.objects"):
        PriorityBillingJob.objects.all().prunable(14)
    table = connection.ops.quote_name(Schedule._meta.db_table)
    post_delete.connect(deleted, weak=False)
    try:
        with CaptureQueriesContext(connection) as sent:
            assert ProjectJob.objects.all().prune(14, batch_size=1) == 3
    finally:
        post_delete.disconnect(deleted)
    writes = [q["sql"] for q in sent.captured_queries if q["sql"].lstrip().startswith(WRITES)]
    assert writes and not [sql for sql in writes if table in sql.split(" WHERE")[0]], writes
    assert {BillingJob, PriorityBillingJob} <= set(signalled) and Job not in signalled
    assert list(Job.objects.values_list("pk", flat=True)) == [young.pk]
    assert list(BillingJob.objects.values_list("customer", flat=True)) == ["young"]
    assert not PriorityBillingJob.objects.exists()
    assert not Report.objects.exists() and not JobFailure.objects.exists()


def test_prune_keeps_a_job_whose_subclass_row_a_projects_model_holds():
    """Invariant 3: a project's model that protects the row of its subclass of Job
    (PROTECT on BillingJob, and on LedgerJob, whose primary key is its own, not the
    job's id), or points under a constraint at the row of a subclass of that (DO_NOTHING
    on PriorityBillingJob), keeps the job as one pointing at Job does: left out of
    prunable() (counted before, and tried again at every run), never sent to a DELETE
    (before, the collector's DELETE of the subclass row was sent, and refused by the
    database), and on PostgreSQL left out of the one-statement batch itself, which is
    never sent again (a batch the foreign keys refuse is). Once nothing holds them, they
    go with their subclass rows."""
    billed = BillingJob.objects.create(task_path=TASK, args=[1, 2], customer="acme")
    urgent = PriorityBillingJob.objects.create(task_path=TASK, args=[1, 2], customer="vip")
    ledger = LedgerJob.objects.create(task_path=TASK, args=[1, 2], code="L-7")
    jobs = {billed.pk, urgent.pk, ledger.job_ptr_id}
    Job.objects.filter(pk__in=jobs).update(
        state=JobState.SUCCEEDED, finished_at=Now() - timedelta(days=21)
    )
    keepers = [
        BillingHold.objects.create(billing=billed),
        PriorityAudit.objects.create(billing=urgent),
        LedgerHold.objects.create(ledger=ledger),
    ]
    assert not Job.objects.all().prunable(14).exists()

    with CaptureQueriesContext(connection) as sent:
        assert Job.objects.all().prune(14) == 0
    statements = [q["sql"].strip() for q in sent.captured_queries]
    assert [sql for sql in statements if sql.startswith(("DELETE", "UPDATE"))] == []
    batches = [sql for sql in statements if sql.startswith("WITH doomed")]
    assert len(batches) == len(set(batches)), batches  # one per state, none sent again
    assert bool(batches) == (connection.vendor == "postgresql")
    assert set(PriorityBillingJob.objects.values_list("pk", flat=True)) == {urgent.pk}
    assert set(BillingJob.objects.values_list("pk", flat=True)) == {billed.pk, urgent.pk}
    assert list(LedgerJob.objects.values_list("code", flat=True)) == ["L-7"]

    for keeper in keepers:
        keeper.delete()
    assert set(Job.objects.all().prunable(14).values_list("pk", flat=True)) == jobs
    assert Job.objects.all().prune(14) == 3
    assert not Job.objects.exists() and not BillingJob.objects.exists()
    assert not LedgerJob.objects.exists()


def test_prune_refuses_a_database_missing_a_migration_before_writing():
    """Invariant 3: on a database that lacks one of the app's migrations, leases_prune
    stops with the migrate command to run before it writes anything: met halfway, a
    missing table failed the run after jobs were already deleted."""
    old = job(JobState.SUCCEEDED, days_ago=40)
    late = Job.objects.create(task_path=TASK, args=[1, 2])
    Job.objects.filter(pk=late.pk).update(deadline=Now() - timedelta(days=1))
    call_command("migrate", "django_leases", "0007", verbosity=0)
    try:
        # 0008 and every later one, named; the command to run them.
        with pytest.raises(
            CommandError, match=r"lacks django_leases migrations 0008_\w+(, 0\d{3}_\w+)*; run:"
        ):
            call_command("leases_prune", "--older-than-days", "14", verbosity=0)
    finally:
        call_command("migrate", verbosity=0)
    assert Job.objects.filter(pk=old.pk).exists()
    assert Job.objects.get(pk=late.pk).state == JobState.PENDING


def test_purge_finished_keeps_what_a_projects_row_protects_and_deletes_the_rest():
    """Invariant 3: one job of the selection a project's row protects (PROTECT), restricts
    (RESTRICT) or points at under a constraint (DO_NOTHING) made purge_finished() raise
    ProtectedError (a 500 in the admin) and purge none of the others. It keeps those and
    deletes the rest, with what they cascade to, in a caller's transaction too."""
    invoiced, approved, audited, held_back, reported, plain = (
        job(JobState.SUCCEEDED, days_ago=0, failures=1) for _ in range(6)
    )
    Invoice.objects.create(job=invoiced)
    Approval.objects.create(job=approved)
    Audit.objects.create(job=audited)
    # Protected further along (a hold on its report): refused by the collector, so its
    # chunk goes again a job at a time.
    ReportHold.objects.create(report=Report.objects.create(job=held_back))
    Report.objects.create(job=reported)
    kept = {invoiced.pk, approved.pk, audited.pk, held_back.pk}
    everyone = Job.objects.filter(pk__in=[*kept, reported.pk, plain.pk])
    with transaction.atomic():
        assert everyone.purge_finished() == 2
    assert set(Job.objects.values_list("pk", flat=True)) == kept
    assert set(JobFailure.objects.values_list("job_id", flat=True)) == kept
    assert list(Report.objects.values_list("job_id", flat=True)) == [held_back.pk]
    assert everyone.purge_finished() == 0


def test_a_job_requeued_while_purge_finished_reads_it_stays():
    """Invariant 3: purge_finished() read a cancelled job, then deleted it by id (Django's
    delete() puts no state in its DELETE): a requeue committed in between, by an operator
    or another admin, lost the job, pending again ("1 of 1 purged"). The purge locks what
    it reads; waiting on the requeue's lock, it reads the job pending and leaves it. (On
    SQLite the purge's IMMEDIATE transaction takes its turn before it reads.)"""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite's IMMEDIATE transactions take turns: no lock to wait on")
    cancelled = job(JobState.CANCELLED, days_ago=0)
    outcome = []

    def purge():
        try:
            outcome.append(Job.objects.filter(pk=cancelled.pk).purge_finished())
        except Exception as e:  # noqa: BLE001 -- reported by the assertion below
            outcome.append(e)
        finally:
            connection.close()

    with held_open(lambda: Job.objects.filter(pk=cancelled.pk).requeue()) as held:
        purger = threading.Thread(target=purge)
        purger.start()
        # Without this wait the test could pass with no race at all.
        assert held.until_it_blocks_another(), "the purge never waited: no race"
    purger.join(30)
    assert outcome == [0]
    assert Job.objects.get(pk=cancelled.pk).state == JobState.PENDING
