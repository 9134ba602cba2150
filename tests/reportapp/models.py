"""A project's own models pointing at jobs, each relation with its on_delete, for the prune
tests (tests/test_prune.py). An app of their own: a project without django_leases installed
(tests/testapp/no_app_settings.py) leaves them out with it."""

from __future__ import annotations

from django.db import models

from django_leases.models import Job


class Report(models.Model):
    """What a project keeps of a job's output: deleted with the job (CASCADE)."""

    job = models.ForeignKey("django_leases.Job", on_delete=models.CASCADE, related_name="reports")


class ReportPage(models.Model):
    """Deleted with its report, so with the report's job."""

    report = models.ForeignKey(Report, on_delete=models.CASCADE, related_name="pages")


class ReportHold(models.Model):
    """Protects its report, so the job under it: neither can be deleted while it exists."""

    report = models.ForeignKey(Report, on_delete=models.PROTECT, related_name="holds")


class Invoice(models.Model):
    """Keeps the job that made it (PROTECT) and forgets the one that retried it (SET_NULL)."""

    job = models.ForeignKey("django_leases.Job", on_delete=models.PROTECT, related_name="+")
    retried_by = models.ForeignKey(
        "django_leases.Job", on_delete=models.SET_NULL, null=True, related_name="retried+"
    )


class Audit(models.Model):
    """Points at its job with DO_NOTHING under a foreign key constraint: the database would
    refuse the job's delete, so the job is kept."""

    job = models.ForeignKey("django_leases.Job", on_delete=models.DO_NOTHING, related_name="+")


class Approval(models.Model):
    """Restricts its job's delete (RESTRICT): the job is kept."""

    job = models.ForeignKey("django_leases.Job", on_delete=models.RESTRICT, related_name="+")


class FailureNote(models.Model):
    """A project's note on one of a job's failures: deleted with the failure, so with the
    job (CASCADE on this app's history, not on the job)."""

    failure = models.ForeignKey(
        "django_leases.JobFailure", on_delete=models.CASCADE, related_name="notes"
    )


class FailureTicket(models.Model):
    """Protects one of a job's failures, so the job: the collector refuses it, it is kept."""

    failure = models.ForeignKey(
        "django_leases.JobFailure", on_delete=models.PROTECT, related_name="+"
    )


class ReportLock(models.Model):
    """Restricts its report's delete (RESTRICT) where no cascade reaches it as well: the
    report's job is kept."""

    report = models.ForeignKey(Report, on_delete=models.RESTRICT, related_name="locks")


class ReportAudit(models.Model):
    """Points at its report with DO_NOTHING under a constraint: the database refuses the
    report's delete (on PostgreSQL and SQLite only at the commit), so its job is kept."""

    report = models.ForeignKey(Report, on_delete=models.DO_NOTHING, related_name="audits")


class FailureAudit(models.Model):
    """Points at one of a job's failures with DO_NOTHING under a constraint: the job is
    kept, and left out of prunable()."""

    failure = models.ForeignKey(
        "django_leases.JobFailure", on_delete=models.DO_NOTHING, related_name="+"
    )


class JobDigest(models.Model):
    """A database view over jobs, say: unmanaged, so Django made neither its table (there
    is none in the tests' databases) nor a constraint under its DO_NOTHING. Prune never
    reads it, as Django's own delete never does."""

    job = models.ForeignKey("django_leases.Job", on_delete=models.DO_NOTHING, related_name="+")

    class Meta:
        managed = False
        db_table = "reportapp_job_digest_view"


class ProjectJob(Job):
    """A project's proxy of Job: pruning through its manager is pruning jobs."""

    class Meta:
        proxy = True


class BillingJob(Job):
    """A project's subclass of Job (multi-table inheritance): its row goes with its job."""

    customer = models.CharField(max_length=40)


class PriorityBillingJob(BillingJob):
    """A subclass of the project's subclass of Job: its rows go with their jobs too."""

    level = models.PositiveSmallIntegerField(default=1)


class BillingHold(models.Model):
    """Protects a project's subclass of Job (PROTECT on BillingJob): the job under it is
    kept, and left out of prunable()."""

    billing = models.ForeignKey(BillingJob, on_delete=models.PROTECT, related_name="+")


class PriorityAudit(models.Model):
    """Points at a subclass of a subclass of Job with DO_NOTHING under a constraint: the
    database would refuse its row's delete, so the job is kept."""

    billing = models.ForeignKey(PriorityBillingJob, on_delete=models.DO_NOTHING, related_name="+")


class LedgerJob(Job):
    """A subclass of Job with a primary key of its own: its link to the job (``job_ptr``)
    is not its key, and its key is not a job's id."""

    code = models.CharField(max_length=20, primary_key=True)


class LedgerHold(models.Model):
    """Protects a LedgerJob by its own key: the job under it is kept."""

    ledger = models.ForeignKey(LedgerJob, on_delete=models.PROTECT, related_name="+")
