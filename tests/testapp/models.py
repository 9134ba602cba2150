"""A table that test tasks write their side effects to, with the fence they held."""

from __future__ import annotations

from django.db import models


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
