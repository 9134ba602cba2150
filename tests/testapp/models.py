"""A table that test tasks write their side effects to, with the fence they held."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


class Effect(models.Model):
    key = models.CharField(max_length=100)
    job_id = models.BigIntegerField()
    fence = models.BigIntegerField()
    worker_id = models.CharField(max_length=200)
    pid = models.IntegerField()
    phase = models.CharField(max_length=20)  # "start" or "done"
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.key} job={self.job_id} fence={self.fence} {self.phase}"


class ItemLog(models.Model):
    """One row per item a backfill processed, with the fence of the claim that did it."""

    item = models.IntegerField()
    fence = models.BigIntegerField()

    def __str__(self) -> str:
        return f"item {self.item} fence {self.fence}"


# -- the chaos suite's effect tables (tests/chaos/) -------------------------------------


class ChaosRun(models.Model):
    """One execution of a chaos job, written unfenced when its handler starts (so that it
    survives a lost claim) and completed in the fenced transaction when it acknowledges.

    ``db_start``/``db_end`` are the database clock; ``local_start`` is the worker's own
    time.time() at the same moment, which gives each worker's clock offset."""

    job_id = models.BigIntegerField()
    key = models.CharField(max_length=100)
    kind = models.CharField(max_length=20)
    fence = models.BigIntegerField()
    worker_id = models.CharField(max_length=200)
    pid = models.IntegerField()
    local_start = models.FloatField()
    db_start = models.DateTimeField(db_default=Now())
    db_end = models.DateTimeField(null=True)

    class Meta:
        indexes = [models.Index(fields=["job_id", "fence"], name="chaos_run_job_idx")]


class ChaosLedger(models.Model):
    """The fenced effect: one row per acknowledged execution, written in the same
    transaction as the ack (fenced(ack=True)). No unique constraint on purpose: the
    suite checks that the queue, not the schema, keeps it to one row per job."""

    job_id = models.BigIntegerField()
    key = models.CharField(max_length=100)
    fence = models.BigIntegerField()
    worker_id = models.CharField(max_length=200)
    db_at = models.DateTimeField(db_default=Now())


class ChaosSlot(models.Model):
    """A per-job row created with the job and written with fenced_update(): ``applied``
    counts the writes that got through, ``fence`` is the newest writer's."""

    key = models.CharField(max_length=100, unique=True)
    fence = models.BigIntegerField(null=True)
    applied = models.IntegerField(default=0)
    worker_id = models.CharField(max_length=200, blank=True, default="")
